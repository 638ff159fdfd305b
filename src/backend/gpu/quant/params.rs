//! The kernels of `wgsl/quant.wgsl` and their launch parameters: the uniform block
//! ([`Params`]) of a matvec or tiled GEMM, the kernel and workgroup grid a product
//! launches with ([`Params::launch`], [`Params::launch_tiled`]), and the parameters of a
//! resident weight or of a routed projection.

use safetensors::Dtype;

use super::super::device::{grid, uniform_block, Access, Kernel, ROUTE_TILE_SIZES};
use super::super::{DeviceBuffer, GpuWeight};
use crate::checkpoint::{PieceKind, Projection, RecordLayout};

/// act, w, aux, out (see `wgsl/quant.wgsl`).
const BINDINGS: &[Access] = &[Access::Read, Access::Read, Access::Read, Access::ReadWrite];
/// The matmul entries also bind the expert table and the shared expert's weight (the
/// routed matvecs compute it beside the routed experts; unused elsewhere).
const MATMUL_BINDINGS: &[Access] = &[
    Access::Read,
    Access::Read,
    Access::Read,
    Access::ReadWrite,
    Access::Read,
    Access::Read,
];
const fn matmul_kernel(entry: &'static str) -> Kernel {
    Kernel::new("quant.wgsl", entry, MATMUL_BINDINGS)
}
const QMATMUL: Kernel = matmul_kernel("qmatmul");
/// [`QMATMUL`] with three more outputs (bindings 7 to 9).
const QMATMUL_PARTS: Kernel = Kernel::new(
    "quant.wgsl",
    "qmatmul_parts",
    &[
        Access::Read,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
        Access::ReadWrite,
        Access::ReadWrite,
    ],
);
/// Most parts [`QMATMUL_PARTS`] writes.
pub(super) const MAX_PARTS: usize = 4;
const QMATMUL_SWIGLU: Kernel = matmul_kernel("qmatmul_swiglu");
/// The routed matvec variants that also compute the shared expert's routes
/// ([`Params::with_shared`]); the others are compiled without its branch.
const SHARED_ROUTES: &[(&str, &str)] = &[(
    "const SHARED_ROUTES: bool = false;",
    "const SHARED_ROUTES: bool = true;",
)];
const QMATMUL_SHARED: Kernel = QMATMUL.with_defines(SHARED_ROUTES);
const QMATMUL_SWIGLU_SHARED: Kernel = QMATMUL_SWIGLU.with_defines(SHARED_ROUTES);
/// The tiled entries of many tokens: like [`QMATMUL`], [`QMATMUL_PARTS`] and
/// [`QMATMUL_SWIGLU`].
const GEMM: Kernel = matmul_kernel("gemm");
const GEMM_PARTS: Kernel = Kernel {
    entry: "gemm_parts",
    ..QMATMUL_PARTS
};
const GEMM_SWIGLU: Kernel = matmul_kernel("gemm_swiglu");
/// [`GEMM`] and [`GEMM_SWIGLU`] in tiles of [`NARROW_TILE_ROUTES`] routes.
const GEMM_NARROW: Kernel = matmul_kernel("gemm_narrow");
const GEMM_SWIGLU_NARROW: Kernel = matmul_kernel("gemm_swiglu_narrow");
/// Tokens (or routes) and output rows of one tile (`GM` and `GN` in the shader).
pub(super) const TILE_TOKENS: usize = ROUTE_TILE_SIZES[1];
const TILE_ROWS: usize = 128;
/// Routes of a narrow tile (`GM_NARROW` in the shader), for records that get few routes.
pub(super) const NARROW_TILE_ROUTES: usize = ROUTE_TILE_SIZES[0];
/// Mean routes per record up to which a layer's routed products take narrow tiles: a
/// record of r routes takes ceil(r / 16) narrow tiles or ceil(r / 64) wide ones, and a
/// narrow tile costs less than half a wide one where a wide one is mostly empty
/// (BENCHMARKS.md, "Prefill: narrow tiles for the routed experts").
pub(super) const NARROW_MAX_MEAN_ROUTES: usize = 24;
/// Tokens from which a resident weight's product runs in tiles: below it a tile would
/// be mostly padding, and reading the weight once per token costs less than that.
pub(super) const TILED_MIN_TOKENS: usize = 16;
const DENSE: Kernel = matmul_kernel("matmul_dense");
pub(super) const EMBED: Kernel = Kernel::new("quant.wgsl", "embed", BINDINGS);
/// The combine binds the shared expert's output and gate where the matmuls bind the
/// weights and the expert table, then the norm's output (7), the residual (8) and the
/// norm's weight (9).
pub(super) const COMBINE: Kernel = Kernel::new(
    "quant.wgsl",
    "moe_combine",
    &[
        Access::Read,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
        Access::Read,
        Access::Read,
    ],
);
/// Invocations per qmatmul workgroup (`WG` in the shader).
const WG: usize = 256;
/// Output rows each lane group of a large quantized matvec computes (`ROWS` in the
/// shader), so one load of the activations serves that many rows' weights.
const QMATMUL_ROWS: usize = 4;
/// 16-byte vectors of packed weights (rows x tokens or routes x vectors per row) from
/// which a matvec takes [`QMATMUL_ROWS`] rows per lane group. Measured on the H200
/// (BENCHMARKS.md): 4 rows made lm_head (151,936 x 2,048) 2.4x faster and every matrix
/// of 4,096 x 2,048 or more (and the routed experts, 10 routes) faster, but matrices of
/// 32,768 to 65,536 vectors (the shared expert, the router) 1.4-1.9x slower: with a
/// quarter of the invocations, their latency shows.
const QMATMUL_ROWS_MIN_VECTORS: usize = 1 << 18;

pub(super) fn dtype_code(d: Dtype) -> u32 {
    match d {
        Dtype::F32 => 0,
        Dtype::F16 => 1,
        _ => 2,
    }
}

pub(super) fn elem_bytes(code: u32) -> usize {
    if code == 0 {
        4
    } else {
        2
    }
}

uniform_block! {
    /// Uniform block of `wgsl/quant.wgsl` (its `Params`, field for field).
    pub(in crate::backend::gpu) struct Params {
        pub(super) rows: u32,
        pub(super) cols: u32,
        pub(super) bits: u32,
        pub(super) group_size: u32,
        pub(super) scale_dtype: u32,
        pub(super) w_off: u32,
        pub(super) s_off: u32,
        pub(super) b_off: u32,
        pub(super) routed: u32,
        pub(super) k: u32,
        pub(super) tokens: u32,
        pub(super) arena: u32,
        /// The SwiGLU entries' up projection, like `w_off`, `s_off`, `b_off`, `bits` and
        /// `group_size`.
        pub(super) w_off2: u32,
        pub(super) s_off2: u32,
        pub(super) b_off2: u32,
        pub(super) bits2: u32,
        pub(super) group_size2: u32,
        /// Output width when a dispatch writes a column range of a wider output (0:
        /// `rows`), and the first column it writes: a weight split into row ranges.
        pub(super) out_cols: u32,
        pub(super) out_first: u32,
        /// Invocations per output row (set by [`Params::launch`]).
        pub(super) lanes: u32,
        /// Experts in the expert table (routed = 2, 3).
        pub(super) experts: u32,
        /// moe_combine: 1 adds the shared expert.
        pub(super) add_shared: u32,
        /// qmatmul_parts: where the first three parts of the output end (rows); 0 for
        /// an output in one part (see [`Params::parts`]).
        pub(super) part_end_a: u32,
        pub(super) part_end_b: u32,
        pub(super) part_end_c: u32,
        /// gemm entries, routed = 4: tiles in the tile list (see `wgsl/quant.wgsl`).
        pub(super) tiles: u32,
        /// Quantized matvec entries: output rows per lane group, 1 or [`QMATMUL_ROWS`]
        /// (set by [`Params::launch`]).
        pub(super) row_group: u32,
        /// gemm entries, routed = 4: the tile list entry of the dispatch's first tile.
        pub(super) first_tile: u32,
        /// Routed matvecs (routed = 2, 3): the first route that is the shared expert's (0:
        /// none), and the shared weight's bits, group size, scale dtype and offsets, like
        /// `bits` ... `b_off2` (see [`Params::with_shared`]).
        pub(super) shared_from: u32,
        pub(super) sh_bits: u32,
        pub(super) sh_group: u32,
        pub(super) sh_dtype: u32,
        pub(super) sh_w_off: u32,
        pub(super) sh_s_off: u32,
        pub(super) sh_b_off: u32,
        pub(super) sh_w_off2: u32,
        pub(super) sh_s_off2: u32,
        pub(super) sh_b_off2: u32,
        /// moe_combine with `add_shared` = 2: the element of its input where the shared
        /// expert's rows start.
        pub(super) shared_at: u32,
        /// moe_combine: 0 writes the combined output, 1 adds it to the residual, 2 also
        /// writes the sum's RMSNorm with epsilon `eps`; invocations per token and tokens
        /// per workgroup (`norm.wgsl`'s `tpg` and `gpw`).
        pub(super) residual: u32,
        pub(super) eps: f32,
        pub(super) tpg: u32,
        pub(super) gpw: u32,
        /// Whether scales and biases lie in row quads (a resident weight, see
        /// [`super::upload_weight`]) rather than MLX's layout (a record): bit 0 for the
        /// weight, bit 1 for the shared expert's weight ([`Params::with_shared`]).
        pub(super) quads: u32,
    }
}

impl Params {
    /// Whether the output is split into parts ([`QMATMUL_PARTS`], [`GEMM_PARTS`]).
    fn parts(&self) -> bool {
        self.part_end_a != 0
    }

    /// Checks what the kernels' 16-byte loads need: 4 or 8 bits, whole 16-byte runs of
    /// packed words within a group (128 / bits columns) whose width is a power of two,
    /// packed words 16-byte aligned. The loader guarantees it (4 or 8 bits, groups of 32,
    /// 64 or 128 dividing the input size; record pieces on 16-byte boundaries), so a
    /// failure is a bug, not bad input.
    pub(super) fn check_vec4(&self) {
        assert!(
            self.fits_vec4(),
            "quantized matmul: {} bits, {} columns, groups of {}, words at {}",
            self.bits,
            self.cols,
            self.group_size,
            self.w_off
        );
    }

    /// Whether these parameters meet what [`Params::check_vec4`] checks.
    pub(super) fn fits_vec4(&self) -> bool {
        let span = 128 / self.bits.max(1);
        matches!(self.bits, 4 | 8)
            && self.cols.is_multiple_of(span)
            && self.group_size.is_power_of_two()
            && self.group_size.is_multiple_of(span)
            && self.w_off.is_multiple_of(4)
    }

    /// The up projection's half of SwiGLU parameters (`bits2` ... `b_off2`) as parameters
    /// of their own.
    pub(super) fn up_half(&self) -> Params {
        Params {
            bits: self.bits2,
            group_size: self.group_size2,
            w_off: self.w_off2,
            s_off: self.s_off2,
            b_off: self.b_off2,
            ..*self
        }
    }

    /// The entry, uniform words and workgroup grid of a matmul of these parameters over
    /// `z` tokens or routes: `matmul_dense` for dense weights (no bits), `qmatmul_parts`
    /// for an output in parts, `qmatmul_swiglu` when an up projection is given (`bits2`),
    /// else `qmatmul` (their variants that read the shared expert's routes where
    /// [`Params::with_shared`] gave some); a quantized projection
    /// must meet [`Params::check_vec4`]. Lanes per row: 16, doubled while the dispatch has
    /// fewer than `invocations` invocations (the device's
    /// [`Gpu::invocations`](super::super::Gpu::invocations)) and a row has work for them
    /// (a lane per 16-byte vector of packed words, or per dense column). How a
    /// row's sum is split over lanes depends on the dispatch's size, so its last bits can
    /// differ between a token computed alone and in a batch.
    ///
    /// With `tiled` (the device's [`Gpu::tiled`](super::super::Gpu::tiled)), a resident
    /// weight's product of [`TILED_MIN_TOKENS`] or more tokens runs in tiles instead
    /// ([`Params::launch_tiled`]).
    pub(super) fn launch(
        mut self,
        z: usize,
        tiled: bool,
        invocations: usize,
    ) -> (&'static Kernel, Params, [u32; 3]) {
        if tiled && self.routed == 0 && z >= TILED_MIN_TOKENS && self.tileable() {
            self.tokens = z as u32;
            return self.launch_tiled(z.div_ceil(TILE_TOKENS), TILE_TOKENS);
        }
        let (cols, bits) = (self.cols as usize, self.bits as usize);
        let (kernel, units) = if bits == 0 {
            (&DENSE, cols)
        } else {
            self.check_vec4();
            let shared = self.shared_from != 0;
            if self.parts() {
                (&QMATMUL_PARTS, cols * bits / 128)
            } else if self.bits2 == 0 {
                let kernel = if shared { &QMATMUL_SHARED } else { &QMATMUL };
                (kernel, cols * bits / 128)
            } else {
                self.up_half().check_vec4();
                let kernel = if shared {
                    &QMATMUL_SWIGLU_SHARED
                } else {
                    &QMATMUL_SWIGLU
                };
                (kernel, cols * bits / 128)
            }
        };
        let rows = self.rows as usize;
        let mut lanes = 16;
        while lanes < WG && rows * z.max(1) * lanes < invocations && lanes * 2 <= units {
            lanes *= 2;
        }
        self.lanes = lanes as u32;
        // A lane group computes QMATMUL_ROWS rows of a large quantized weight, one row of
        // a small one or a dense one.
        let large = rows * z.max(1) * units >= QMATMUL_ROWS_MIN_VECTORS;
        let per_group = if bits != 0 && large { QMATMUL_ROWS } else { 1 };
        self.row_group = per_group as u32;
        let [x, y] = grid(rows.div_ceil(WG / lanes * per_group) as u32);
        (kernel, self, [x, y, z as u32])
    }

    /// Whether the tiled entries take these parameters: a dense weight of whole 16-byte
    /// rows, or a quantized one that meets [`Params::check_vec4`] (checked), the fused
    /// SwiGLU's two projections quantized alike.
    pub(super) fn tileable(&self) -> bool {
        if self.bits == 0 {
            return self.cols.is_multiple_of(4);
        }
        self.check_vec4();
        self.bits2 == 0
            || (self.bits2 == self.bits
                && self.group_size2 == self.group_size
                && self.w_off2.is_multiple_of(4))
    }

    /// The tiled entry for these parameters over `tiles` tiles of tokens (routed = 0,
    /// [`TILE_TOKENS`] each) or of routes (routed = 4: the tile list's from `first_tile`
    /// on, `tiles` set to the entries before its route list), and its grid:
    /// `gemm_parts` for an output in parts, `gemm_swiglu` with an up projection, else
    /// `gemm`; their narrow forms for a routed list of tiles of `tile` =
    /// [`NARROW_TILE_ROUTES`] routes ([`TILE_TOKENS`] otherwise). The parameters must be
    /// [`Params::tileable`].
    pub(super) fn launch_tiled(
        self,
        tiles: usize,
        tile: usize,
    ) -> (&'static Kernel, Params, [u32; 3]) {
        let rows = self.rows as usize;
        let narrow = tile == NARROW_TILE_ROUTES;
        assert!(
            tile == TILE_TOKENS || (narrow && self.routed == 4 && !self.parts()),
            "launch_tiled: tiles of {tile}"
        );
        let (kernel, per_tile) = if self.parts() {
            (&GEMM_PARTS, TILE_ROWS)
        } else if self.bits2 != 0 {
            let kernel = if narrow {
                &GEMM_SWIGLU_NARROW
            } else {
                &GEMM_SWIGLU
            };
            (kernel, TILE_ROWS / 2)
        } else {
            (if narrow { &GEMM_NARROW } else { &GEMM }, TILE_ROWS)
        };
        (
            kernel,
            self,
            [rows.div_ceil(per_tile) as u32, tiles as u32, 1],
        )
    }

    /// Parameters of a resident quantized weight (packed words at 0 in its buffer), and
    /// the buffer; `None` for a dense or split weight.
    pub(super) fn resident(w: &GpuWeight) -> Option<(Self, &DeviceBuffer)> {
        let GpuWeight::Quantized {
            spec,
            rows,
            cols,
            scale_dtype,
            s_off,
            b_off,
            data,
        } = w
        else {
            return None;
        };
        let params = Params {
            rows: *rows as u32,
            cols: *cols as u32,
            bits: spec.bits,
            group_size: spec.group_size as u32,
            scale_dtype: *scale_dtype,
            s_off: *s_off,
            b_off: *b_off,
            quads: 1,
            ..Default::default()
        };
        Some((params, data))
    }

    /// [`Params::resident`] of a stacked `[Wg; Wu]` `[2 I, in]` for the SwiGLU entries:
    /// `I` rows, the up projection's words, scales and biases `I` rows in (`bits2` ...
    /// `b_off2`); `None` where `I` is not a multiple of 4 (the up rows would not start a
    /// row quad). Panics on an odd row count.
    pub(super) fn resident_swiglu(w: &GpuWeight) -> Option<(Self, &DeviceBuffer)> {
        let (whole, data) = Self::resident(w)?;
        let (rows, cols) = (whole.rows as usize, whole.cols as usize);
        assert_eq!(rows % 2, 0, "matmul_swiglu: odd row count {rows}");
        let inter = rows / 2;
        if !inter.is_multiple_of(4) {
            return None;
        }
        let words = inter * cols / (32 / whole.bits as usize);
        // In row quads, I rows' scales and biases take 2 elements per group and row.
        let elems = (2 * inter * cols / whole.group_size as usize) as u32;
        let params = Params {
            rows: inter as u32,
            w_off2: words as u32,
            s_off2: whole.s_off + elems,
            b_off2: whole.b_off + elems,
            bits2: whole.bits,
            group_size2: whole.group_size,
            ..whole
        };
        Some((params, data))
    }

    /// Parameters of projection `proj` of records laid out by `layout` over `routes`
    /// routes (which ones, and how they are found,
    /// [`Routes::apply`](super::experts::Routes::apply) sets).
    pub(super) fn routed(layout: &RecordLayout, proj: Projection, routes: usize) -> Self {
        let code = dtype_code(layout.scale_dtype);
        let eb = elem_bytes(code);
        let p = proj.index();
        let (rows, cols) = layout.shape(proj);
        let off = |kind| layout.offsets[RecordLayout::piece(proj, kind)];
        Params {
            rows: rows as u32,
            cols: cols as u32,
            bits: layout.specs[p].bits,
            group_size: layout.specs[p].group_size as u32,
            scale_dtype: code,
            w_off: (off(PieceKind::Weight) / 4) as u32,
            s_off: (off(PieceKind::Scales) / eb) as u32,
            b_off: (off(PieceKind::Biases) / eb) as u32,
            tokens: routes as u32,
            ..Default::default()
        }
    }

    /// The gate projection's parameters with the up projection's, for the fused SwiGLU
    /// entries.
    pub(super) fn routed_gate_up(layout: &RecordLayout, routes: usize) -> Self {
        let up = Self::routed(layout, Projection::Up, routes);
        Params {
            w_off2: up.w_off,
            s_off2: up.s_off,
            b_off2: up.b_off,
            bits2: up.bits,
            group_size2: up.group_size,
            ..Self::routed(layout, Projection::Gate, routes)
        }
    }

    /// These routed matvec parameters with routes from `from` on computed from the shared
    /// expert's weight `shared` (resident parameters, [`Params::resident`]), with
    /// `shared`'s up projection's offsets where it has them (`bits2`).
    pub(super) fn with_shared(self, from: usize, shared: &Params) -> Self {
        Params {
            shared_from: from as u32,
            sh_bits: shared.bits,
            sh_group: shared.group_size,
            sh_dtype: shared.scale_dtype,
            sh_w_off: shared.w_off,
            sh_s_off: shared.s_off,
            sh_b_off: shared.b_off,
            sh_w_off2: shared.w_off2,
            sh_s_off2: shared.s_off2,
            sh_b_off2: shared.b_off2,
            quads: self.quads | (shared.quads & 1) << 1,
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gpu::device::INVOCATIONS;

    /// The shader's `ROWS` is the host's [`QMATMUL_ROWS`]: the grid counts rows per lane
    /// group as the kernel computes them.
    #[test]
    fn the_shader_computes_as_many_rows_per_lane_group_as_the_host_counts() {
        let source = include_str!("../../../../wgsl/quant.wgsl");
        assert!(source.contains(&format!("const ROWS: u32 = {QMATMUL_ROWS}u;")));
    }

    /// The tiles' sizes the host grids and groups routes by are the shader's.
    #[test]
    fn the_shader_tiles_are_the_sizes_the_host_counts() {
        let source = include_str!("../../../../wgsl/quant.wgsl");
        for (name, value) in [
            ("GM", TILE_TOKENS),
            ("GN", TILE_ROWS),
            ("GM_NARROW", NARROW_TILE_ROUTES),
        ] {
            let line = format!("const {name}: u32 = {value}u;");
            assert!(source.contains(&line), "wgsl/quant.wgsl lacks `{line}`");
        }
    }

    /// Large matrices take [`QMATMUL_ROWS`] rows per lane group and small ones one, at the
    /// shapes the GPU tests use to reach each path (tests/gpu/quant.rs).
    #[test]
    fn matvecs_take_four_rows_from_the_threshold() {
        let quantized = |rows: u32, cols: u32, bits: u32| Params {
            rows,
            cols,
            bits,
            group_size: 64,
            ..Default::default()
        };
        let group = |p: Params, z: usize| {
            let (_, params, _) = p.launch(z, false, INVOCATIONS);
            params.row_group
        };
        assert_eq!(group(quantized(4099, 1024, 4), 2), QMATMUL_ROWS as u32);
        assert_eq!(group(quantized(4099, 1024, 8), 2), QMATMUL_ROWS as u32);
        assert_eq!(group(quantized(1027, 2048, 4), 2), 1);
        assert_eq!(group(quantized(151_936, 2048, 4), 1), QMATMUL_ROWS as u32);
        assert_eq!(group(quantized(512, 2048, 8), 1), 1);
        // The routed experts of tests/gpu/quant.rs at 8 tokens, 2 routes each.
        assert_eq!(group(quantized(640, 1024, 4), 16), QMATMUL_ROWS as u32);
        assert_eq!(group(quantized(1024, 640, 4), 16), QMATMUL_ROWS as u32);
        // Dense weights keep one row per lane group.
        assert_eq!(group(quantized(4099, 1024, 0), 2), 1);
    }
}
