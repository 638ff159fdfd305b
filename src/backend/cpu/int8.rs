//! Products with 4-bit weights in integer arithmetic: the activations as three signed
//! 8-bit digits each, dotted with the unpacked weights by AVX-512 VNNI's `vpdpbusd` (64
//! byte products an instruction), where the f32 kernel (matmul.rs) widens, converts and
//! multiplies every 16 weights apart.
//!
//! **Why three digits, not llama.cpp's one.** Each group of `g` activations is rounded to
//! integers `A = round(x / u)` with `u = max|x| / (127 * 2^14)` and written in base 128
//! with balanced digits, `A = 2^14 a1 + 2^7 a2 + a3` (`a1` in `-127..=127`, `a2` and `a3`
//! in `-64..=63`): a 21-bit integer per activation, rounding error `u / 2`, `2^-22` of
//! the group's largest value. One 8-bit digit (llama.cpp's Q8_0: `max|x| / 127`) moved
//! the fixtures' teacher-forced logits by 9% (norm-wise, relative, at the worst position);
//! two digits (about 15 bits) by 1.2e-3; both are outside the 1e-3 bound to mlx-lm that
//! the parity tests hold (the random fixtures amplify a perturbation 20-50 fold). Three
//! digits move them by at most 3.9e-5 from the f32 kernel's (BENCHMARKS.md, issue 38).
//!
//! A row's dot product is `sum_g (s_g u_g sum_{c in g} q_c A_c + b_g sum_{c in g} x_c)`
//! for MLX's affine `W = s q + b`: the integer sums are exact (Horner's scheme in `i32`
//! lanes: digit `a1`'s products, shifted by 7, plus `a2`'s, shifted by 7, plus `a3`'s;
//! at most `4 (g / 64) 15 127 2^14 < 2^29` per lane for `g <= 256`), each group's lanes
//! are converted to f32 once and scaled by `s_g u_g`, and the bias term takes the exact
//! f32 sums of `x`, as the f32 kernel does.
//!
//! Every token count takes it, so that a prompt's chunk and the same tokens decoded one
//! at a time give the same logits (the parity tests hold them to 1e-5; the f32 kernel for
//! one and this for the other differed by 1.4e-5). Only AVX-512 with VNNI and BW: on AVX2
//! the same sums take `vpmaddubsw`, `vpmaddwd` and an add per digit where VNNI has one
//! instruction, about as many as the f32 kernel's per 32 weights, so AVX2 keeps f32.

/// Digits per activation.
pub const DIGITS: usize = 3;
/// Bits of each lower digit's base.
const BASE_BITS: u32 = 7;
/// The largest `|A|`: 127 units of the top digit.
const A_MAX: f32 = (127 << (2 * BASE_BITS)) as f32;
/// Columns of one chunk: 32 bytes of 4-bit weights, unpacked into the 64 bytes of a zmm.
pub const CHUNK: usize = 64;
/// Whether the integer kernel takes `bits`-bit weights in groups of `group_size` columns:
/// 4-bit in groups of 64, 128 or 256 (the lanes' range, see above, and the registers that
/// keep a group's unpacked weights).
pub fn supports(bits: u32, group_size: usize) -> bool {
    bits == 4 && group_size.is_multiple_of(CHUNK) && matches!(group_size / CHUNK, 1 | 2 | 4)
}

/// Activations as digits for the integer kernel, token after token (a token's `cols`
/// columns are whole groups, so the layout below runs on across tokens).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Digits {
    /// Per chunk of [`CHUNK`] columns, [`DIGITS`] planes of [`CHUNK`] digits, the most
    /// significant first, each in the order the kernel unpacks a chunk: the low nibbles'
    /// columns (`0, 2, .., 62`), then the high nibbles' (`1, 3, .., 63`).
    pub q: Vec<i8>,
    /// Per group (of each token), the value of one unit of `A`: `max|x| / (127 2^14)`; NaN where the group
    /// holds a NaN, so that it reaches the output as the f32 kernel's would.
    pub unit: Vec<f32>,
}

impl Digits {
    /// `x` (rows of whole groups of `group` columns, [`supports`]) as digits.
    pub fn new(x: &[f32], group: usize) -> Digits {
        assert!(
            group.is_multiple_of(CHUNK) && x.len().is_multiple_of(group),
            "digits of partial groups"
        );
        let mut q = vec![0i8; DIGITS * x.len()];
        let mut unit = Vec::with_capacity(x.len() / group);
        for (g, xs) in x.chunks_exact(group).enumerate() {
            // NaN-propagating maximum (`f32::max` ignores NaN).
            let amax = xs.iter().fold(0.0f32, |m, &v| {
                if v.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max(v.abs())
                }
            });
            let u = amax / A_MAX;
            unit.push(u);
            let inv = if u > 0.0 && u.is_finite() {
                1.0 / u
            } else {
                0.0
            };
            for (c, chunk) in xs.chunks_exact(CHUNK).enumerate() {
                let at = DIGITS * (g * group + c * CHUNK);
                for (col, &v) in chunk.iter().enumerate() {
                    // `v inv` may round past `A_MAX` by an ulp: clamp, so `a1` stays in range.
                    let a = (v * inv).round().clamp(-A_MAX, A_MAX) as i32;
                    let lane = if col % 2 == 0 {
                        col / 2
                    } else {
                        CHUNK / 2 + col / 2
                    };
                    for (k, digit) in split(a).into_iter().enumerate() {
                        q[at + k * CHUNK + lane] = digit;
                    }
                }
            }
        }
        Digits { q, unit }
    }
}

/// `a` (`|a| <= 127 2^14`) in base 128 with balanced digits, most significant first:
/// `a = 2^14 d[0] + 2^7 d[1] + d[2]`, `d[0]` in `-127..=127`, `d[1]`, `d[2]` in `-64..=63`.
fn split(a: i32) -> [i8; DIGITS] {
    let low = |v: i32| ((v + 64) & 127) - 64;
    let d2 = low(a);
    let a1 = (a - d2) >> BASE_BITS;
    let d1 = low(a1);
    let d0 = (a1 - d1) >> BASE_BITS;
    [d0 as i8, d1 as i8, d2 as i8]
}

/// One block of rows of 4-bit weights as [`rows_vnni`] reads it.
#[cfg(target_arch = "x86_64")]
pub struct Rows<'a> {
    /// `rows` rows of `cols / 2` bytes, MLX's packing (byte `i`: columns `2i`, `2i + 1`).
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    /// `[rows, cols / group]` scales and biases.
    pub scales: &'a [f32],
    pub biases: &'a [f32],
    /// Where the next block's raw scales and biases would start, and their bytes per row:
    /// one token's tiles ask for them as the f32 kernel's do (hints only: they may point
    /// past the weight's end).
    pub next_scales: [*const u8; 2],
    pub scale_row_bytes: usize,
}

/// `x W^T` for the `t` tokens `x` (as digits, with their per-group sums `sums`
/// `[t, groups]`) over `w`'s rows, into `out` `[w.rows, t]`, on AVX-512 VNNI: tiles of four
/// rows for one token, of two rows by up to four tokens otherwise (within the 32 vector
/// registers for groups of four chunks), tokens outermost as in the f32 kernel. Panics
/// unless the shapes agree and [`supports`]`(4, w.group)`.
///
/// # Safety
/// The CPU has AVX-512F, AVX-512BW and AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn rows_vnni(w: &Rows<'_>, x: &Digits, t: usize, sums: &[f32], out: &mut [f32]) {
    let groups = w.cols / w.group;
    assert!(supports(4, w.group) && w.cols.is_multiple_of(w.group));
    assert_eq!(w.data.len(), w.rows * w.cols / 2, "int8 kernel weights");
    assert_eq!(w.scales.len(), w.rows * groups, "int8 kernel scales");
    assert_eq!(w.biases.len(), w.rows * groups, "int8 kernel biases");
    assert_eq!(x.q.len(), DIGITS * t * w.cols, "int8 kernel digits");
    assert_eq!(
        (x.unit.len(), sums.len()),
        (t * groups, t * groups),
        "int8 kernel groups"
    );
    assert_eq!(out.len(), w.rows * t, "int8 kernel output");
    // SAFETY (the calls below): the CPU's features are the caller's contract; the bounds
    // were asserted above.
    macro_rules! rows {
        ($r:literal, $t:literal, $t0:expr) => {{
            let mut r = 0;
            while r + $r <= w.rows {
                match w.group / CHUNK {
                    1 => unsafe { tile::<$r, $t, 1>(w, r, x, $t0, t, sums, out) },
                    2 => unsafe { tile::<$r, $t, 2>(w, r, x, $t0, t, sums, out) },
                    4 => unsafe { tile::<$r, $t, 4>(w, r, x, $t0, t, sums, out) },
                    _ => unreachable!("supported groups"),
                }
                r += $r;
            }
            while r < w.rows {
                match w.group / CHUNK {
                    1 => unsafe { tile::<1, $t, 1>(w, r, x, $t0, t, sums, out) },
                    2 => unsafe { tile::<1, $t, 2>(w, r, x, $t0, t, sums, out) },
                    4 => unsafe { tile::<1, $t, 4>(w, r, x, $t0, t, sums, out) },
                    _ => unreachable!("supported groups"),
                }
                r += 1;
            }
        }};
    }
    for t0 in (0..t).step_by(4) {
        match (t - t0).min(4) {
            1 => rows!(4, 1, t0),
            2 => rows!(2, 2, t0),
            3 => rows!(2, 3, t0),
            _ => rows!(2, 4, t0),
        }
    }
}

/// Rows `r0 .. r0 + R` of `w` against tokens `t0 .. t0 + T` of the `t` tokens of `x`, in
/// groups of `PER` chunks.
///
/// # Safety
/// As [`rows_vnni`], whose assertions hold, `r0 + R <= w.rows` and `t0 + T <= t`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn tile<const R: usize, const T: usize, const PER: usize>(
    w: &Rows<'_>,
    r0: usize,
    x: &Digits,
    t0: usize,
    t: usize,
    sums: &[f32],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;

    let groups = w.cols / w.group;
    let row_bytes = w.cols / 2;
    let rows: [*const u8; R] = std::array::from_fn(|i| w.data[(r0 + i) * row_bytes..].as_ptr());
    let xs: [*const i8; T] = std::array::from_fn(|j| x.q[DIGITS * (t0 + j) * w.cols..].as_ptr());
    // As in the f32 kernel: a row is too short for the hardware prefetcher, so for one
    // token each chunk asks for its share of the next tile's rows, `R 32` bytes further.
    let next = w.data.as_ptr().wrapping_add((r0 + R) * row_bytes);
    // The high nibbles shift down by 4 in the upper half of the broadcast chunk.
    let shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    let nibble = _mm512_set1_epi8(15);
    if T == 1 {
        for p in w.next_scales {
            let from = p.wrapping_add(r0 * w.scale_row_bytes);
            for line in (0..R * w.scale_row_bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(from.wrapping_add(line).cast());
            }
        }
    }
    let mut tot = [[_mm512_setzero_ps(); T]; R];
    for g in 0..groups {
        let mut wv = [[_mm512_setzero_si512(); PER]; R];
        for c in 0..PER {
            let chunk = g * PER + c;
            if T == 1 {
                for line in (0..R * CHUNK / 2).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(
                        next.wrapping_add(chunk * R * CHUNK / 2 + line).cast(),
                    );
                }
            }
            for i in 0..R {
                // SAFETY: chunk `chunk < cols / 64` lies within the row (asserted).
                let packed = unsafe { _mm256_loadu_si256(rows[i].add(chunk * CHUNK / 2).cast()) };
                let both = _mm512_broadcast_i64x4(packed);
                wv[i][c] = _mm512_and_si512(_mm512_srlv_epi64(both, shifts), nibble);
            }
        }
        // Index loops over the const bounds: LLVM unrolls them and keeps every
        // accumulator in a register (iterator adaptors here left them on the stack).
        let mut acc = [[_mm512_setzero_si512(); T]; R];
        for k in 0..DIGITS {
            if k > 0 {
                for i in 0..R {
                    for j in 0..T {
                        acc[i][j] = _mm512_slli_epi32::<{ BASE_BITS }>(acc[i][j]);
                    }
                }
            }
            for c in 0..PER {
                let at = DIGITS * (g * PER + c) * CHUNK + k * CHUNK;
                for j in 0..T {
                    // SAFETY: `at + 64 <= DIGITS cols`, within the token's digits (asserted).
                    let xq = unsafe { _mm512_loadu_si512(xs[j].add(at).cast()) };
                    for i in 0..R {
                        acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], wv[i][c], xq);
                    }
                }
            }
        }
        for i in 0..R {
            let s = w.scales[(r0 + i) * groups + g];
            for j in 0..T {
                let scale = _mm512_set1_ps(s * x.unit[(t0 + j) * groups + g]);
                tot[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), scale, tot[i][j]);
            }
        }
    }
    for (i, tot) in tot.into_iter().enumerate() {
        let r = r0 + i;
        for (j, tv) in tot.into_iter().enumerate() {
            let tok = t0 + j;
            let bias = super::dot(
                &w.biases[r * groups..(r + 1) * groups],
                &sums[tok * groups..(tok + 1) * groups],
            );
            out[r * t + tok] = _mm512_reduce_add_ps(tv) + bias;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// Random activations with a few large values, as a model's have, and some groups
    /// all zero.
    fn activations(n: usize, group: usize) -> Vec<f32> {
        let mut rng = rand::rng();
        let mut x: Vec<f32> = (0..n)
            .map(|_| {
                rng.random_range(-1.0f32..1.0) * if rng.random_bool(0.02) { 40.0 } else { 1.0 }
            })
            .collect();
        if n >= 2 * group {
            x[group..2 * group].fill(0.0);
        }
        x
    }

    /// Digit `k` of activation `col` (counted across tokens).
    fn digit(d: &Digits, col: usize, k: usize) -> i32 {
        let (c, j) = (col / CHUNK, col % CHUNK);
        let lane = if j % 2 == 0 { j / 2 } else { CHUNK / 2 + j / 2 };
        i32::from(d.q[DIGITS * c * CHUNK + k * CHUNK + lane])
    }

    /// The integer activation `col` was rounded to.
    fn integer(d: &Digits, col: usize) -> i32 {
        (0..DIGITS).fold(0, |a, k| (a << BASE_BITS) + digit(d, col, k))
    }

    #[test]
    fn digits_round_each_activation_to_half_a_unit() {
        for group in [64, 128, 256] {
            let x = activations(4 * group, group);
            let d = Digits::new(&x, group);
            for (col, &v) in x.iter().enumerate() {
                let u = d.unit[col / group];
                let a = integer(&d, col);
                assert!(a.abs() <= 127 << 14, "g{group} col {col}: {a}");
                // Half a unit, and the f32 rounding of `v / u` (up to 2^21 units).
                let err = (a as f64 * u as f64 - v as f64).abs();
                assert!(
                    err <= 0.5 * u as f64 + 4.0 * f64::from(f32::EPSILON) * v.abs() as f64,
                    "g{group} col {col}: {v} as {a} units of {u}"
                );
                for k in 1..DIGITS {
                    assert!((-64..64).contains(&digit(&d, col, k)));
                }
            }
        }
    }

    #[test]
    fn a_nan_reaches_its_group_unit() {
        let mut x = activations(128, 64);
        x[70] = f32::NAN;
        let d = Digits::new(&x, 64);
        assert!(d.unit[0].is_finite() && d.unit[1].is_nan());
    }

    #[test]
    fn balanced_digits_rebuild_every_integer_at_the_ends() {
        let m = 127 << 14;
        for a in [
            -m,
            -m + 1,
            -8257,
            -8256,
            -64,
            -63,
            -1,
            0,
            1,
            63,
            64,
            8191,
            8192,
            m - 1,
            m,
        ] {
            let d = split(a);
            let back = (i32::from(d[0]) << 14) + (i32::from(d[1]) << 7) + i32::from(d[2]);
            assert_eq!(back, a);
            assert!((-127..=127).contains(&d[0]), "{a}: {d:?}");
        }
    }

    /// The kernel against the same sums in exact integers and f64, for one token and
    /// tiles of two to four with remainders: the integers are exact, so the only
    /// difference is the f32 conversion of each group's lanes, the scaling and the lanes'
    /// sum (a few ulps of `sum_g |s_g u_g| sum |q A| + |b_g sum_g x|`).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_kernel_matches_exact_integer_sums() {
        if !crate::backend::cpu::Isa::Avx512Vnni.is_supported() {
            // Nothing to run: the dispatch never picks the kernel on this CPU.
            eprintln!("no AVX-512 VNNI on this CPU");
            return;
        }
        let mut rng = rand::rng();
        for (rows, cols, group, t) in [
            (1, 64, 64, 1),
            (9, 512, 64, 1),
            (6, 384, 128, 1),
            (13, 1024, 256, 1),
            (4, 256, 128, 1),
            (5, 512, 64, 2),
            (3, 256, 256, 3),
            (7, 384, 128, 9),
        ] {
            let groups = cols / group;
            let data: Vec<u8> = (0..rows * cols / 2).map(|_| rng.random()).collect();
            let scales: Vec<f32> = (0..rows * groups)
                .map(|_| rng.random_range(0.001..0.1))
                .collect();
            let biases: Vec<f32> = (0..rows * groups)
                .map(|_| rng.random_range(-0.1..0.1))
                .collect();
            let x = activations(t * cols, group);
            let sums: Vec<f32> = x.chunks_exact(group).map(|g| g.iter().sum()).collect();
            let d = Digits::new(&x, group);
            let w = Rows {
                data: &data,
                rows,
                cols,
                group,
                scales: &scales,
                biases: &biases,
                next_scales: [std::ptr::null(); 2],
                scale_row_bytes: 0,
            };
            let mut got = vec![f32::NAN; rows * t];
            // SAFETY: the features were detected above.
            unsafe { rows_vnni(&w, &d, t, &sums, &mut got) };
            for r in 0..rows {
                let q = |c: usize| i64::from((data[r * cols / 2 + c / 2] >> (4 * (c % 2))) & 15);
                for j in 0..t {
                    let (mut want, mut mag) = (0.0f64, 0.0f64);
                    for g in 0..groups {
                        let a = |c: usize| i64::from(integer(&d, j * cols + c));
                        let cs = g * group..(g + 1) * group;
                        let exact: i64 = cs.clone().map(|c| q(c) * a(c)).sum();
                        let size: i64 = cs.map(|c| q(c) * a(c).abs()).sum();
                        let su =
                            f64::from(scales[r * groups + g]) * f64::from(d.unit[j * groups + g]);
                        let bias =
                            f64::from(biases[r * groups + g]) * f64::from(sums[j * groups + g]);
                        want += su * exact as f64 + bias;
                        mag += su * size as f64 + bias.abs();
                    }
                    let e = (f64::from(got[r * t + j]) - want).abs();
                    assert!(
                        e <= 1e-6 * mag,
                        "{rows}x{cols} g{group} T={t}: row {r} token {j}: {} vs {want} (size {mag})",
                        got[r * t + j]
                    );
                }
            }
        }
    }
}
