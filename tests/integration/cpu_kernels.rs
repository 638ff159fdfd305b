//! The CPU backend's SIMD kernels against its plain ones (`CpuBackend::scalar()`, the
//! oracle the GPU kernels are tested against too), on fresh random inputs, for every
//! instruction set this CPU runs (AVX-512, AVX2 and the portable kernels on an AVX-512
//! machine): every bit width, group size and scale dtype, odd shapes (row counts that do
//! not fill a tile of rows or a task, token counts that do not fill a tile of tokens),
//! dense weights, and routed experts with tokens sharing experts.

use rand::Rng;
use safetensors::Dtype;
use slotstream::backend::cpu::{CpuBackend, Isa};
use slotstream::backend::{Backend, Routing};
use slotstream::checkpoint::{DenseMatrix, LinearWeight, QuantizedMatrix};
use slotstream::config::QuantSpec;
use slotstream::records::ExpertRecord;

use crate::common::compare::{abs_products, assert_elementwise};

const DTYPES: [Dtype; 3] = [Dtype::BF16, Dtype::F16, Dtype::F32];

/// `n` values of `dtype`, little-endian, uniform in `range`.
fn random_floats(n: usize, dtype: Dtype, range: std::ops::Range<f32>) -> Vec<u8> {
    let mut rng = rand::rng();
    (0..n)
        .flat_map(|_| {
            let v = rng.random_range(range.clone());
            match dtype {
                Dtype::F32 => v.to_le_bytes().to_vec(),
                Dtype::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                _ => half::bf16::from_f32(v).to_le_bytes().to_vec(),
            }
        })
        .collect()
}

/// A random MLX-quantized `[rows, cols]` matrix: every packed bit random, scales and
/// biases of a trained model's magnitudes.
fn random_matrix(rows: usize, cols: usize, spec: QuantSpec, dtype: Dtype) -> QuantizedMatrix {
    let groups = rows * cols / spec.group_size;
    QuantizedMatrix {
        spec,
        rows,
        cols,
        packed: (0..rows * cols / spec.per_word())
            .map(|_| rand::random())
            .collect(),
        scale_dtype: dtype,
        scales: random_floats(groups, dtype, 0.001..0.05),
        biases: random_floats(groups, dtype, -0.2..0.2),
    }
}

/// The SIMD backend for every instruction set this CPU runs.
fn simd_backends() -> Vec<CpuBackend> {
    let isas = Isa::available();
    assert_eq!(isas.first(), Some(&Isa::detect()), "fastest first");
    assert_eq!(
        isas.last(),
        Some(&Isa::Portable),
        "the portable kernels run anywhere"
    );
    isas.into_iter()
        .map(|isa| CpuBackend::with_isa(isa).unwrap())
        .collect()
}

fn random(n: usize) -> Vec<f32> {
    let mut rng = rand::rng();
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// [`assert_elementwise`] at 1e-5 of `|W||x|`: the two summation orders' rounding, each
/// a few ulps of the sum of the terms' magnitudes.
fn assert_within(name: &str, got: &[f32], want: &[f32], bound: &[f32]) {
    assert_elementwise(name, got, want, bound, "|W||x|", 1e-5);
}

#[test]
fn quantized_matmul_matches_scalar_for_every_format() {
    let scalar = CpuBackend::scalar();
    assert!(!CpuBackend.is_scalar() && scalar.is_scalar() && scalar.isa().is_none());
    assert_eq!(CpuBackend.isa(), Some(Isa::detect()));
    for simd in simd_backends() {
        let isa = simd.isa().unwrap();
        for bits in [4, 8] {
            for group_size in [32, 64, 128] {
                for dtype in DTYPES {
                    let spec = QuantSpec { bits, group_size };
                    // One group; three (an odd count of chunk pairs); a model's width. Row
                    // counts that fill tiles of four rows and that leave one to three over, and
                    // are not a multiple of any task size; token counts 1 to 9 cover the tile of
                    // four and its remainders.
                    for (rows, cols, tokens) in [
                        (1, group_size, 1),
                        (37, 3 * group_size, 5),
                        (129, 2048, 1),
                        (64, 512, 1),
                        (67, 1024, 9),
                        (5, 256, 2),
                        (8, 256, 4),
                        (3, 256, 3),
                        (11, 384, 7),
                    ] {
                        let w = LinearWeight::Quantized(random_matrix(rows, cols, spec, dtype));
                        let x = random(tokens * cols);
                        let xt = simd.upload(&x, tokens, cols);
                        let got = simd.matmul(&xt, &w);
                        let want = scalar.matmul(&xt, &w);
                        assert_eq!((got.rows, got.cols), (tokens, rows));
                        assert_within(
                            &format!(
                            "{isa}: {bits}-bit g{group_size} {dtype:?} {rows}x{cols} T={tokens}"
                        ),
                            &got.data,
                            &want.data,
                            &abs_products(&scalar, &w, &x, tokens),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn dense_matmul_matches_scalar() {
    let scalar = CpuBackend::scalar();
    // Whole 32-column chunks take the SIMD kernel; 40 columns the plain one.
    for simd in simd_backends() {
        for (rows, cols, tokens) in [(33, 64, 1), (70, 2048, 6), (9, 40, 3), (6, 96, 2)] {
            let w = LinearWeight::Dense(DenseMatrix {
                rows,
                cols,
                data: random(rows * cols),
            });
            let x = random(tokens * cols);
            let xt = simd.upload(&x, tokens, cols);
            assert_within(
                &format!("{}: dense {rows}x{cols} T={tokens}", simd.isa().unwrap()),
                &simd.matmul(&xt, &w).data,
                &scalar.matmul(&xt, &w).data,
                &abs_products(&scalar, &w, &x, tokens),
            );
        }
    }
}

#[test]
fn routed_experts_match_scalar() {
    let scalar = CpuBackend::scalar();
    let mut rng = rand::rng();
    let spec = |bits, group_size| QuantSpec { bits, group_size };
    for (specs, dtype) in [
        ([spec(4, 64); 3], Dtype::BF16),
        ([spec(8, 32), spec(4, 128), spec(8, 64)], Dtype::F16),
        ([spec(4, 32), spec(4, 64), spec(4, 128)], Dtype::F32),
    ] {
        let (hidden, inter, experts) = (384, 128, 6);
        let (layout, records) =
            crate::common::random_records(hidden, inter, specs, dtype, experts, |r, c, s| {
                random_matrix(r, c, s, dtype)
            });
        // Five tokens of three routes over six experts: most experts serve several tokens.
        for (simd, (t, k)) in simd_backends()
            .into_iter()
            .flat_map(|b| [(b, (1, 3)), (b, (5, 3)), (b, (9, 2)), (b, (1, 2))])
        {
            let mut ids: Vec<u32> = (0..t)
                .flat_map(|_| rand::seq::index::sample(&mut rng, experts, k).into_vec())
                .map(|e| e as u32)
                .collect();
            if (t, k) == (1, 2) {
                // A routing that names one expert twice for a token (a router never does,
                // but the backend takes any ids): each route still gets its own row.
                ids[1] = ids[0];
            }
            let routing = Routing {
                top_k: k,
                weights: (0..t * k).map(|_| rng.random_range(0.05f32..0.6)).collect(),
                ids,
            };
            let held: Vec<ExpertRecord<'_>> = routing
                .ids
                .iter()
                .map(|&e| ExpertRecord {
                    bytes: &records[e as usize],
                    slot: None,
                })
                .collect();
            let x = simd.upload(&random(t * hidden), t, hidden);
            let got = simd.moe_experts(&x, &routing, &held, &layout, None).data;
            let want = scalar.moe_experts(&x, &routing, &held, &layout, None).data;
            let e = crate::common::rel_err(&got, &want);
            assert!(
                e <= 1e-5,
                "{}: {specs:?} {dtype:?} T={t} k={k}: relative error {e:.2e}",
                simd.isa().unwrap()
            );
        }
    }
}

#[test]
fn gated_delta_matches_scalar() {
    use slotstream::backend::DeltaDims;
    let (simd, scalar) = (CpuBackend, CpuBackend::scalar());
    // Qwen3-Next's heads (Dk = Dv = 128, two value heads per key head), and widths that
    // are not a multiple of the 16 lanes.
    for (key_heads, value_heads, dk, dv) in [(2, 4, 128, 128), (1, 3, 20, 12)] {
        let dims = DeltaDims {
            key_heads,
            value_heads,
            key_dim: dk,
            value_dim: dv,
        };
        let width = 2 * key_heads * dk + value_heads * dv;
        let upload = |n: usize, rows: usize| simd.upload(&random(n * rows), rows, n);
        let (a_log, dt_bias) = (upload(value_heads, 1), upload(value_heads, 1));
        let init = random(value_heads * dv * dk);
        let mut states = [
            simd.upload(&init, value_heads, dv * dk),
            simd.upload(&init, value_heads, dv * dk),
        ];
        // A token at a time, as decode runs, then a chunk of five, as prefill does.
        for t in [1, 1, 1, 5] {
            let (qkv, ba) = (upload(width, t), upload(2 * value_heads, t));
            let [s_simd, s_scalar] = &mut states;
            let got = simd.gated_delta(&qkv, &ba, &a_log, &dt_bias, s_simd, dims);
            let want = scalar.gated_delta(&qkv, &ba, &a_log, &dt_bias, s_scalar, dims);
            let e = crate::common::rel_err(&s_simd.data, &s_scalar.data);
            assert!(e <= 1e-5, "Dk={dk} Dv={dv} T={t}: state error {e:.2e}");
            // y[i] = S[i] q with q normalized to 1 / sqrt(Dk): its rounding scales with
            // sum_j |S[i, j]| |q[j]| <= ||S[i]|| / sqrt(Dk).
            let last = (t - 1) * value_heads * dv..;
            let bound: Vec<f32> = s_scalar
                .data
                .chunks_exact(dk)
                .take(got.data[last.clone()].len())
                .map(|row| row.iter().map(|v| v * v).sum::<f32>().sqrt() / (dk as f32).sqrt())
                .collect();
            assert_elementwise(
                &format!("Dk={dk} Dv={dv} T={t}: y"),
                &got.data[last.clone()],
                &want.data[last],
                &bound,
                "||S[i]|| / sqrt(Dk)",
                1e-5,
            );
        }
    }
}
