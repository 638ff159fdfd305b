//! Quantized matmul, embedding rows and the routed-expert gather-matmul (`wgsl/quant.wgsl`).
//!
//! Routed experts are computed from slot memory: each dispatch gets a table of
//! (record base, token) per route, or, when the routing stayed on the device, the routed
//! ids and the layer's table of (arena, record base) per expert, so one dispatch covers
//! every routed expert of a layer that lives in one arena. Records from a pool are
//! mirrored in device arenas and copied only when a slot's generation changed; records
//! without a slot are uploaded per call. The routed experts' combine also adds the shared
//! expert.

use safetensors::Dtype;

use super::device::{grid, uniform_block, Access, Bind, Kernel};
use super::route_tiles;
use super::{DeviceBuffer, GpuBackend, GpuTensor, GpuWeight, Mirror};
use crate::backend::{Routing, SharedExpert};
use crate::checkpoint::{LinearWeight, PieceKind, Projection, RecordLayout};
use crate::error::{Error, Result};
use crate::records::ExpertRecord;

/// act, w, aux, out (see `wgsl/quant.wgsl`).
const BINDINGS: &[Access] = &[Access::Read, Access::Read, Access::Read, Access::ReadWrite];
/// The matmul entries also bind the expert table.
const MATMUL_BINDINGS: &[Access] = &[
    Access::Read,
    Access::Read,
    Access::Read,
    Access::ReadWrite,
    Access::Read,
];
const fn matmul_kernel(entry: &'static str) -> Kernel {
    Kernel::new("quant.wgsl", entry, MATMUL_BINDINGS)
}
const QMATMUL: Kernel = matmul_kernel("qmatmul");
/// [`QMATMUL`] with three more outputs (bindings 6 to 8).
const QMATMUL_PARTS: Kernel = Kernel::new(
    "quant.wgsl",
    "qmatmul_parts",
    &[
        Access::Read,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
        Access::Read,
        Access::ReadWrite,
        Access::ReadWrite,
        Access::ReadWrite,
    ],
);
/// Most parts [`QMATMUL_PARTS`] writes.
const MAX_PARTS: usize = 4;
const QMATMUL_SWIGLU: Kernel = matmul_kernel("qmatmul_swiglu");
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
const TILE_TOKENS: usize = 64;
const TILE_ROWS: usize = 128;
/// Routes of a narrow tile (`GM_NARROW` in the shader), for records that get few routes.
const NARROW_TILE_ROUTES: usize = 16;
/// Mean routes per record up to which a layer's routed products take narrow tiles: a
/// record of r routes takes ceil(r / 16) narrow tiles or ceil(r / 64) wide ones, and a
/// narrow tile costs less than half a wide one where a wide one is mostly empty
/// (BENCHMARKS.md, "Prefill: narrow tiles for the routed experts").
const NARROW_MAX_MEAN_ROUTES: usize = 24;
/// Tokens from which a resident weight's product runs in tiles: below it a tile would
/// be mostly padding, and reading the weight once per token costs less than that.
pub(super) const TILED_MIN_TOKENS: usize = 16;
const DENSE: Kernel = matmul_kernel("matmul_dense");
const EMBED: Kernel = Kernel::new("quant.wgsl", "embed", BINDINGS);
/// The combine binds the shared expert's output and gate where the matmuls bind the
/// weights and the expert table.
const COMBINE: Kernel = matmul_kernel("moe_combine");
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

fn dtype_code(d: Dtype) -> u32 {
    match d {
        Dtype::F32 => 0,
        Dtype::F16 => 1,
        _ => 2,
    }
}

fn elem_bytes(code: u32) -> usize {
    if code == 0 {
        4
    } else {
        2
    }
}

uniform_block! {
    /// Uniform block of `wgsl/quant.wgsl` (its `Params`, field for field).
    pub(super) struct Params {
        rows: u32,
        cols: u32,
        bits: u32,
        group_size: u32,
        scale_dtype: u32,
        w_off: u32,
        s_off: u32,
        b_off: u32,
        routed: u32,
        k: u32,
        tokens: u32,
        arena: u32,
        /// The SwiGLU entries' up projection, like `w_off`, `s_off`, `b_off`, `bits` and
        /// `group_size`.
        w_off2: u32,
        s_off2: u32,
        b_off2: u32,
        bits2: u32,
        group_size2: u32,
        /// Output width when a dispatch writes a column range of a wider output (0:
        /// `rows`), and the first column it writes: a weight split into row ranges.
        out_cols: u32,
        out_first: u32,
        /// Invocations per output row (set by [`Params::launch`]).
        lanes: u32,
        /// Experts in the expert table (routed = 2, 3).
        experts: u32,
        /// moe_combine: 1 adds the shared expert.
        add_shared: u32,
        /// qmatmul_parts: where the first three parts of the output end (rows); 0 for
        /// an output in one part (see [`Params::parts`]).
        part_end_a: u32,
        part_end_b: u32,
        part_end_c: u32,
        /// gemm entries, routed = 4: tiles in the tile list (see `wgsl/quant.wgsl`).
        tiles: u32,
        /// Quantized matvec entries: output rows per lane group, 1 or [`QMATMUL_ROWS`]
        /// (set by [`Params::launch`]).
        row_group: u32,
        /// gemm entries, routed = 4: the tile list entry of the dispatch's first tile.
        first_tile: u32,
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
    fn check_vec4(&self) {
        let span = 128 / self.bits.max(1);
        assert!(
            matches!(self.bits, 4 | 8)
                && self.cols.is_multiple_of(span)
                && self.group_size.is_power_of_two()
                && self.group_size.is_multiple_of(span)
                && self.w_off.is_multiple_of(4),
            "quantized matmul: {} bits, {} columns, groups of {}, words at {}",
            self.bits,
            self.cols,
            self.group_size,
            self.w_off
        );
    }

    /// The entry, uniform words and workgroup grid of a matmul of these parameters over
    /// `z` tokens or routes: `matmul_dense` for dense weights (no bits), `qmatmul_parts`
    /// for an output in parts, `qmatmul_swiglu` when an up projection is given (`bits2`),
    /// else `qmatmul`; a quantized projection
    /// must meet [`Params::check_vec4`]. Lanes per row: 16, doubled while the dispatch has
    /// fewer than `invocations` invocations (the device's [`super::Gpu::invocations`]) and
    /// a row has work for them (a lane per 16-byte vector of packed words, or per dense
    /// column). How a
    /// row's sum is split over lanes depends on the dispatch's size, so its last bits can
    /// differ between a token computed alone and in a batch.
    ///
    /// With `tiled` (the device's [`super::Gpu::tiled`]), a resident weight's product of
    /// [`TILED_MIN_TOKENS`] or more tokens runs in tiles instead ([`Params::launch_tiled`]).
    fn launch(
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
            if self.parts() {
                (&QMATMUL_PARTS, cols * bits / 128)
            } else if self.bits2 == 0 {
                (&QMATMUL, cols * bits / 128)
            } else {
                Params {
                    bits: self.bits2,
                    group_size: self.group_size2,
                    w_off: self.w_off2,
                    ..self
                }
                .check_vec4();
                (&QMATMUL_SWIGLU, cols * bits / 128)
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
    fn tileable(&self) -> bool {
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
    fn launch_tiled(self, tiles: usize, tile: usize) -> (&'static Kernel, Params, [u32; 3]) {
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
    fn resident(w: &GpuWeight) -> Option<(Self, &DeviceBuffer)> {
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
            ..Default::default()
        };
        Some((params, data))
    }

    /// Parameters of projection `proj` of records laid out by `layout` over `routes`
    /// routes (which ones, and how they are found, [`Routes::apply`] sets).
    fn routed(layout: &RecordLayout, proj: Projection, routes: usize) -> Self {
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
    fn routed_gate_up(layout: &RecordLayout, routes: usize) -> Self {
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
}

/// Which routes a routed dispatch computes: those whose records lie in `arena` (the
/// arena it binds), found as `routed` says (`wgsl/quant.wgsl`), with `k` experts per
/// token and `experts` in the layer's expert table (routed = 2, 3).
#[derive(Clone, Copy)]
struct Routes {
    arena: usize,
    routed: u32,
    k: usize,
    experts: usize,
}

impl Routes {
    fn apply(self, params: Params) -> Params {
        Params {
            arena: self.arena as u32,
            routed: self.routed,
            k: self.k as u32,
            experts: self.experts as u32,
            ..params
        }
    }
}

/// `silu(x W_gate^T) * (x W_up^T)` of the routed records that `aux` names (a route table,
/// or routed ids with the expert `table`; `routed` as in `wgsl/quant.wgsl`) in `arena`
/// into `out` `[routes, inter]`, in one dispatch.
fn routed_swiglu(
    b: &GpuBackend,
    layout: &RecordLayout,
    [x, arena, aux, table]: [Bind<'_>; 4],
    which: Routes,
    out: &GpuTensor,
) {
    let params = which.apply(Params::routed_gate_up(layout, out.rows));
    let binds = [x, arena, aux, Bind::Buffer(&out.buf), table];
    let (kernel, params, groups) = params.launch(out.rows, false, b.gpu.invocations);
    b.gpu.dispatch_with(kernel, &params, &binds, groups);
}

/// Bytes of mirror copies queued before they are submitted and waited for, which bounds
/// the staging memory a first use (or a preload) of many records holds.
const MIRROR_WRITE_BATCH: usize = 256 << 20;

/// Packed words, scales and biases in one buffer (each part starting on a 4-byte
/// boundary, the whole padded to 16 bytes), as the kernels read them.
pub(super) fn upload_weight(b: &GpuBackend, w: LinearWeight) -> Result<GpuWeight> {
    let max = b.gpu.limits.max_storage_buffer_binding_size;
    let (rows, cols) = w.shape();
    // Bytes per row as laid out below, and the padding a part may add.
    let row_bytes = match &w {
        LinearWeight::Quantized(q) => {
            (q.packed.len() * 4 + q.scales.len() + q.biases.len()) as u64 / rows.max(1) as u64
        }
        LinearWeight::Dense(_) => cols as u64 * 4,
    };
    const PADDING: u64 = 32;
    if row_bytes * rows as u64 + PADDING > max {
        let per = (max.saturating_sub(PADDING) / row_bytes.max(1)) as usize;
        if per == 0 {
            return Err(Error::Gpu(format!(
                "one row of a {rows}x{cols} weight needs {row_bytes} bytes, above the adapter's storage binding limit of {max}"
            )));
        }
        let parts = (0..rows)
            .step_by(per)
            .map(|first| {
                let range: Vec<usize> = (first..(first + per).min(rows)).collect();
                Ok((first, upload_part(b, w.select_rows(&range), max)?))
            })
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(
            rows,
            cols,
            parts = parts.len(),
            "weight split into row ranges"
        );
        return Ok(GpuWeight::Rows(parts));
    }
    upload_part(b, w, max)
}

/// One binding's worth of [`upload_weight`].
fn upload_part(b: &GpuBackend, w: LinearWeight, max: u64) -> Result<GpuWeight> {
    match w {
        LinearWeight::Quantized(q) => {
            let code = dtype_code(q.scale_dtype);
            let mut bytes: Vec<u8> = bytemuck::cast_slice(&q.packed).to_vec();
            let s_start = bytes.len();
            bytes.extend_from_slice(&q.scales);
            bytes.resize(bytes.len().next_multiple_of(4), 0);
            let b_start = bytes.len();
            bytes.extend_from_slice(&q.biases);
            // Whole 16-byte vectors, so the matmuls' vec4 view reaches the last bias.
            bytes.resize(bytes.len().next_multiple_of(16), 0);
            if bytes.len() as u64 > max {
                return Err(Error::Gpu(format!(
                    "a {}x{} weight needs {} bytes, above the adapter's storage binding limit of {max}",
                    q.rows,
                    q.cols,
                    bytes.len()
                )));
            }
            Ok(GpuWeight::Quantized {
                spec: q.spec,
                rows: q.rows,
                cols: q.cols,
                scale_dtype: code,
                s_off: (s_start / elem_bytes(code)) as u32,
                b_off: (b_start / elem_bytes(code)) as u32,
                data: b.gpu.plain(b.gpu.buffer_with(&bytes)),
            })
        }
        LinearWeight::Dense(d) => {
            let bytes = (d.data.len() * 4) as u64;
            if bytes > max {
                return Err(Error::Gpu(format!(
                    "a {}x{} f32 weight needs {bytes} bytes, above the adapter's storage binding limit of {max}",
                    d.rows, d.cols
                )));
            }
            Ok(GpuWeight::Dense {
                rows: d.rows,
                cols: d.cols,
                data: b
                    .gpu
                    .plain(b.gpu.buffer_with(bytemuck::cast_slice(&d.data))),
            })
        }
    }
}

/// [`crate::backend::Backend::matmul_swiglu`]: a quantized `[Wg; Wu]` in one fused
/// dispatch, a dense one as a matmul and an elementwise SwiGLU over the halves.
pub(super) fn matmul_swiglu(b: &GpuBackend, x: &GpuTensor, w: &GpuWeight) -> GpuTensor {
    let Some((whole, data)) = Params::resident(w) else {
        return super::elementwise::swiglu_halves(b, &matmul(b, x, w));
    };
    let (rows, cols) = (whole.rows as usize, whole.cols as usize);
    assert_eq!(x.cols, cols, "matmul_swiglu input width");
    assert_eq!(rows % 2, 0, "matmul_swiglu: odd row count {rows}");
    let inter = rows / 2;
    // The up projection's rows start `inter` rows into each part.
    let words = inter * cols / (32 / whole.bits as usize);
    let groups = (inter * cols / whole.group_size as usize) as u32;
    let params = Params {
        rows: inter as u32,
        w_off2: words as u32,
        s_off2: whole.s_off + groups,
        b_off2: whole.b_off + groups,
        bits2: whole.bits,
        group_size2: whole.group_size,
        ..whole
    };
    let out = b.empty(x.rows, inter);
    let (kernel, params, groups) = params.launch(x.rows, b.gpu.tiled, b.gpu.invocations);
    let dummy = &b.gpu.dummy;
    b.gpu.dispatch(
        kernel,
        &params,
        &[&x.buf, data, dummy, &out.buf, dummy],
        groups,
    );
    out
}

pub(super) fn embed(b: &GpuBackend, table: &GpuWeight, ids: &[u32]) -> Result<GpuTensor> {
    let (rows, cols) = table.shape();
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= rows) {
        return Err(Error::InvalidInput(format!(
            "token id {bad} is out of range for a vocabulary of {rows}"
        )));
    }
    let out = b.empty(ids.len(), cols);
    embed_into(b, table, ids, &out);
    Ok(out)
}

/// Row `ids[t]` of `table` into row `t` of `out`, for every `t` whose id is not [`SKIP`].
fn embed_into(b: &GpuBackend, table: &GpuWeight, ids: &[u32], out: &GpuTensor) {
    let cols = out.cols;
    match table {
        GpuWeight::Quantized { .. } => {
            let (params, data) = Params::resident(table).expect("a quantized weight");
            let ids = bytemuck::cast_slice(ids);
            let binds = [
                Bind::Buffer(&b.gpu.dummy),
                Bind::Buffer(data),
                Bind::Data(ids),
                Bind::Buffer(&out.buf),
            ];
            b.gpu
                .dispatch_with(&EMBED, &params, &binds, [1, 1, ids.len() as u32 / 4]);
        }
        GpuWeight::Dense { data, .. } => {
            for (t, &id) in ids.iter().enumerate().filter(|(_, &id)| id != SKIP) {
                b.gpu.copy(
                    data,
                    (id as usize * cols * 4) as u64,
                    &out.buf,
                    (t * cols * 4) as u64,
                    (cols * 4) as u64,
                );
            }
        }
        GpuWeight::Rows(parts) => {
            for (first, part) in parts {
                let range = *first as u32..(*first + part.shape().0) as u32;
                let local: Vec<u32> = ids
                    .iter()
                    .map(|&id| {
                        if range.contains(&id) {
                            id - range.start
                        } else {
                            SKIP
                        }
                    })
                    .collect();
                if local.iter().any(|&id| id != SKIP) {
                    embed_into(b, part, &local, out);
                }
            }
        }
    }
}

/// An embedding id that the part of a split table at hand does not hold
/// (`0xFFFFFFFF` in `wgsl/quant.wgsl`'s `embed`).
const SKIP: u32 = u32::MAX;

/// [`crate::backend::Backend::matmul_parts`]: a quantized weight of up to [`MAX_PARTS`]
/// parts in one dispatch that writes each part's output; otherwise one matmul, then a
/// column gather per part.
pub(super) fn matmul_parts(
    b: &GpuBackend,
    x: &GpuTensor,
    w: &GpuWeight,
    widths: &[usize],
) -> Vec<GpuTensor> {
    let (rows, cols) = w.shape();
    assert_eq!(x.cols, cols, "matmul_parts input width");
    assert_eq!(
        widths.iter().sum::<usize>(),
        rows,
        "matmul_parts: part widths"
    );
    assert!(widths.iter().all(|&n| n > 0), "matmul_parts: an empty part");
    let Some((whole, data)) = Params::resident(w).filter(|_| widths.len() <= MAX_PARTS) else {
        return crate::backend::matmul_parts_by_gather(b, x, w, widths);
    };
    let outs: Vec<GpuTensor> = widths.iter().map(|&n| b.empty(x.rows, n)).collect();
    let mut part_ends = [rows as u32; 3];
    let mut end = 0;
    for (slot, &n) in part_ends.iter_mut().zip(widths) {
        end += n as u32;
        *slot = end;
    }
    let params = Params {
        part_end_a: part_ends[0],
        part_end_b: part_ends[1],
        part_end_c: part_ends[2],
        ..whole
    };
    let (kernel, params, groups) = params.launch(x.rows, b.gpu.tiled, b.gpu.invocations);
    let dummy = &b.gpu.dummy;
    // Bindings of parts that do not exist repeat the first output, which they never write.
    let out = |i: usize| &outs.get(i).unwrap_or(&outs[0]).buf;
    b.gpu.dispatch(
        kernel,
        &params,
        &[&x.buf, data, dummy, out(0), dummy, out(1), out(2), out(3)],
        groups,
    );
    outs
}

pub(super) fn matmul(b: &GpuBackend, x: &GpuTensor, w: &GpuWeight) -> GpuTensor {
    let (rows, cols) = w.shape();
    assert_eq!(x.cols, cols, "matmul input width");
    let out = b.empty(x.rows, rows);
    matmul_into(b, x, w, &out, 0);
    out
}

/// `x W^T` into columns `first ..` of `out`.
fn matmul_into(b: &GpuBackend, x: &GpuTensor, w: &GpuWeight, out: &GpuTensor, first: usize) {
    let dummy = &b.gpu.dummy;
    let placed = |params: Params| Params {
        out_cols: out.cols as u32,
        out_first: first as u32,
        ..params
    };
    match w {
        GpuWeight::Quantized { .. } => {
            let (params, data) = Params::resident(w).expect("a quantized weight");
            let params = placed(params);
            let (kernel, params, groups) = params.launch(x.rows, b.gpu.tiled, b.gpu.invocations);
            b.gpu.dispatch(
                kernel,
                &params,
                &[&x.buf, data, dummy, &out.buf, dummy],
                groups,
            );
        }
        GpuWeight::Dense { rows, cols, data } => {
            let params = placed(Params {
                rows: *rows as u32,
                cols: *cols as u32,
                ..Default::default()
            });
            let (kernel, params, groups) = params.launch(x.rows, b.gpu.tiled, b.gpu.invocations);
            b.gpu.dispatch(
                kernel,
                &params,
                &[&x.buf, data, dummy, &out.buf, dummy],
                groups,
            );
        }
        GpuWeight::Rows(parts) => {
            for (part_first, part) in parts {
                matmul_into(b, x, part, out, first + part_first);
            }
        }
    }
}

/// Arenas, and (arena, record base in u32 words) per record.
type Places = (Vec<wgpu::Buffer>, Vec<(usize, u32)>);

/// [`place_records`] for records that all come from a pool: the mirror's arenas and each
/// record's (arena, base in u32 words), copying into device arenas the records whose
/// slot's generation changed. `None` when a record has no slot.
pub(super) fn mirror_places(b: &GpuBackend, records: &[ExpertRecord<'_>]) -> Option<Places> {
    let tag = records
        .first()
        .and_then(|r| r.slot)
        .filter(|_| records.iter().all(|r| r.slot.is_some()))?;
    let mut guard = b.mirror.lock().unwrap_or_else(|p| p.into_inner());
    if guard.as_ref().is_none_or(|m| m.pool != tag.pool) {
        if guard.is_some() {
            // The old mirror's buffers may still be in use by recorded work.
            let _ = b.gpu.sync();
        }
        tracing::debug!(slots = tag.slots, "device mirror of the slot pool");
        let old = guard.replace(Mirror::device(
            &b.gpu,
            tag.pool,
            tag.slots,
            tag.stride,
            tag.layer_records,
        ));
        // Cached bind groups would keep the old arenas alive; they go before the old
        // mirror, whose pool may own the host memory its arenas import.
        b.gpu.forget_bind_groups();
        drop(old);
    }
    let m = guard.as_mut()?;
    let mut written = 0;
    let places = records
        .iter()
        .filter_map(|r| r.slot.map(|tag| (r, tag)))
        .map(|(r, tag)| {
            let (arena, at) = (tag.slot / m.slots_per_arena, tag.slot % m.slots_per_arena);
            if m.unified.is_none() && m.generations[tag.slot] != tag.generation {
                let dst = (at * m.stride) as u64;
                if let Some(h) = &m.host {
                    // The GPU copies the slot when it gets to this command. The caller
                    // holds the record until a later wait for the device (the model until
                    // the next layer's read-back or the step's end; prepare_records waits),
                    // so the slot is not rewritten before.
                    let (ha, hat) = (tag.slot / h.slots_per_arena, tag.slot % h.slots_per_arena);
                    let len = (r.bytes.len() as u64).next_multiple_of(4);
                    b.gpu.copy(
                        &h.arenas[ha],
                        (hat * h.stride) as u64,
                        &m.arenas[arena],
                        dst,
                        len,
                    );
                } else {
                    b.gpu.write(&m.arenas[arena], dst, r.bytes);
                    written += r.bytes.len();
                    if written >= MIRROR_WRITE_BATCH {
                        // A failure here shows up at the next read-back.
                        let _ = b.gpu.settle_writes();
                        written = 0;
                    }
                }
                m.generations[tag.slot] = tag.generation;
            }
            (arena, (at * m.stride / 4) as u32)
        })
        .collect();
    // Buffers are reference-counted handles, so cloning them is cheap.
    Some((m.arenas.clone(), places))
}

/// Where each route's record lives on the device: (arena buffer index, record base in
/// u32 words), and whether the arenas are temporary. Pool records are mirrored (copied
/// when their slot's generation changed); others are uploaded into temporary arenas.
fn place_records(
    b: &GpuBackend,
    records: &[ExpertRecord<'_>],
    layout: &RecordLayout,
) -> (Vec<wgpu::Buffer>, Vec<(usize, u32)>, bool) {
    if let Some((arenas, places)) = mirror_places(b, records) {
        return (arenas, places, false);
    }
    // Records without a slot: each distinct record uploaded once, into as many
    // temporary arenas as the binding limit requires.
    let stride = layout.record_bytes.next_multiple_of(16);
    let per_arena = Mirror::slots_per_arena(&b.gpu, stride, 0);
    let mut distinct: Vec<*const u8> = Vec::new();
    let mut index_of = Vec::with_capacity(records.len());
    for r in records {
        let key = r.bytes.as_ptr();
        let i = distinct.iter().position(|&p| p == key).unwrap_or_else(|| {
            distinct.push(key);
            distinct.len() - 1
        });
        index_of.push(i);
    }
    let mut arenas = Vec::new();
    for chunk in (0..distinct.len()).collect::<Vec<_>>().chunks(per_arena) {
        let mut bytes = vec![0u8; stride * chunk.len()];
        for (slot, &d) in chunk.iter().enumerate() {
            let r = records[index_of.iter().position(|&i| i == d).unwrap_or(0)].bytes;
            bytes[slot * stride..slot * stride + r.len()].copy_from_slice(r);
        }
        arenas.push(b.gpu.buffer_with(&bytes));
    }
    let places = index_of
        .iter()
        .map(|&d| (d / per_arena, ((d % per_arena) * stride / 4) as u32))
        .collect();
    (arenas, places, true)
}

pub(super) fn moe_experts(
    b: &GpuBackend,
    x: &GpuTensor,
    routing: &Routing,
    records: &[ExpertRecord<'_>],
    layout: &RecordLayout,
    shared: Option<SharedExpert<'_, GpuTensor>>,
) -> GpuTensor {
    let routes = routing.ids.len();
    let (arenas, places, temporary) = place_records(b, records, layout);
    // Temporary arenas are bound without caching their bind groups, which would keep
    // them alive.
    let arena = |a: usize| {
        if temporary {
            Bind::Once(&arenas[a])
        } else {
            Bind::Buffer(&arenas[a])
        }
    };
    let (d, inter) = (layout.hidden, layout.intermediate);
    let weights = Bind::Data(bytemuck::cast_slice(&routing.weights));
    let gate_up = Params::routed_gate_up(layout, routes);
    if b.gpu.tiled && routing.tokens() >= TILED_MIN_TOKENS && gate_up.tileable() {
        let mut records = places.clone();
        records.sort_unstable();
        records.dedup();
        let tile = route_tile(b, routes, records.len());
        let lists = tile_lists(&places, arenas.len(), tile);
        let ranges: Vec<TiledRange<'_>> = lists
            .iter()
            .map(|(a, list)| TiledRange {
                arena: arena(*a),
                list: Bind::Data(bytemuck::cast_slice(&list.words)),
                entries: list.tiles,
                first: 0,
                tiles: list.tiles,
            })
            .collect();
        let y = tiled_experts(b, x, routing.top_k, layout, (routes, tile), &ranges);
        return combine(b, &y, (weights, 0, routing.top_k), shared);
    }
    // Route tables from the host: every route of an arena's table computed.
    let which = |arena| Routes {
        arena,
        routed: 1,
        k: routing.top_k,
        experts: 0,
    };
    // Route tables per arena: (record base, input row), and where each route's output goes.
    let mut per_arena: Vec<(Vec<u32>, Vec<usize>)> = vec![(Vec::new(), Vec::new()); arenas.len()];
    for (r, &(arena, base)) in places.iter().enumerate() {
        per_arena[arena]
            .0
            .extend([base, (r / routing.top_k) as u32]);
        per_arena[arena].1.push(r);
    }
    let y = b.empty(routes, d);
    let arena_runs: Vec<(usize, Vec<u32>, Vec<usize>)> = per_arena
        .into_iter()
        .enumerate()
        .filter(|(_, (t, _))| !t.is_empty())
        .map(|(a, (table, order))| (a, table, order))
        .collect();
    // Route r of an arena writes row `order[r]`: the kernel writes row z, so each arena
    // computes into a compact buffer that is then copied to its routes' rows.
    let scatter = |compact: &GpuTensor, full: &GpuTensor, order: &[usize]| {
        let width = (full.cols * 4) as u64;
        for (i, &r) in order.iter().enumerate() {
            b.gpu.copy(
                &compact.buf,
                i as u64 * width,
                &full.buf,
                r as u64 * width,
                width,
            );
        }
    };
    let single = arena_runs.len() == 1 && arena_runs[0].2.iter().enumerate().all(|(i, &r)| i == r);
    let h = b.empty(routes, inter);
    for (a, table, order) in &arena_runs {
        let binds = [
            Bind::Buffer(&x.buf),
            arena(*a),
            Bind::Data(bytemuck::cast_slice(table)),
            Bind::Buffer(&b.gpu.dummy),
        ];
        let target = if single {
            h.clone()
        } else {
            b.empty(order.len(), inter)
        };
        routed_swiglu(b, layout, binds, which(*a), &target);
        if !single {
            scatter(&target, &h, order);
        }
    }
    for (a, _, order) in &arena_runs {
        let n = order.len();
        // The down projection's input row is the route itself, not the token.
        let down_table: Vec<u32> = order
            .iter()
            .flat_map(|&r| [places[r].1, r as u32])
            .collect();
        let params = which(*a).apply(Params::routed(layout, Projection::Down, n));
        let target = if single { y.clone() } else { b.empty(n, d) };
        let binds = [
            Bind::Buffer(&h.buf),
            arena(*a),
            Bind::Data(bytemuck::cast_slice(&down_table)),
            Bind::Buffer(&target.buf),
            Bind::Buffer(&b.gpu.dummy),
        ];
        let (kernel, params, groups) = params.launch(n, false, b.gpu.invocations);
        b.gpu.dispatch_with(kernel, &params, &binds, groups);
        if !single {
            scatter(&target, &y, order);
        }
    }
    combine(b, &y, (weights, 0, routing.top_k), shared)
}

/// Routes per tile for a layer's routed tiled products, `routes` routes over `records`
/// records: [`NARROW_TILE_ROUTES`] when a record gets [`NARROW_MAX_MEAN_ROUTES`] or
/// fewer on average, else [`TILE_TOKENS`]; or what the device's options force.
fn route_tile(b: &GpuBackend, routes: usize, records: usize) -> usize {
    b.gpu
        .route_tile
        .unwrap_or(if routes <= records.max(1) * NARROW_MAX_MEAN_ROUTES {
            NARROW_TILE_ROUTES
        } else {
            TILE_TOKENS
        })
}

/// Routes of one arena grouped by record for the tiled entries (routed = 4 in
/// `wgsl/quant.wgsl`): `tiles` tiles of (record base, first, count, 0), at most
/// the list's tile size in routes each, then the route list they index.
struct TileList {
    tiles: usize,
    words: Vec<u32>,
}

/// A [`TileList`] for each arena that holds routed records, from each route's (arena,
/// record base): every route of a record in its record's tiles of at most `tile` routes,
/// so the record is read once per tile of its routes rather than once per route.
fn tile_lists(places: &[(usize, u32)], arenas: usize, tile: usize) -> Vec<(usize, TileList)> {
    let mut by_record = vec![std::collections::BTreeMap::<u32, Vec<u32>>::new(); arenas];
    for (r, &(a, base)) in places.iter().enumerate() {
        by_record[a].entry(base).or_default().push(r as u32);
    }
    by_record
        .into_iter()
        .enumerate()
        .filter(|(_, records)| !records.is_empty())
        .map(|(a, records)| {
            let mut words = Vec::new();
            let mut list = Vec::new();
            for (base, routes) in records {
                for chunk in routes.chunks(tile) {
                    words.extend([base, list.len() as u32, chunk.len() as u32, 0]);
                    list.extend_from_slice(chunk);
                }
            }
            let tiles = words.len() / 4;
            words.extend(list);
            (a, TileList { tiles, words })
        })
        .collect()
}

/// One arena's tiles for [`tiled_experts`]: the arena, the tile list (`entries` tile
/// entries, then the route list) and the `tiles` entries from `first` on that hold its
/// records' routes.
struct TiledRange<'a> {
    arena: Bind<'a>,
    list: Bind<'a>,
    entries: usize,
    first: usize,
    tiles: usize,
}

/// The routed experts' outputs `[routes, hidden]` in tiles of each record's routes, at
/// most `tile` each (routed = 4 in `wgsl/quant.wgsl`): per arena, gate and up with
/// SwiGLU into `h` `[routes, intermediate]` (route r reads token r / k of `x`), then down
/// from h's rows.
fn tiled_experts(
    b: &GpuBackend,
    x: &GpuTensor,
    k: usize,
    layout: &RecordLayout,
    (routes, tile): (usize, usize),
    ranges: &[TiledRange<'_>],
) -> GpuTensor {
    let h = b.empty(routes, layout.intermediate);
    let y = b.empty(routes, layout.hidden);
    let dummy = Bind::Buffer(&b.gpu.dummy);
    for r in ranges {
        let routed = |params: Params, k: usize| Params {
            routed: 4,
            k: k as u32,
            tiles: r.entries as u32,
            first_tile: r.first as u32,
            ..params
        };
        let gate_up = Params::routed_gate_up(layout, routes);
        let (kernel, params, groups) = routed(gate_up, k).launch_tiled(r.tiles, tile);
        let binds = [
            Bind::Buffer(&x.buf),
            r.arena,
            r.list,
            Bind::Buffer(&h.buf),
            dummy,
        ];
        b.gpu.dispatch_with(kernel, &params, &binds, groups);
        let down = Params::routed(layout, Projection::Down, routes);
        let (kernel, params, groups) = routed(down, 1).launch_tiled(r.tiles, tile);
        let binds = [
            Bind::Buffer(&h.buf),
            r.arena,
            r.list,
            Bind::Buffer(&y.buf),
            dummy,
        ];
        b.gpu.dispatch_with(kernel, &params, &binds, groups);
    }
    y
}

/// `out[t] = sum_j w[t, j] * y[t k + j]` over the `k` routes of each token, the weights
/// (f32 bits) from word `w_off` of `weights`, plus the shared expert when given; `y` is
/// `[T k, hidden]`.
fn combine(
    b: &GpuBackend,
    y: &GpuTensor,
    (weights, w_off, k): (Bind<'_>, usize, usize),
    shared: Option<SharedExpert<'_, GpuTensor>>,
) -> GpuTensor {
    assert!(
        k > 0 && y.rows.is_multiple_of(k),
        "combine: {} routes of top-{k}",
        y.rows
    );
    let (tokens, d) = (y.rows / k, y.cols);
    let out = b.empty(tokens, d);
    let params = Params {
        rows: d as u32,
        k: k as u32,
        tokens: tokens as u32,
        w_off: w_off as u32,
        add_shared: u32::from(shared.is_some()),
        ..Default::default()
    };
    let dummy = Bind::Buffer(&b.gpu.dummy);
    let (shared_y, gate) = match shared {
        Some(s) => {
            s.check_shapes(b, tokens, d);
            (Bind::Buffer(&s.y.buf), Bind::Buffer(&s.gate.buf))
        }
        None => (dummy, dummy),
    };
    let binds = [
        Bind::Buffer(&y.buf),
        shared_y,
        weights,
        Bind::Buffer(&out.buf),
        gate,
    ];
    let [gx, gy] = grid((tokens * d).div_ceil(256) as u32);
    b.gpu.dispatch_with(&COMBINE, &params, &binds, [gx, gy, 1]);
    out
}

/// Routed experts with every record of the layer at hand (`layer[e]` is expert `e`'s) and
/// the routing on the device (see [`crate::backend::Backend::moe_experts_resident`]):
/// nothing is read back. The matmuls read each route's expert id from the routing (or
/// the ids given) and its record's arena and base from the layer's table, uploaded with
/// the dispatch; each projection runs once per arena that holds records of the layer,
/// computing only the routes whose records lie in it, so every output row is written by
/// exactly one dispatch. A chunk of [`TILED_MIN_TOKENS`] or more on a device with tiles
/// has its routes grouped by record on the device instead (`route_tiles`) and runs the
/// tiled entries. `None` when the records do not all come from a pool (no mirror to read
/// them from), or when such a chunk's layer has more experts than the device groups.
pub(super) fn moe_experts_resident(
    b: &GpuBackend,
    x: &GpuTensor,
    (routing, k, ids): (&GpuTensor, usize, Option<&[u32]>),
    layer: &[ExpertRecord<'_>],
    layout: &RecordLayout,
    shared: Option<SharedExpert<'_, GpuTensor>>,
) -> Option<GpuTensor> {
    let routes = routing.cols / 2;
    assert_eq!(routes, x.rows * k, "moe_experts_resident: routes");
    let (arenas, places) = mirror_places(b, layer)?;
    let mut used: Vec<usize> = places.iter().map(|p| p.0).collect();
    used.sort_unstable();
    used.dedup();
    let ids = match ids {
        Some(ids) => Bind::Data(bytemuck::cast_slice(ids)),
        // The ids lead the routing tensor.
        None => Bind::Buffer(&routing.buf),
    };
    // Many tokens: the routes grouped by record on the device, in tiles.
    if b.gpu.tiled
        && x.rows >= TILED_MIN_TOKENS
        && Params::routed_gate_up(layout, routes).tileable()
    {
        let tile = route_tile(b, routes, layer.len());
        let Some(tiles) = route_tiles::route_tiles(b, ids, routes, &places, &used, tile) else {
            // More experts than the shader groups: the routing read back and grouped on
            // the host keeps the tiles (one wait), where routes one by one would read
            // each record once per route.
            return None;
        };
        let ranges: Vec<TiledRange<'_>> = tiles
            .ranges
            .iter()
            .map(|r| TiledRange {
                arena: Bind::Buffer(&arenas[r.arena]),
                list: Bind::Buffer(&tiles.list.buf),
                entries: tiles.capacity,
                first: r.first,
                tiles: r.capacity,
            })
            .collect();
        let y = tiled_experts(b, x, k, layout, (routes, tile), &ranges);
        return Some(combine(
            b,
            &y,
            (Bind::Buffer(&routing.buf), routes, k),
            shared,
        ));
    }
    let table: Vec<u32> = places
        .iter()
        .flat_map(|&(arena, base)| [arena as u32, base])
        .collect();
    let table = Bind::Data(bytemuck::cast_slice(&table));
    let d = layout.hidden;
    let which = |arena, routed| Routes {
        arena,
        routed,
        k,
        experts: layer.len(),
    };
    // Each arena's dispatch writes only the rows of the routes whose records it holds.
    let h = b.empty(routes, layout.intermediate);
    for &a in &used {
        let binds = [Bind::Buffer(&x.buf), Bind::Buffer(&arenas[a]), ids, table];
        routed_swiglu(b, layout, binds, which(a, 2), &h);
    }
    let y = b.empty(routes, d);
    for &a in &used {
        let params = which(a, 3).apply(Params::routed(layout, Projection::Down, routes));
        let binds = [
            Bind::Buffer(&h.buf),
            Bind::Buffer(&arenas[a]),
            ids,
            Bind::Buffer(&y.buf),
            table,
        ];
        let (kernel, params, groups) = params.launch(routes, false, b.gpu.invocations);
        b.gpu.dispatch_with(kernel, &params, &binds, groups);
    }
    // The weights follow the ids in the routing tensor.
    let weights = (Bind::Buffer(&routing.buf), routes, k);
    Some(combine(b, &y, weights, shared))
}

#[cfg(test)]
mod tests {
    use super::super::device::INVOCATIONS;
    use super::*;

    /// The shader's `ROWS` is the host's [`QMATMUL_ROWS`]: the grid counts rows per lane
    /// group as the kernel computes them.
    #[test]
    fn the_shader_computes_as_many_rows_per_lane_group_as_the_host_counts() {
        let source = include_str!("../../../../wgsl/quant.wgsl");
        assert!(source.contains(&format!("const ROWS: u32 = {QMATMUL_ROWS}u;")));
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
