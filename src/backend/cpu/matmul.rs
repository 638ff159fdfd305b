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
//! baseline, and picks one at run time (once, then an atomic load per call; the AVX-512
//! build needs Ice Lake's extensions too, as multiversion asks, so older AVX-512 parts that
//! slow their clock for it take the AVX2 one); on aarch64 NEON and FMA are baseline, so
//! the one build has them. The kernel is plain Rust over fixed-size arrays that LLVM
//! vectorizes for each target. `pulp`'s portable vectors were
//! the alternative, but they have no widening of bytes to 32-bit lanes, which the
//! unpacking is made of, so they would have meant intrinsics per target after all.

use std::ops::Range;

use multiversion::multiversion;
use multiversion::target::target_cfg_f;
use rayon::prelude::*;

use super::lanes::{madd, F32x16};
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
    let per_task = rows_per_task(rows, row_bytes(w), 1);
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

/// One chunk of 32 weights as two vectors of [`LANES`].
type Chunk = (F32x16, F32x16);

/// A weight row read 32 columns at a time, in its activations' lane order. (A trait rather
/// than a closure: its methods can be forced inline, and a call per chunk would spill every
/// accumulator.)
trait RowChunks {
    /// Chunk `c`, dequantized.
    fn chunk<const FUSED: bool>(&self, c: usize) -> Chunk;
}

/// A 4-bit row: byte `j` of a 16-byte chunk holds columns `2j` (low nibble) and `2j + 1`.
struct Q4Row<'a> {
    packed: &'a [[u8; 16]],
    scales: &'a [f32],
    biases: &'a [f32],
    /// log2 of the chunks per group.
    shift: u32,
}

impl RowChunks for Q4Row<'_> {
    #[inline(always)]
    fn chunk<const FUSED: bool>(&self, c: usize) -> Chunk {
        let bytes = &self.packed[c];
        let (s, b) = (self.scales[c >> self.shift], self.biases[c >> self.shift]);
        let mut lo = [0.0f32; LANES];
        let mut hi = [0.0f32; LANES];
        for j in 0..LANES {
            lo[j] = madd::<FUSED>((bytes[j] & 15) as f32, s, b);
            hi[j] = madd::<FUSED>((bytes[j] >> 4) as f32, s, b);
        }
        (F32x16(lo), F32x16(hi))
    }
}

/// An 8-bit row: a byte per column.
struct Q8Row<'a> {
    packed: &'a [[u8; 32]],
    scales: &'a [f32],
    biases: &'a [f32],
    shift: u32,
}

impl RowChunks for Q8Row<'_> {
    #[inline(always)]
    fn chunk<const FUSED: bool>(&self, c: usize) -> Chunk {
        let bytes = &self.packed[c];
        let (s, b) = (self.scales[c >> self.shift], self.biases[c >> self.shift]);
        let mut lo = [0.0f32; LANES];
        let mut hi = [0.0f32; LANES];
        for j in 0..LANES {
            lo[j] = madd::<FUSED>(bytes[j] as f32, s, b);
            hi[j] = madd::<FUSED>(bytes[LANES + j] as f32, s, b);
        }
        (F32x16(lo), F32x16(hi))
    }
}

/// A dense f32 row.
struct DenseRow<'a>(&'a [[f32; 32]]);

impl RowChunks for DenseRow<'_> {
    #[inline(always)]
    fn chunk<const FUSED: bool>(&self, c: usize) -> Chunk {
        let (lo, hi) = self.0[c].split_at(LANES);
        (
            F32x16(lo.try_into().unwrap()),
            F32x16(hi.try_into().unwrap()),
        )
    }
}

/// Dot products of one weight row with `N` tokens, `xs[i]` token `i`'s chunks. With one
/// token the two halves of a chunk accumulate apart, two independent FMA chains per lane;
/// with more, the tokens are the independent chains.
#[inline(always)]
fn row_dot<const N: usize, const FUSED: bool>(
    row: &impl RowChunks,
    xs: [&[[f32; 32]]; N],
) -> [f32; N] {
    let mut acc = [F32x16::ZERO; N];
    let mut acc_hi = F32x16::ZERO;
    for c in 0..xs[0].len() {
        let (lo, hi) = row.chunk::<FUSED>(c);
        for (a, x) in acc.iter_mut().zip(xs) {
            let (x_lo, x_hi) = x[c].split_at(LANES);
            let x_lo = F32x16(x_lo.try_into().unwrap());
            let x_hi = F32x16(x_hi.try_into().unwrap());
            if N == 1 {
                *a = lo.madd::<FUSED>(x_lo, *a);
                acc_hi = hi.madd::<FUSED>(x_hi, acc_hi);
            } else {
                *a = hi.madd::<FUSED>(x_hi, lo.madd::<FUSED>(x_lo, *a));
            }
        }
    }
    if N == 1 {
        acc[0] = acc[0].add(acc_hi);
    }
    acc.map(F32x16::sum)
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
    let x = x.as_chunks::<32>().0;
    let chunks = cols / 32;
    let xs = |i: usize| &x[i * chunks..(i + 1) * chunks];
    // The block's scales and biases, widened once for every tile.
    let params = match w {
        Rows::Quant(q) => {
            let n = rows.len() * cols / q.spec.group_size;
            let (mut scales, mut biases) = (vec![0.0f32; n], vec![0.0f32; n]);
            q.scales
                .read_into(rows.start * cols / q.spec.group_size, &mut scales);
            q.biases
                .read_into(rows.start * cols / q.spec.group_size, &mut biases);
            (scales, biases)
        }
        Rows::Dense { .. } => Default::default(),
    };
    for t0 in (0..t).step_by(TILE) {
        let n = TILE.min(t - t0);
        for (i, r) in rows.clone().enumerate() {
            let o = &mut out[i * t + t0..i * t + t0 + n];
            macro_rules! dot {
                ($row:expr) => {
                    match n {
                        1 => o.copy_from_slice(&row_dot::<1, FUSED>($row, [xs(t0)])),
                        2 => o.copy_from_slice(&row_dot::<2, FUSED>($row, [xs(t0), xs(t0 + 1)])),
                        3 => o.copy_from_slice(&row_dot::<3, FUSED>(
                            $row,
                            [xs(t0), xs(t0 + 1), xs(t0 + 2)],
                        )),
                        _ => o.copy_from_slice(&row_dot::<4, FUSED>(
                            $row,
                            [xs(t0), xs(t0 + 1), xs(t0 + 2), xs(t0 + 3)],
                        )),
                    }
                };
            }
            match w {
                Rows::Quant(q) => {
                    let groups = cols / q.spec.group_size;
                    let shift = (q.spec.group_size / 32).trailing_zeros();
                    let row_bytes = cols * q.spec.bits as usize / 8;
                    let packed = &q.packed[r * row_bytes..(r + 1) * row_bytes];
                    let (scales, biases) = (
                        &params.0[i * groups..(i + 1) * groups],
                        &params.1[i * groups..(i + 1) * groups],
                    );
                    if q.spec.bits == 4 {
                        let row = Q4Row {
                            packed: packed.as_chunks().0,
                            scales,
                            biases,
                            shift,
                        };
                        dot!(&row)
                    } else {
                        let row = Q8Row {
                            packed: packed.as_chunks().0,
                            scales,
                            biases,
                            shift,
                        };
                        dot!(&row)
                    }
                }
                Rows::Dense { data, .. } => {
                    dot!(&DenseRow(data[r * cols..(r + 1) * cols].as_chunks().0))
                }
            }
        }
    }
}
