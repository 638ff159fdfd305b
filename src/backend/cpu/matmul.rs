//! `x W^T` for quantized and dense weights in SIMD: the CPU backend's hot path, for the
//! resident projections, the head and the routed experts alike.
//!
//! A weight row is read 32 columns at a time and unpacked in registers into two vectors of
//! 16 f32 lanes (4-bit: 16 bytes, byte `i` holding columns `2i` and `2i + 1` since MLX
//! packs LSB first; 8-bit: 32 bytes; dense: 32 floats), dequantized as `s q + b` (MLX
//! affine, quant.rs), and multiplied into every token of a tile of up to [`TILE`] tokens
//! with f32 FMA: a weight is read and dequantized once per tile, not once per token. The
//! activations are put in the order the unpacking yields once per call ([`lane_order`]:
//! for 4-bit, the even columns of each 32 then the odd ones). Output rows are split into
//! blocks computed in parallel on rayon's pool, whose threads stay alive between calls.
//!
//! SIMD: `multiversion` compiles [`rows_into`] for AVX-512, for AVX2 with FMA and for the
//! baseline, and picks one at run time (once, then an atomic load per call); on aarch64
//! NEON and FMA are baseline, so the one build has them. The kernel is plain Rust over
//! fixed-size arrays that LLVM vectorizes for each target. `pulp`'s portable vectors were
//! the alternative, but they have no widening of bytes to 32-bit lanes, which the
//! unpacking is made of, so they would have meant intrinsics per target after all.

use std::ops::Range;

use multiversion::multiversion;
use multiversion::target::target_cfg_f;
use rayon::prelude::*;

use super::Rows;

/// Tokens whose dot products share one unpacking of a weight chunk (prefill). Four keep
/// the accumulators and the unpacked chunk in AVX2's sixteen registers.
pub const TILE: usize = 4;

/// f32 lanes of one unpacked half-chunk (16 weights).
const LANES: usize = 16;

/// Weights and scale/bias bytes a parallel task aims at: its rows stay in L2 while every
/// token tile passes over them.
const TASK_BYTES: usize = 128 << 10;

/// Whether `w`'s kernel reads its activations in [`lane_order`].
pub fn wants_lane_order(w: &Rows<'_>) -> bool {
    matches!(w, Rows::Quant(q) if q.spec.bits == 4)
}

/// `x` (rows of a multiple of 32 columns) with every 32 consecutive values reordered as
/// the 4-bit kernel unpacks a 16-byte chunk: the 16 even columns, then the 16 odd ones.
pub fn lane_order(x: &[f32]) -> Vec<f32> {
    assert_eq!(x.len() % 32, 0, "lane order of a partial chunk");
    let mut out = vec![0.0; x.len()];
    for (o, c) in out.chunks_exact_mut(32).zip(x.chunks_exact(32)) {
        for i in 0..LANES {
            o[i] = c[2 * i];
            o[LANES + i] = c[2 * i + 1];
        }
    }
    out
}

/// Whether the SIMD kernel takes `w`: quantized weights always (their columns come in
/// groups of at least 32), dense ones whose rows are whole 32-column chunks.
pub fn supports(w: &Rows<'_>) -> bool {
    match w {
        Rows::Quant(_) => true,
        Rows::Dense { cols, .. } => cols % 32 == 0,
    }
}

/// Rows per parallel task for a weight of `rows` rows of `row_bytes` bytes: about
/// [`TASK_BYTES`] each, and at least eight tasks per thread where the rows allow, so a
/// thread slowed by other work on the machine leaves its share to the others.
pub fn rows_per_task(rows: usize, row_bytes: usize) -> usize {
    let by_bytes = (TASK_BYTES / row_bytes.max(1)).max(1);
    let by_threads = rows.div_ceil(8 * rayon::current_num_threads()).max(1);
    by_bytes.min(by_threads).clamp(1, rows.max(1))
}

/// Bytes of one row of `w` (weights, scales and biases).
pub fn row_bytes(w: &Rows<'_>) -> usize {
    match w {
        Rows::Quant(q) => {
            let groups = q.cols / q.spec.group_size;
            let scale_width = q.scales.bytes.len() / (q.rows * groups).max(1);
            q.cols * q.spec.bits as usize / 8 + 2 * groups * scale_width
        }
        Rows::Dense { cols, .. } => 4 * cols,
    }
}

/// `x W^T` for `x` `[t, in]` in natural column order: `[t, out]`, row-major. Panics unless
/// [`supports`]`(w)` and `x` has `t * in` values.
pub fn matmul(x: &[f32], t: usize, w: &Rows<'_>) -> Vec<f32> {
    let (rows, cols) = w.shape();
    assert_eq!(x.len(), t * cols, "matmul input width");
    let ordered;
    let x = if wants_lane_order(w) {
        ordered = lane_order(x);
        &ordered[..]
    } else {
        x
    };
    let out = rows_parallel(w, x, t);
    transpose(out, rows, t)
}

/// `[rows, t]` outputs of `x W^T` (`x` already in `w`'s lane order), rows in parallel.
pub fn rows_parallel(w: &Rows<'_>, x: &[f32], t: usize) -> Vec<f32> {
    let rows = w.shape().0;
    let per_task = rows_per_task(rows, row_bytes(w));
    let mut out = vec![0.0f32; rows * t];
    if t == 0 {
        return out;
    }
    out.par_chunks_mut(per_task * t)
        .enumerate()
        .for_each(|(i, o)| {
            let r0 = i * per_task;
            rows_into(w, r0..r0 + o.len() / t, x, t, o)
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

/// `a b + c`, fused where the target has FMA.
#[inline(always)]
fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// The sum of `a`'s lanes, pairwise.
#[inline(always)]
fn hsum<const W: usize>(mut a: [f32; W]) -> f32 {
    let mut w = W;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            a[i] += a[i + w];
        }
    }
    a[0]
}

/// One chunk of 32 weights as two vectors of [`LANES`].
type Chunk = ([f32; LANES], [f32; LANES]);

/// Dot products of one weight row with `N` tokens: `chunk(c)` gives the row's 32-weight
/// chunk `c` (of `chunks`) in the activations' lane order. With one token the two halves
/// of a chunk accumulate apart, two independent FMA chains per lane; with more, the
/// tokens are the independent chains.
#[inline(always)]
fn row_dot<const N: usize, const FUSED: bool>(
    chunks: usize,
    chunk: impl Fn(usize) -> Chunk,
    xs: [&[f32]; N],
) -> [f32; N] {
    let hi_at = if N == 1 { LANES } else { 0 };
    let mut acc = [[0.0f32; 2 * LANES]; N];
    for c in 0..chunks {
        let (lo, hi) = chunk(c);
        for (a, x) in acc.iter_mut().zip(xs) {
            let x: &[f32; 2 * LANES] = x[32 * c..32 * c + 32].try_into().unwrap();
            for i in 0..LANES {
                a[i] = madd::<FUSED>(lo[i], x[i], a[i]);
            }
            for i in 0..LANES {
                a[hi_at + i] = madd::<FUSED>(hi[i], x[LANES + i], a[hi_at + i]);
            }
        }
    }
    acc.map(hsum)
}

/// Output rows `rows` of `x W^T` for `t` tokens `x` `[t, cols]` in `w`'s lane order, into
/// `out` `[rows.len(), t]`: token tiles outermost, so a block's weights come from memory
/// once and from cache for the other tiles.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+avx+fma+f16c",
    "x86_64+avx2+avx+fma+f16c"
))]
pub fn rows_into(w: &Rows<'_>, rows: Range<usize>, x: &[f32], t: usize, out: &mut [f32]) {
    const FUSED: bool = target_cfg_f!(any(target_feature = "fma", target_arch = "aarch64"));
    let cols = w.shape().1;
    let chunks = cols / 32;
    // The tile's dot products of one row, for a tile of each size up to TILE.
    macro_rules! tiles {
        ($row:expr, $chunk:expr, $t0:expr, $n:expr) => {{
            let xs = |i: usize| &x[($t0 + i) * cols..($t0 + i + 1) * cols];
            let o = &mut out[$row * t + $t0..$row * t + $t0 + $n];
            match $n {
                1 => o.copy_from_slice(&row_dot::<1, FUSED>(chunks, $chunk, [xs(0)])),
                2 => o.copy_from_slice(&row_dot::<2, FUSED>(chunks, $chunk, [xs(0), xs(1)])),
                3 => o.copy_from_slice(&row_dot::<3, FUSED>(chunks, $chunk, [xs(0), xs(1), xs(2)])),
                _ => o.copy_from_slice(&row_dot::<4, FUSED>(
                    chunks,
                    $chunk,
                    [xs(0), xs(1), xs(2), xs(3)],
                )),
            }
        }};
    }
    match w {
        Rows::Quant(q) => {
            let groups = cols / q.spec.group_size;
            // Chunks per group is a power of two (groups of 32, 64 or 128 columns).
            let shift = (q.spec.group_size / 32).trailing_zeros();
            let mut scales = vec![0.0f32; rows.len() * groups];
            let mut biases = vec![0.0f32; rows.len() * groups];
            q.scales.read_into(rows.start * groups, &mut scales);
            q.biases.read_into(rows.start * groups, &mut biases);
            let row_bytes = cols * q.spec.bits as usize / 8;
            for t0 in (0..t).step_by(TILE) {
                let n = TILE.min(t - t0);
                for (i, r) in rows.clone().enumerate() {
                    let packed = &q.packed[r * row_bytes..(r + 1) * row_bytes];
                    let (s, b) = (
                        &scales[i * groups..(i + 1) * groups],
                        &biases[i * groups..(i + 1) * groups],
                    );
                    if q.spec.bits == 4 {
                        let chunk = |c: usize| {
                            let bytes: &[u8; 16] = packed[16 * c..16 * c + 16].try_into().unwrap();
                            let (s, b) = (s[c >> shift], b[c >> shift]);
                            let mut lo = [0.0f32; LANES];
                            let mut hi = [0.0f32; LANES];
                            for j in 0..LANES {
                                lo[j] = madd::<FUSED>((bytes[j] & 15) as f32, s, b);
                                hi[j] = madd::<FUSED>((bytes[j] >> 4) as f32, s, b);
                            }
                            (lo, hi)
                        };
                        tiles!(i, chunk, t0, n);
                    } else {
                        let chunk = |c: usize| {
                            let bytes: &[u8; 32] = packed[32 * c..32 * c + 32].try_into().unwrap();
                            let (s, b) = (s[c >> shift], b[c >> shift]);
                            let mut lo = [0.0f32; LANES];
                            let mut hi = [0.0f32; LANES];
                            for j in 0..LANES {
                                lo[j] = madd::<FUSED>(bytes[j] as f32, s, b);
                                hi[j] = madd::<FUSED>(bytes[LANES + j] as f32, s, b);
                            }
                            (lo, hi)
                        };
                        tiles!(i, chunk, t0, n);
                    }
                }
            }
        }
        Rows::Dense { data, .. } => {
            for t0 in (0..t).step_by(TILE) {
                let n = TILE.min(t - t0);
                for (i, r) in rows.clone().enumerate() {
                    let row = &data[r * cols..(r + 1) * cols];
                    let chunk = |c: usize| {
                        let v: &[f32; 32] = row[32 * c..32 * c + 32].try_into().unwrap();
                        let mut lo = [0.0f32; LANES];
                        let mut hi = [0.0f32; LANES];
                        lo.copy_from_slice(&v[..LANES]);
                        hi.copy_from_slice(&v[LANES..]);
                        (lo, hi)
                    };
                    tiles!(i, chunk, t0, n);
                }
            }
        }
    }
}
