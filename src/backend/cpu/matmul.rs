//! `x W^T` for quantized and dense weights in SIMD: the CPU backend's hot path, for the
//! resident projections, the head and the routed experts alike.
//!
//! MLX affine quantization stores `W[r, c] = s q[r, c] + b` with one scale `s` and bias
//! `b` per group of columns (quant.rs), so a row's dot product with `x` is
//! `sum_g (s_g sum_{c in g} q[r, c] x[c] + b_g sum_{c in g} x[c])`: the kernel multiplies
//! the unpacked integers `q` into `x` (f32 FMA), scales each group's partial sums once, and
//! adds `b . sum_g(x)` from group sums of `x` computed once per call ([`Prepared`]). No
//! weight is dequantized; this is how llama.cpp's and MLX's CPU kernels avoid it too.
//!
//! A row is read in chunks of `PARTS L` columns (`L` f32 lanes: 16 on AVX-512, 8 on AVX2
//! and the portable path), each unpacked into `PARTS` vectors ([`Format`]):
//! - 4-bit where a group holds whole chunks of `8 L` columns (group 64 on AVX2):
//!   `L` u32 words of eight nibbles, each nibble masked in place and converted
//!   ([`Q4Words`]). Per sixteen weights that is two masks, two conversions and two FMAs,
//!   where the byte layout below takes a widening, a mask, a shift, two conversions and
//!   two FMAs: 12% faster at one token on the 2-core Zen 3 machine, whose 4-bit kernel
//!   is bound by its instructions, not by memory (BENCHMARKS.md, issue 19).
//! - other 4-bit: `L` bytes split into low and high nibbles ([`Q4`]);
//! - 8-bit, `2 L` bytes widened; dense, `2 L` floats.
//!
//! MLX packs 4-bit LSB first (byte `i` holds columns `2i` and `2i + 1`), so the 4-bit
//! kernels' activations are put in the order they unpack, once per call ([`lane_order`]).
//!
//! A tile of `R` rows by `T` tokens keeps `R T` accumulators in registers: one token
//! (decode) takes four rows, so four independent FMA chains hide the FMA latency and each
//! chunk of `x` is loaded once for four rows; more tokens (prefill) take fewer rows, and
//! each weight is unpacked once per tile of up to [`TILE`] tokens. Output rows are split
//! into blocks computed in parallel on rayon's pool, whose threads stay alive between
//! calls.
//!
//! The vector operations come from [`Simd`] (simd.rs): `std::arch` intrinsics for AVX-512
//! and AVX2 on x86-64, picked at run time, else plain Rust that LLVM vectorizes (NEON on
//! aarch64). Each instruction set gets the same kernel, instantiated inside a function
//! compiled for it (`#[target_feature]`).

use std::cell::RefCell;
use std::ops::Range;

use rayon::prelude::*;

use super::int8::{self, Digits, DIGITS};
#[cfg(target_arch = "x86_64")]
use super::simd::{Avx2, Avx512};
use super::simd::{Isa, Portable, Simd};
use super::{dot, Rows};
use crate::checkpoint::{Floats, QuantView};

/// Tokens whose dot products share one unpacking of a weight chunk (prefill). Four keep
/// the accumulators and the unpacked chunk in AVX2's sixteen registers.
pub const TILE: usize = 4;
// `tiles` has an arm per tile width up to 4: a wider TILE would leave tokens uncomputed.
const _: () = assert!(TILE == 4);

/// Weights and scale/bias bytes a parallel task aims at: its rows stay in L2 while every
/// token tile passes over them.
const TASK_BYTES: usize = 128 << 10;

/// The row format a weight's kernel is instantiated for, which also fixes the order its
/// activations are prepared in ([`Kind::lane_order`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// 4-bit in chunks of `2 L` columns ([`Q4`]).
    Q4,
    /// 4-bit in chunks of `8 L` columns ([`Q4Words`]), where a group holds whole chunks.
    Q4Words,
    /// 8-bit, in column order.
    Q8,
    /// Dense f32, in column order.
    F32,
}

impl Kind {
    /// `w`'s kind on `isa`. Panics unless [`supports`]`(w)`.
    fn of(isa: Isa, w: &Rows<'_>) -> Kind {
        match w {
            Rows::Dense { .. } => Kind::F32,
            Rows::Quant(q) => match q.spec.bits {
                4 if q.spec.group_size.is_multiple_of(8 * isa.lanes()) => Kind::Q4Words,
                4 => Kind::Q4,
                8 => Kind::Q8,
                bits => panic!("no SIMD kernel for {bits}-bit weights"),
            },
        }
    }

    /// `x` (rows of whole chunks) in the order this kind's kernel on `lanes` lanes reads
    /// it (a copy for 8-bit and dense weights).
    fn lane_order(self, x: &[f32], lanes: usize) -> Vec<f32> {
        match self {
            Kind::Q4 => lane_order(x, lanes, &[1.0; 2]),
            Kind::Q4Words => lane_order(x, lanes, &WORD_FACTORS),
            Kind::Q8 | Kind::F32 => x.to_vec(),
        }
    }
}

/// What [`Q4Words`]' activations are multiplied by, per nibble `k`: the inverse of the
/// factor its nibble comes with ([`Simd::nibble`]), `16^-k`, but for the last, which
/// comes unscaled.
const WORD_FACTORS: [f32; 8] = [
    1.0,
    1.0 / 16.0,
    1.0 / 256.0,
    1.0 / 4096.0,
    1.0 / 65536.0,
    1.0 / 1048576.0,
    1.0 / 16777216.0,
    1.0,
];

/// `x` (rows of a multiple of `parts lanes` columns, `parts = factors.len()`) with every
/// `parts lanes` consecutive values `c` reordered as a 4-bit kernel unpacks them into
/// `parts` vectors of `lanes`: vector `k` holds `factors[k] c[parts j + k]` for
/// `j < lanes`. The factors are powers of two, so each product with a nibble scaled by
/// their inverse is the one the plain kernel forms, unless `|x|` is so small (below
/// `2^-102` for `16^-6`) that the scaled value is subnormal.
fn lane_order(x: &[f32], lanes: usize, factors: &[f32]) -> Vec<f32> {
    let parts = factors.len();
    let chunk = parts * lanes;
    assert_eq!(x.len() % chunk, 0, "lane order of a partial chunk");
    let mut out = vec![0.0; x.len()];
    for (o, c) in out.chunks_exact_mut(chunk).zip(x.chunks_exact(chunk)) {
        for (k, factor) in factors.iter().enumerate() {
            for j in 0..lanes {
                o[k * lanes + j] = c[parts * j + k] * factor;
            }
        }
    }
    out
}

/// Whether the SIMD kernel takes `w`: quantized weights always (their columns come in
/// groups of at least 32), dense ones whose rows are whole 32-column chunks.
pub fn supports(w: &Rows<'_>) -> bool {
    match w {
        Rows::Quant(q) => q.spec.group_size % 32 == 0 && matches!(q.spec.bits, 4 | 8),
        Rows::Dense { cols, .. } => cols % 32 == 0,
    }
}

/// Rows per parallel task for `matrices` weights of `rows` rows of `row_bytes` bytes
/// computed in one parallel pass: about [`TASK_BYTES`] each, and at least eight tasks per
/// thread in all where the rows allow, so a thread slowed by other work on the machine
/// leaves its share to the others.
pub fn rows_per_task(rows: usize, row_bytes: usize, matrices: usize) -> usize {
    let by_bytes = (TASK_BYTES / row_bytes.max(1)).max(1);
    let by_threads = (rows * matrices).div_ceil(8 * rayon::current_num_threads());
    by_bytes.min(by_threads).clamp(1, rows.max(1))
}

/// Bytes of one row of `w` (weights, scales and biases).
pub fn row_bytes(w: &Rows<'_>) -> usize {
    match w {
        Rows::Quant(q) => {
            let groups = q.cols / q.spec.group_size;
            q.cols * q.spec.bits as usize / 8 + 2 * groups * scale_width(q)
        }
        Rows::Dense { cols, .. } => 4 * cols,
    }
}

/// Bytes of one of `q`'s scales (and biases).
fn scale_width(q: &QuantView<'_>) -> usize {
    q.scales.bytes.len() / (q.rows * (q.cols / q.spec.group_size)).max(1)
}

/// Activations prepared for one weight's kernel: `t` tokens of `cols` values in its lane
/// order, and for a quantized weight each token's sums over its quantization groups,
/// `[t, groups]` (for the `b sum(x)` terms; empty for a dense weight); for a weight the
/// integer kernel takes on `isa` ([`Isa::Avx512Vnni`], int8.rs), also their digits.
#[derive(Clone, Debug, Default)]
pub struct Prepared {
    pub x: Vec<f32>,
    pub sums: Vec<f32>,
    pub t: usize,
    digits: Option<Digits>,
    cols: usize,
    groups: usize,
}

impl Prepared {
    /// `x` `[t, cols]` in natural column order prepared for `w` on `isa`'s kernel. Panics
    /// unless `x` has `t` rows of `w`'s columns.
    pub fn new(isa: Isa, w: &Rows<'_>, x: &[f32], t: usize) -> Prepared {
        let cols = w.shape().1;
        assert_eq!(x.len(), t * cols, "matmul input width");
        let group = match w {
            Rows::Quant(q) => q.spec.group_size,
            Rows::Dense { .. } => 0,
        };
        let sums = match group {
            0 => Vec::new(),
            g => x.chunks_exact(g).map(sum).collect(),
        };
        let digits = match w {
            Rows::Quant(q) if takes_integers(isa, q) => Some(Digits::new(x, q.spec.group_size)),
            _ => None,
        };
        let x = Kind::of(isa, w).lane_order(x, isa.lanes());
        Prepared {
            x,
            sums,
            t,
            digits,
            cols,
            groups: cols.checked_div(group).unwrap_or(0),
        }
    }

    /// The prepared rows of `tokens`, in that order.
    pub fn gather(&self, tokens: impl Iterator<Item = usize> + Clone) -> Prepared {
        fn rows_of<T: Copy>(v: &[T], width: usize, tokens: impl Iterator<Item = usize>) -> Vec<T> {
            tokens
                .flat_map(|i| &v[i * width..(i + 1) * width])
                .copied()
                .collect()
        }
        let pick = |v: &[f32], width: usize| rows_of(v, width, tokens.clone());
        let pick_of = |v: &[i8], width: usize| rows_of(v, width, tokens.clone());
        Prepared {
            x: pick(&self.x, self.cols),
            sums: pick(&self.sums, self.groups),
            t: tokens.clone().count(),
            digits: self.digits.as_ref().map(|d| Digits {
                q: pick_of(&d.q, DIGITS * self.cols),
                unit: pick(&d.unit, self.groups),
            }),
            cols: self.cols,
            groups: self.groups,
        }
    }
}

/// Whether `isa` computes one token's products with `q` in integers (int8.rs).
fn takes_integers(isa: Isa, q: &QuantView<'_>) -> bool {
    isa == Isa::Avx512Vnni && int8::supports(q.spec.bits, q.spec.group_size)
}

/// `sum(x)` in eight lanes (vectorizes; the order differs from a sequential sum's by
/// rounding only).
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// `x W^T` for `x` `[t, in]` in natural column order: `[t, out]`, row-major. Panics unless
/// [`supports`]`(w)`, `x` has `t * in` values and `isa` is supported.
pub fn matmul(isa: Isa, x: &[f32], t: usize, w: &Rows<'_>) -> Vec<f32> {
    let input = Prepared::new(isa, w, x, t);
    let out = rows_parallel(isa, w, &input);
    transpose(out, w.shape().0, t)
}

/// `[rows, t]` outputs of `x W^T` for `x` prepared for `w`, rows in parallel.
pub fn rows_parallel(isa: Isa, w: &Rows<'_>, x: &Prepared) -> Vec<f32> {
    let (rows, t) = (w.shape().0, x.t);
    let per_task = rows_per_task(rows, row_bytes(w), 1);
    let mut out = vec![0.0f32; rows * t];
    if t == 0 {
        return out;
    }
    out.par_chunks_mut(per_task * t)
        .enumerate()
        .for_each(|(i, o)| {
            let r0 = i * per_task;
            rows_into(isa, w, r0..r0 + o.len() / t, x, o)
        });
    out
}

/// `[rows, t]` to `[t, rows]` (nothing to move for one token).
pub fn transpose(m: Vec<f32>, rows: usize, t: usize) -> Vec<f32> {
    if t <= 1 {
        return m;
    }
    let mut out = vec![0.0f32; m.len()];
    for (r, row) in m.chunks_exact(t).enumerate() {
        for (i, &v) in row.iter().enumerate() {
            out[i * rows + r] = v;
        }
    }
    out
}

/// A worker thread's buffers for a block's scales and biases widened to f32, kept between
/// calls (no allocation per task once they have grown).
#[derive(Default)]
struct Scratch {
    scales: Vec<f32>,
    biases: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// One block of rows of a weight as the kernel reads it.
struct Block<'a> {
    /// The block's rows, `row_bytes` each: packed integers or f32 bytes.
    data: &'a [u8],
    row_bytes: usize,
    rows: usize,
    cols: usize,
    /// Columns per scale and bias (the row, for dense weights).
    group: usize,
    /// `[rows, cols / group]` scales and biases (empty for dense weights).
    scales: &'a [f32],
    biases: &'a [f32],
    /// Where the next block's raw scales and biases would start (at row `rows.end`, as the
    /// next task of a pass usually does), and their bytes per row: a one-token kernel
    /// asks for them while it computes this block, so that widening them for the next
    /// block does not wait on memory. Hints only: they may point past the weight's end.
    next_scales: [*const u8; 2],
    scale_row_bytes: usize,
}

/// Output rows `rows` of `x W^T` for `x` prepared for `w` on `isa`, into `out`
/// `[rows.len(), x.t]`: token tiles outermost, so a block's weights come from memory once
/// and from cache for the other tiles. Panics unless [`supports`]`(w)`, the shapes agree
/// and `isa` runs on this CPU.
pub fn rows_into(isa: Isa, w: &Rows<'_>, rows: Range<usize>, x: &Prepared, out: &mut [f32]) {
    let (all_rows, cols) = w.shape();
    assert!(supports(w), "the SIMD kernel cannot take this weight");
    assert!(isa.is_supported(), "{isa} kernels on a CPU without {isa}");
    assert!(rows.end <= all_rows && x.cols == cols, "matmul shapes");
    assert_eq!(x.x.len(), x.t * cols, "matmul input");
    assert_eq!(out.len(), rows.len() * x.t, "matmul output");
    SCRATCH.with_borrow_mut(|scratch| {
        let block = match w {
            Rows::Quant(q) => {
                let row_bytes = cols * q.spec.bits as usize / 8;
                let groups = cols / q.spec.group_size;
                assert_eq!(x.sums.len(), x.t * groups, "matmul input sums");
                let n = rows.len() * groups;
                scratch.scales.resize(n, 0.0);
                scratch.biases.resize(n, 0.0);
                q.scales.read_into(rows.start * groups, &mut scratch.scales);
                q.biases.read_into(rows.start * groups, &mut scratch.biases);
                let width = scale_width(q);
                let next =
                    |f: &Floats<'_>| f.bytes.as_ptr().wrapping_add(rows.end * groups * width);
                Block {
                    data: &q.packed[rows.start * row_bytes..rows.end * row_bytes],
                    row_bytes,
                    rows: rows.len(),
                    cols,
                    group: q.spec.group_size,
                    scales: &scratch.scales,
                    biases: &scratch.biases,
                    next_scales: [next(&q.scales), next(&q.biases)],
                    scale_row_bytes: groups * width,
                }
            }
            Rows::Dense { data, .. } => Block {
                data: bytemuck::cast_slice(&data[rows.start * cols..rows.end * cols]),
                row_bytes: 4 * cols,
                rows: rows.len(),
                cols,
                group: cols,
                scales: &[],
                biases: &[],
                next_scales: [std::ptr::null(); 2],
                scale_row_bytes: 0,
            },
        };
        let kind = Kind::of(isa, w);
        match isa {
            // SAFETY (each arm): `isa` runs on this CPU (asserted above).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => match &x.digits {
                Some(digits) => {
                    let rows = int8::Rows {
                        data: block.data,
                        rows: block.rows,
                        cols,
                        group: block.group,
                        scales: block.scales,
                        biases: block.biases,
                        next_scales: block.next_scales,
                        scale_row_bytes: block.scale_row_bytes,
                    };
                    unsafe { int8::rows_vnni(&rows, digits, x.t, &x.sums, out) }
                }
                None => unsafe { block_avx512(&block, kind, x, out) },
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { block_avx512(&block, kind, x, out) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { block_avx2(&block, kind, x, out) },
            _ => block_for(Portable, &block, kind, x, out),
        }
    })
}

/// [`block_for`] compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn block_avx512(b: &Block<'_>, kind: Kind, x: &Prepared, out: &mut [f32]) {
    // SAFETY: the caller's contract.
    block_for(unsafe { Avx512::new() }, b, kind, x, out)
}

/// [`block_for`] compiled for AVX2 with FMA.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2(b: &Block<'_>, kind: Kind, x: &Prepared, out: &mut [f32]) {
    // SAFETY: the caller's contract.
    block_for(unsafe { Avx2::new() }, b, kind, x, out)
}

/// How a row stores a chunk of `PARTS L` columns.
trait Format {
    /// Bits a weight takes.
    const BITS: usize;
    /// Quantized (groups with a scale and a bias) rather than f32.
    const QUANT: bool;
    /// Vectors of `L` columns a chunk unpacks into.
    const PARTS: usize;
    /// A chunk as loaded, before it is unpacked.
    type Raw<S: Simd>: Copy;
    /// Loads the chunk at `p`.
    ///
    /// # Safety
    /// `p` is valid for `PARTS L BITS / 8` bytes.
    unsafe fn load<S: Simd>(s: S, p: *const u8) -> Self::Raw<S>;
    /// Part `k < PARTS` of the chunk: the vector that the activations' lane order pairs
    /// with `x[k L .. (k + 1) L]` of the chunk.
    fn part<S: Simd>(s: S, raw: Self::Raw<S>, k: usize) -> S::F;
}

/// 4-bit in chunks of `L` bytes: low nibbles, then high nibbles.
struct Q4;
/// 4-bit in chunks of `L` words of eight nibbles: one load, then a mask and a conversion
/// per vector of `L` columns (one fewer instruction per two vectors than [`Q4`]'s widen,
/// mask, shift and two conversions).
struct Q4Words;
/// 8-bit: `2 L` bytes in column order.
struct Q8;
/// f32: `2 L` floats.
struct F32;

/// Part `k` of a pair.
#[inline(always)]
fn of_pair<F: Copy>((a, b): (F, F), k: usize) -> F {
    if k == 0 {
        a
    } else {
        b
    }
}

impl Format for Q4 {
    const BITS: usize = 4;
    const QUANT: bool = true;
    const PARTS: usize = 2;
    type Raw<S: Simd> = (S::F, S::F);
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const u8) -> (S::F, S::F) {
        unsafe { s.nibbles(p) }
    }
    #[inline(always)]
    fn part<S: Simd>(_: S, raw: (S::F, S::F), k: usize) -> S::F {
        of_pair(raw, k)
    }
}

impl Format for Q4Words {
    const BITS: usize = 4;
    const QUANT: bool = true;
    const PARTS: usize = 8;
    type Raw<S: Simd> = S::I;
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const u8) -> S::I {
        unsafe { s.words(p) }
    }
    #[inline(always)]
    fn part<S: Simd>(s: S, raw: S::I, k: usize) -> S::F {
        s.nibble(raw, k)
    }
}

impl Format for Q8 {
    const BITS: usize = 8;
    const QUANT: bool = true;
    const PARTS: usize = 2;
    type Raw<S: Simd> = (S::F, S::F);
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const u8) -> (S::F, S::F) {
        unsafe { (s.bytes(p), s.bytes(p.add(S::LANES))) }
    }
    #[inline(always)]
    fn part<S: Simd>(_: S, raw: (S::F, S::F), k: usize) -> S::F {
        of_pair(raw, k)
    }
}

impl Format for F32 {
    const BITS: usize = 32;
    const QUANT: bool = false;
    const PARTS: usize = 2;
    type Raw<S: Simd> = (S::F, S::F);
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const u8) -> (S::F, S::F) {
        let p = p.cast::<f32>();
        unsafe { (s.load(p), s.load(p.add(S::LANES))) }
    }
    #[inline(always)]
    fn part<S: Simd>(_: S, raw: (S::F, S::F), k: usize) -> S::F {
        of_pair(raw, k)
    }
}

/// Every token tile of `b`'s rows, for weights of `kind`.
#[inline(always)]
fn block_for<S: Simd>(s: S, b: &Block<'_>, kind: Kind, x: &Prepared, out: &mut [f32]) {
    match kind {
        Kind::Q4 => tiles::<S, Q4>(s, b, x, out),
        Kind::Q4Words => tiles::<S, Q4Words>(s, b, x, out),
        Kind::Q8 => tiles::<S, Q8>(s, b, x, out),
        Kind::F32 => tiles::<S, F32>(s, b, x, out),
    }
}

#[inline(always)]
fn tiles<S: Simd, F: Format>(s: S, b: &Block<'_>, x: &Prepared, out: &mut [f32]) {
    for t0 in (0..x.t).step_by(TILE) {
        // Rows by tokens: four independent accumulator chains per tile at least where the
        // tokens allow, within AVX2's sixteen registers.
        match TILE.min(x.t - t0) {
            1 => row_tiles::<S, F, 4, 1>(s, b, x, t0, out),
            2 => row_tiles::<S, F, 2, 2>(s, b, x, t0, out),
            3 => row_tiles::<S, F, 1, 3>(s, b, x, t0, out),
            _ => row_tiles::<S, F, 1, 4>(s, b, x, t0, out),
        }
    }
}

/// Tokens `t0 .. t0 + T` for every row of `b`, `R` rows at a time, then the rows left.
#[inline(always)]
fn row_tiles<S: Simd, F: Format, const R: usize, const T: usize>(
    s: S,
    b: &Block<'_>,
    x: &Prepared,
    t0: usize,
    out: &mut [f32],
) {
    let mut r = 0;
    while r + R <= b.rows {
        tile::<S, F, R, T>(s, b, r, x, t0, out);
        r += R;
    }
    while r < b.rows {
        tile::<S, F, 1, T>(s, b, r, x, t0, out);
        r += 1;
    }
}

/// Rows `r0 .. r0 + R` of `b` against tokens `t0 .. t0 + T` of `x`, into `out`.
#[inline(always)]
fn tile<S: Simd, F: Format, const R: usize, const T: usize>(
    s: S,
    b: &Block<'_>,
    r0: usize,
    x: &Prepared,
    t0: usize,
    out: &mut [f32],
) {
    let (cols, lanes) = (b.cols, S::LANES);
    let chunk_cols = F::PARTS * lanes;
    let chunk_bytes = chunk_cols * F::BITS / 8;
    let groups = cols / b.group;
    let per_group = b.group / chunk_cols;
    // Bounds are checked here, once; the loop's pointer reads stay within these slices.
    let rows: [&[u8]; R] = std::array::from_fn(|i| {
        let at = (r0 + i) * b.row_bytes;
        &b.data[at..at + b.row_bytes]
    });
    let xs: [&[f32]; T] = std::array::from_fn(|j| &x.x[(t0 + j) * cols..(t0 + j + 1) * cols]);
    assert!(b.row_bytes == cols * F::BITS / 8 && b.group.is_multiple_of(chunk_cols));
    // A row is short (1 KiB at 2,048 4-bit columns), too short for the hardware prefetcher
    // to pick up each of the tile's streams before it ends: the kernel stalled on its loads
    // at a fifth of memory speed. So while this tile reads its `R` rows, it asks for the
    // next tile's, `R row_bytes` bytes further, spread over its chunks: `R chunk_bytes` a
    // chunk, one line or more. (Beyond the block's end these are hints to the next
    // block's rows or to no address at all, which a prefetch allows.) Only for one token:
    // tiles of more are bound by their FMAs, and there the extra instructions cost more
    // (BENCHMARKS.md: on the shared machine, no change to +17% at T = 1, -12% at T = 4).
    let next = b.data.as_ptr().wrapping_add((r0 + R) * b.row_bytes);
    let ahead = R * chunk_bytes;
    if F::QUANT && T == 1 {
        for p in b.next_scales {
            let from = p.wrapping_add(r0 * b.scale_row_bytes);
            for line in (0..R * b.scale_row_bytes).step_by(64) {
                s.prefetch(from.wrapping_add(line));
            }
        }
    }
    let mut tot = [[s.zero(); T]; R];
    for g in 0..groups {
        let mut acc = [[s.zero(); T]; R];
        for c in g * per_group..(g + 1) * per_group {
            if T == 1 {
                for line in (0..ahead).step_by(64) {
                    s.prefetch(next.wrapping_add(c * ahead + line));
                }
            }
            for (acc, row) in acc.iter_mut().zip(rows) {
                // SAFETY: chunk `c < cols / chunk_cols` lies within the row's
                // `cols * BITS / 8` bytes (asserted above).
                let raw = unsafe { F::load(s, row.as_ptr().add(c * chunk_bytes)) };
                for k in 0..F::PARTS {
                    let w = F::part(s, raw, k);
                    for (a, xt) in acc.iter_mut().zip(xs) {
                        // SAFETY: the chunk's `PARTS L` inputs lie within the token's `cols`.
                        let xk = unsafe { s.load(xt.as_ptr().add(c * chunk_cols + k * lanes)) };
                        *a = s.fma(w, xk, *a);
                    }
                }
            }
        }
        for (i, (tot, acc)) in tot.iter_mut().zip(acc).enumerate() {
            if F::QUANT {
                let scale = s.splat(b.scales[(r0 + i) * groups + g]);
                for (t, a) in tot.iter_mut().zip(acc) {
                    *t = s.fma(a, scale, *t);
                }
            } else {
                for (t, a) in tot.iter_mut().zip(acc) {
                    *t = s.add(*t, a);
                }
            }
        }
    }
    for (i, tot) in tot.iter().enumerate() {
        let r = r0 + i;
        for (j, &t) in tot.iter().enumerate() {
            let bias = if F::QUANT {
                dot(
                    &b.biases[r * groups..(r + 1) * groups],
                    &x.sums[(t0 + j) * groups..(t0 + j + 1) * groups],
                )
            } else {
                0.0
            };
            out[r * x.t + t0 + j] = s.sum(t) + bias;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::QuantSpec;
    use rand::Rng;

    fn quant(bits: u32, group_size: usize) -> Rows<'static> {
        Rows::Quant(QuantView {
            spec: QuantSpec { bits, group_size },
            rows: 1,
            cols: 128,
            packed: &[],
            scales: Floats::f32(&[]),
            biases: Floats::f32(&[]),
        })
    }

    #[test]
    fn words_are_used_where_a_group_holds_whole_chunks() {
        for isa in [Isa::Avx512Vnni, Isa::Avx512, Isa::Avx2, Isa::Portable] {
            let words = |g| Kind::of(isa, &quant(4, g)) == Kind::Q4Words;
            assert!(!words(32), "{isa}");
            assert_eq!(words(64), isa.lanes() == 8, "{isa}");
            assert!(words(128), "{isa}");
            assert_eq!(Kind::of(isa, &quant(8, 64)), Kind::Q8);
        }
    }

    /// The word layout against MLX's byte layout, on 8 and 16 lanes (AVX-512's, which
    /// this test needs no AVX-512 to check): each word's nibbles unpacked as
    /// [`Simd::nibble`] does, times the activations [`Kind::lane_order`] lays out, sum to
    /// the plain dot product.
    #[test]
    fn words_and_their_lane_order_give_the_plain_dot_product() {
        let mut rng = rand::rng();
        for lanes in [8, 16] {
            let cols = 8 * lanes * 3;
            let packed: Vec<u8> = (0..cols / 2).map(|_| rng.random()).collect();
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            // MLX packs LSB first: byte i holds columns 2i (low) and 2i + 1 (high).
            let q = |c: usize| f32::from((packed[c / 2] >> (4 * (c % 2))) & 15);
            let want: f32 = (0..cols).map(|c| q(c) * x[c]).sum();
            let laid = Kind::Q4Words.lane_order(&x, lanes);
            let mut got = 0.0;
            for (chunk, xs) in packed
                .chunks_exact(4 * lanes)
                .zip(laid.chunks_exact(8 * lanes))
            {
                for j in 0..lanes {
                    let w = u32::from_le_bytes(chunk[4 * j..4 * j + 4].try_into().unwrap());
                    for k in 0..8 {
                        let v = if k == 7 { w >> 28 } else { w & (15 << (4 * k)) };
                        got += v as f32 * xs[k * lanes + j];
                    }
                }
            }
            assert!(
                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{lanes} lanes: {got} vs {want}"
            );
        }
    }
}
