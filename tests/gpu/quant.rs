//! Quantized matmul, embedding and routed-expert kernels on the GPU against the CPU
//! backend, on fresh random inputs. Fails (never skips) without a GPU adapter.

use rand::Rng;
use safetensors::Dtype;
use slotstream::backend::cpu::CpuBackend;
use slotstream::backend::gpu::GpuBackend;

use slotstream::backend::{Backend, ResidualAdd, Routing, Shared, SharedExpert};
use slotstream::checkpoint::{DenseMatrix, LinearWeight, QuantizedMatrix};
use slotstream::config::QuantSpec;
use slotstream::records::{ExpertRecord, ExpertSource, SlotTag};

use crate::common::compare::{abs_products, assert_rel, assert_scaled};

fn encode(dtype: Dtype, v: f32) -> Vec<u8> {
    match dtype {
        Dtype::F32 => v.to_le_bytes().to_vec(),
        Dtype::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
        _ => half::bf16::from_f32(v).to_le_bytes().to_vec(),
    }
}

fn random_quantized(rows: usize, cols: usize, spec: QuantSpec, dtype: Dtype) -> LinearWeight {
    let mut rng = rand::rng();
    let words = rows * cols / spec.per_word();
    let groups = rows * cols / spec.group_size;
    let scales: Vec<u8> = (0..groups)
        .flat_map(|_| encode(dtype, rng.random_range(0.001..0.05)))
        .collect();
    let biases: Vec<u8> = (0..groups)
        .flat_map(|_| encode(dtype, rng.random_range(-0.2..0.2)))
        .collect();
    LinearWeight::Quantized(QuantizedMatrix {
        spec,
        rows,
        cols,
        packed: (0..words).map(|_| rng.random()).collect(),
        scale_dtype: dtype,
        scales,
        biases,
    })
}

fn random(n: usize) -> Vec<f32> {
    let mut rng = rand::rng();
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// An uploaded shared expert `(y, gate)` as the experts take it.
fn shared_ref<T>(s: &Option<(T, T)>) -> Option<SharedExpert<'_, T>> {
    s.as_ref().map(|(y, gate)| SharedExpert { y, gate })
}

#[test]
fn quantized_matmul_matches_cpu() {
    let cpu = CpuBackend;
    for (g, (bits, group, dtype)) in crate::common::gpus().iter().flat_map(|g| {
        [
            (4, 64, Dtype::BF16),
            (4, 32, Dtype::F16),
            (4, 128, Dtype::F32),
            (8, 64, Dtype::BF16),
            (8, 32, Dtype::F32),
        ]
        .map(|case| (g, case))
    }) {
        let spec = QuantSpec {
            bits,
            group_size: group,
        };
        // Lanes per row follow the dispatch's size (16 to 256): the few-row, wide shapes
        // take 128 and 256 (a workgroup of one or two rows); 3,072 columns end in a partial
        // chunk of the staged input row. A large matrix (4,099 x 1,024
        // at 2 tokens) takes four rows per lane group, the last group partial. From 16
        // tokens the product
        // runs in tiles where the adapter has them: partial tiles of tokens (tiles of 64:
        // 17, 33 and 70 tokens, the last two filling a tile's second half in part) and of
        // rows (tiles of 128).
        for (rows, cols, t) in [
            (1, 128, 1),
            (7, 256, 3),
            (129, 512, 1),
            (1027, 2048, 2),
            (64, 384, 17),
            (1, 8192, 1),
            (3, 4096, 1),
            (3, 3072, 1),
            (200, 512, 70),
            (130, 2048, 33),
            (5, 128, 16),
            (4099, 1024, 2),
        ] {
            let w = random_quantized(rows, cols, spec, dtype);
            let x = random(t * cols);
            let want = cpu
                .download(&cpu.matmul(&cpu.upload(&x, t, cols), &w))
                .unwrap();
            let scale = abs_products(&cpu, &w, &x, t);
            let gw = g.upload_weight(w).unwrap();
            let got = g.download(&g.matmul(&g.upload(&x, t, cols), &gw)).unwrap();
            let name = format!(
                "{bits}-bit g{group} {dtype:?} {rows}x{cols} T={t}, subgroup lanes {}",
                g.gpu.subgroup_lanes
            );
            assert_scaled(&name, &got, &want, &scale, "|W||x|", 1e-5);
        }
    }
}

/// A stacked weight's output in parts, against the CPU's matmul of the whole weight split
/// by columns: the one-dispatch path (2 to 4 parts, quantized) and the fallbacks (5 parts,
/// a dense weight), at decode and prefill widths.
#[test]
fn matmul_parts_match_cpu_columns() {
    let cpu = CpuBackend;
    let mut rng = rand::rng();
    let spec = QuantSpec {
        bits: 4,
        group_size: 64,
    };
    for (g, parts) in crate::common::gpus()
        .iter()
        .flat_map(|g| (2..=5).map(move |parts| (g, parts)))
    {
        // The last case is large enough (rows x tokens x 16-byte vectors of a row) for the
        // matvec's four rows per lane group.
        for (t, cols, least) in [(1, 512, 1), (7, 512, 1), (40, 512, 1), (9, 4096, 128)] {
            let widths: Vec<usize> = (0..parts).map(|_| rng.random_range(least..300)).collect();
            let rows = widths.iter().sum();
            for w in [
                random_quantized(rows, cols, spec, Dtype::BF16),
                LinearWeight::Dense(DenseMatrix {
                    rows,
                    cols,
                    data: random(rows * cols),
                }),
            ] {
                let x = random(t * cols);
                let cx = cpu.upload(&x, t, cols);
                let whole = cpu.download(&cpu.matmul(&cx, &w)).unwrap();
                let scale = abs_products(&cpu, &w, &x, t);
                let want = cpu.matmul_parts(&cx, &w, &widths);
                let quantized = matches!(w, LinearWeight::Quantized(_));
                let gw = g.upload_weight(w).unwrap();
                let gx = g.upload(&x, t, cols);
                let before = g.gpu.counters().dispatches;
                let got = g.matmul_parts(&gx, &gw, &widths);
                if quantized && parts <= 4 {
                    assert_eq!(g.gpu.counters().dispatches - before, 1, "one dispatch");
                }
                assert_eq!(got.len(), parts);
                let mut first = 0;
                for (i, (got, want)) in got.iter().zip(&want).enumerate() {
                    let n = widths[i];
                    let name = format!(
                        "part {i} of {widths:?}, T={t}, subgroup lanes {}",
                        g.gpu.subgroup_lanes
                    );
                    let cols_of = |v: &[f32]| -> Vec<f32> {
                        (0..t)
                            .flat_map(|r| v[r * rows + first..r * rows + first + n].to_vec())
                            .collect()
                    };
                    // The CPU's parts are the whole matmul's columns, exactly.
                    assert_eq!(want.data, cols_of(&whole), "{name}: CPU");
                    let got = g.download(got).unwrap();
                    assert_scaled(&name, &got, &want.data, &cols_of(&scale), "|W||x|", 1e-5);
                    first += n;
                }
            }
        }
    }
}

#[test]
fn dense_matmul_and_embedding_match_cpu() {
    let g = crate::common::gpu();
    let cpu = CpuBackend;
    let (rows, cols) = (300, 100);
    let dense = LinearWeight::Dense(DenseMatrix {
        rows,
        cols,
        data: random(rows * cols),
    });
    let x = random(5 * cols);
    let want = cpu
        .download(&cpu.matmul(&cpu.upload(&x, 5, cols), &dense))
        .unwrap();
    let got = g
        .download(&g.matmul(
            &g.upload(&x, 5, cols),
            &g.upload_weight(dense.clone()).unwrap(),
        ))
        .unwrap();
    assert_rel("dense", &got, &want, 1e-5);
    // Many tokens: in tiles where the adapter has them.
    let t = 37;
    let x = random(t * cols);
    let scale = abs_products(&cpu, &dense, &x, t);
    let want = cpu
        .download(&cpu.matmul(&cpu.upload(&x, t, cols), &dense))
        .unwrap();
    let got = g
        .download(&g.matmul(
            &g.upload(&x, t, cols),
            &g.upload_weight(dense.clone()).unwrap(),
        ))
        .unwrap();
    assert_scaled("dense T=37", &got, &want, &scale, "|W||x|", 1e-5);
    // Two wide rows: 256 lanes per row. Two outputs can both cancel to near zero, so the
    // error is measured against |W||x|.
    let wdata = random(2 * 1024);
    let xw = random(1024);
    let scale: Vec<f32> = wdata
        .chunks(1024)
        .map(|row| row.iter().zip(&xw).map(|(w, x)| (w * x).abs()).sum())
        .collect();
    let wide = LinearWeight::Dense(DenseMatrix {
        rows: 2,
        cols: 1024,
        data: wdata,
    });
    let want_wide = cpu
        .download(&cpu.matmul(&cpu.upload(&xw, 1, 1024), &wide))
        .unwrap();
    let got_wide = g
        .download(&g.matmul(&g.upload(&xw, 1, 1024), &g.upload_weight(wide).unwrap()))
        .unwrap();
    assert_scaled(
        "dense 2x1024",
        &got_wide,
        &want_wide,
        &scale,
        "|W||x|",
        1e-5,
    );
    let ids = [0u32, 299, 17, 17, 150];
    let want = cpu.download(&cpu.embed(&dense, &ids).unwrap()).unwrap();
    let got = g
        .download(&g.embed(&g.upload_weight(dense).unwrap(), &ids).unwrap())
        .unwrap();
    assert_rel("dense embed", &got, &want, 0.0);
    for (bits, dtype) in [(4, Dtype::BF16), (8, Dtype::F16)] {
        let q = random_quantized(
            1000,
            256,
            QuantSpec {
                bits,
                group_size: 64,
            },
            dtype,
        );
        let ids = [3u32, 999, 0, 512];
        let want = cpu.download(&cpu.embed(&q, &ids).unwrap()).unwrap();
        let got = g
            .download(&g.embed(&g.upload_weight(q).unwrap(), &ids).unwrap())
            .unwrap();
        assert_rel(&format!("{bits}-bit embed"), &got, &want, 1e-6);
    }
    let err = g.embed(
        &g.upload_weight(random_quantized(
            10,
            64,
            QuantSpec {
                bits: 4,
                group_size: 64,
            },
            Dtype::BF16,
        ))
        .unwrap(),
        &[10],
    );
    assert!(err.unwrap_err().to_string().contains("out of range"));
}

#[test]
fn routed_experts_match_cpu() {
    // Real records from both fixtures (bf16 g64 and f32 g32), random routing.
    let g = crate::common::gpu();
    // And with the tile size forced either way, whatever the routes per record.
    let forced = [16, 64].map(|routes| (routes, crate::common::gpu_with_route_tile(routes)));
    let cpu = CpuBackend;
    let mut rng = rand::rng();
    for name in crate::common::FIXTURES {
        let l = crate::common::load_cpu(name);
        let layout = &l.model.experts.layout;
        let (e, k) = (
            l.model.config.num_experts as u32,
            l.model.config.num_experts_per_tok,
        );
        // From 16 tokens the routes run in tiles of each expert's routes: narrow tiles of
        // 16 where an expert gets 24 routes or fewer on average (about 10 at 40 tokens,
        // top-4 of 16, a partial tile; about 20 at 80, a full one and a partial one), else
        // tiles of 64 (about 50 at 200 tokens: the second half of a tile in part).
        for t in [1usize, 6, 40, 80, 200] {
            let mut ids = Vec::new();
            let mut weights = Vec::new();
            for _ in 0..t {
                let mut pick: Vec<u32> = (0..e).collect();
                for i in 0..k {
                    let j = rng.random_range(i..pick.len());
                    pick.swap(i, j);
                }
                ids.extend_from_slice(&pick[..k]);
                weights.extend((0..k).map(|_| rng.random_range(0.0f32..1.0)));
            }
            let routing = Routing {
                top_k: k,
                ids,
                weights,
            };
            let distinct = routing.distinct();
            let held = l.experts.fetch(1, &distinct).unwrap();
            let records: Vec<ExpertRecord<'_>> = routing
                .ids
                .iter()
                .map(|id| ExpertRecord {
                    bytes: &held[distinct.binary_search(id).unwrap()],
                    slot: None,
                })
                .collect();
            let d = layout.hidden;
            let x = random(t * d);
            // The experts on both backends, with the shared expert (y, gate) if given.
            let run = |g: &GpuBackend, shared: Option<(&[f32], &[f32])>| {
                let cpu_shared = shared.map(|(y, g)| (cpu.upload(y, t, d), cpu.upload(g, t, 1)));
                let gpu_shared = shared.map(|(y, gt)| (g.upload(y, t, d), g.upload(gt, t, 1)));
                let want = cpu
                    .download(&cpu.moe_experts(
                        &cpu.upload(&x, t, d),
                        &routing,
                        &records,
                        layout,
                        shared_ref(&cpu_shared),
                    ))
                    .unwrap();
                let got = g
                    .download(&g.moe_experts(
                        &g.upload(&x, t, d),
                        &routing,
                        &records,
                        layout,
                        shared_ref(&gpu_shared),
                    ))
                    .unwrap();
                (want, got)
            };
            let (want, got) = run(&g, None);
            assert_rel(&format!("{name} experts T={t}"), &got, &want, 1e-5);
            if t >= 16 {
                for (routes, forced) in &forced {
                    let (_, got) = run(forced, None);
                    let what = format!("{name} experts T={t}, tiles of {routes} routes");
                    assert_rel(&what, &got, &want, 1e-5);
                }
            }

            // With the shared expert added in the combine: on the CPU, exactly the routed
            // sum plus sigmoid(gate) * y; on the GPU, that within tolerance.
            let (y, gate) = (random(t * d), random(t));
            let (with, got) = run(&g, Some((&y, &gate)));
            let direct: Vec<f32> = want
                .iter()
                .enumerate()
                .map(|(i, &r)| r + y[i] * (1.0 / (1.0 + (-gate[i / d]).exp())))
                .collect();
            assert_eq!(with, direct, "{name} T={t}: CPU shared expert");
            assert_rel(&format!("{name} experts + shared T={t}"), &got, &with, 1e-5);
        }
    }
}

/// With every record of a layer at hand and the routing on the device, a shared expert
/// given by its weights is computed as one more route per token by the routed experts'
/// dispatches: a step of a few tokens takes three (gate and up, down, the combine) where
/// it took five, and matches the CPU backend (which computes the shared expert apart). The
/// combine also adds the block's output to the residual and norms the sum for the next
/// block when asked, in the same three dispatches.
#[test]
fn the_shared_expert_rides_in_the_routed_experts_dispatches() {
    let cpu = CpuBackend;
    let mut rng = rand::rng();
    for name in crate::common::FIXTURES {
        let g = crate::common::gpu();
        let l = crate::common::load_cpu(name);
        let layout = &l.model.experts.layout;
        let (e, k) = (
            l.model.config.num_experts,
            l.model.config.num_experts_per_tok,
        );
        let all: Vec<u32> = (0..e as u32).collect();
        let held = l.experts.fetch(1, &all).unwrap();
        // Slot tags make the backend mirror the records, as a pool of every record does.
        let stride = layout.record_bytes.next_multiple_of(4096);
        let layer: Vec<ExpertRecord<'_>> = held
            .iter()
            .enumerate()
            .map(|(slot, r)| ExpertRecord {
                bytes: r,
                slot: Some(SlotTag {
                    pool: 1,
                    slot,
                    generation: 1,
                    slots: e,
                    stride,
                    layer_records: e,
                }),
            })
            .collect();
        let (d, inter) = (layout.hidden, layout.intermediate);
        let gate_up = random_quantized(2 * inter, d, layout.specs[0], layout.scale_dtype);
        let down = random_quantized(d, inter, layout.specs[2], layout.scale_dtype);
        let cpu_weights = (
            cpu.upload_weight(gate_up.clone()).unwrap(),
            cpu.upload_weight(down.clone()).unwrap(),
        );
        let gpu_weights = (
            g.upload_weight(gate_up).unwrap(),
            g.upload_weight(down).unwrap(),
        );
        for t in [1usize, 1, 3, 7] {
            let mut ids = Vec::new();
            for _ in 0..t {
                let mut pick = all.clone();
                for i in 0..k {
                    let j = rng.random_range(i..pick.len());
                    pick.swap(i, j);
                }
                ids.extend_from_slice(&pick[..k]);
            }
            let routing = Routing {
                top_k: k,
                weights: (0..t * k).map(|_| rng.random_range(0.0f32..1.0)).collect(),
                ids,
            }
            .to_device();
            let (x, gate) = (random(t * d), random(t));
            let (h, norm) = (random(t * d), random(d));
            // Without a residual, with one, and with the residual and the next norm.
            for mode in 0..3 {
                let want = {
                    let gate = cpu.upload(&gate, t, 1);
                    let shared = Shared::Mlp {
                        gate_up: &cpu_weights.0,
                        down: &cpu_weights.1,
                        gate: &gate,
                    };
                    let routing = cpu.upload(&routing, 1, routing.len());
                    let x = cpu.upload(&x, t, d);
                    let (h, norm) = (cpu.upload(&h, t, d), cpu.upload(&norm, 1, d));
                    let then = residual_add(mode, &h, &norm);
                    let (out, normed) = cpu
                        .moe_experts_resident(
                            &x,
                            &routing,
                            k,
                            None,
                            &layer,
                            layout,
                            Some(shared),
                            then,
                        )
                        .unwrap();
                    assert_eq!(normed.is_some(), mode == 2, "{name}: CPU norm");
                    (
                        cpu.download(&out).unwrap(),
                        normed.map(|n| cpu.download(&n).unwrap()),
                    )
                };
                let (gx, groute, ggate) = (
                    g.upload(&x, t, d),
                    g.upload(&routing, 1, routing.len()),
                    g.upload(&gate, t, 1),
                );
                let (gh, gnorm) = (g.upload(&h, t, d), g.upload(&norm, 1, d));
                let shared = Shared::Mlp {
                    gate_up: &gpu_weights.0,
                    down: &gpu_weights.1,
                    gate: &ggate,
                };
                let before = g.gpu.counters();
                let then = residual_add(mode, &gh, &gnorm);
                let (out, normed) = g
                    .moe_experts_resident(&gx, &groute, k, None, &layer, layout, Some(shared), then)
                    .unwrap();
                let dispatches = (g.gpu.counters() - before).dispatches;
                assert_eq!(dispatches, 3, "{name} T={t} mode {mode}: dispatches");
                let what = format!("{name} resident experts + shared T={t} mode {mode}");
                assert_rel(&what, &g.download(&out).unwrap(), &want.0, 1e-5);
                assert_eq!(normed.is_some(), mode == 2, "{what}: norm");
                if let (Some(got), Some(want)) = (&normed, &want.1) {
                    assert_rel(
                        &format!("{what}: norm"),
                        &g.download(got).unwrap(),
                        want,
                        1e-5,
                    );
                }
                if mode == 0 {
                    continue;
                }
                // The residual and norm folded into the combine give what the backend's own
                // add (or add_rms_norm) gives after a combine without them, bit for bit.
                let (alone, _) = g
                    .moe_experts_resident(&gx, &groute, k, None, &layer, layout, Some(shared), None)
                    .unwrap();
                let (sum, apart) = residual_add(mode, &gh, &gnorm).unwrap().apply(&g, &alone);
                assert_eq!(
                    g.download(&out).unwrap(),
                    g.download(&sum).unwrap(),
                    "{what}: sum against the add apart"
                );
                if let (Some(got), Some(apart)) = (&normed, &apart) {
                    assert_eq!(
                        g.download(got).unwrap(),
                        g.download(apart).unwrap(),
                        "{what}: norm against add_rms_norm"
                    );
                }
            }
        }
    }
}

/// What [`Backend::moe_experts_resident`] adds its output to in the test above: nothing
/// (mode 0), the residual `h` (1), or `h` and the next block's norm (2).
fn residual_add<'a, T>(mode: usize, h: &'a T, norm: &'a T) -> Option<ResidualAdd<'a, T>> {
    (mode > 0).then_some(ResidualAdd {
        h,
        norm: (mode == 2).then_some((norm, 1e-6)),
    })
}

/// The fused gate/up SwiGLU of a stacked `[Wg; Wu]` against the CPU backend's SwiGLU of
/// the two matmuls apart: alike-quantized halves (the fused kernels, vec4 and scalar) and a
/// dense stack (here a mixed pair that `stack_rows` dequantizes; an unquantized
/// checkpoint's MLP stacks the same way): a matmul, then SwiGLU over the halves. On the CPU
/// the stacked weight gives the unstacked result bit for bit.
#[test]
fn matmul_swiglu_matches_cpu() {
    let cpu = CpuBackend;
    for (g, (bits, group, dtype)) in crate::common::gpus().iter().flat_map(|g| {
        [
            (4, 64, Dtype::BF16),
            (8, 32, Dtype::F32),
            (4, 32, Dtype::F16),
        ]
        .map(|case| (g, case))
    }) {
        let spec = QuantSpec {
            bits,
            group_size: group,
        };
        let other = QuantSpec {
            bits: 12 - bits,
            group_size: 64,
        };
        // 1,030 x 2,048 at 4 tokens: four rows per lane group at 4 and 8 bits. 3,072
        // columns: the matvec's staged input row in a whole and a partial chunk.
        for (inter, cols, t) in [
            (96, 256, 1),
            (300, 512, 5),
            (8, 4096, 1),
            (8, 3072, 1),
            (77, 256, 45),
            (1030, 2048, 4),
        ] {
            let gate = random_quantized(inter, cols, spec, dtype);
            for (what, up) in [
                ("alike", random_quantized(inter, cols, spec, dtype)),
                ("dense", random_quantized(inter, cols, other, Dtype::BF16)),
            ] {
                let x = random(t * cols);
                let cx = cpu.upload(&x, t, cols);
                let apart = cpu.swiglu(&cpu.matmul(&cx, &gate), &cpu.matmul(&cx, &up));
                let up_copy = up.clone();
                let w = LinearWeight::stack_rows("gate_up", vec![gate.clone(), up]).unwrap();
                let want = cpu.download(&cpu.matmul_swiglu(&cx, &w)).unwrap();
                if what == "alike" {
                    assert_eq!(want, apart.data, "stacked and apart differ on the CPU");
                }
                // The rounding of the two dot products, |W||x| each, carried through
                // silu(g) u to first order: |silu'(g) u| |Wg||x| + |silu(g)| |Wu||x|.
                // (Relative to ||silu(g) u|| it would measure cancellation: CI saw 6e-5 on
                // 8 outputs of 4,096-term sums.)
                let (ag, au) = (
                    abs_products(&cpu, &gate, &x, t),
                    abs_products(&cpu, &up_copy, &x, t),
                );
                let gv = cpu.download(&cpu.matmul(&cx, &gate)).unwrap();
                let uv = cpu.download(&cpu.matmul(&cx, &up_copy)).unwrap();
                let bound: Vec<f32> = (0..gv.len())
                    .map(|i| {
                        let s = 1.0 / (1.0 + (-gv[i]).exp());
                        let dsilu = s * (1.0 + gv[i] * (1.0 - s));
                        (dsilu * uv[i]).abs() * ag[i] + (gv[i] * s).abs() * au[i]
                    })
                    .collect();
                let gw = g.upload_weight(w).unwrap();
                let got = g
                    .download(&g.matmul_swiglu(&g.upload(&x, t, cols), &gw))
                    .unwrap();
                let name = format!(
                    "{what} {bits}-bit g{group} {dtype:?} {inter}x{cols} T={t}, subgroup lanes {}",
                    g.gpu.subgroup_lanes
                );
                assert_scaled(&name, &got, &want, &bound, "the rounding bound", 1e-5);
            }
        }
    }
}

/// Routed experts whose gate and up projections differ in bits and group size (a
/// mixed-precision conversion), so the fused kernels' second spec is exercised, against
/// the CPU backend.
#[test]
fn routed_experts_with_mixed_gate_up_specs_match_cpu() {
    let g = crate::common::gpu();
    let cpu = CpuBackend;
    let mut rng = rand::rng();
    // Large enough that 8 tokens (16 routes) take the matvec's four rows per lane group
    // (rows x routes x 16-byte vectors of a row from 2^18) for every projection.
    let (hidden, inter) = (1024usize, 640usize);
    for (gate, up, down, dtype) in [
        ((4, 64), (8, 64), (4, 64), Dtype::BF16),
        ((4, 64), (4, 32), (4, 64), Dtype::BF16),
        ((8, 64), (4, 64), (4, 64), Dtype::BF16),
        ((8, 32), (4, 128), (8, 64), Dtype::F16),
        ((4, 32), (4, 128), (4, 64), Dtype::F32),
    ] {
        let specs = [gate, up, down].map(|(bits, group_size)| QuantSpec { bits, group_size });
        let (layout, records) =
            crate::common::random_records(hidden, inter, specs, dtype, 3, |r, c, s| {
                let LinearWeight::Quantized(q) = random_quantized(r, c, s, dtype) else {
                    unreachable!("random_quantized is quantized")
                };
                q
            });
        // From 16 tokens the tiled path, which falls back for gate and up quantized apart.
        for t in [1usize, 3, 8, 20] {
            let k = 2;
            let ids: Vec<u32> = (0..t * k).map(|_| rng.random_range(0..3)).collect();
            let routing = Routing {
                top_k: k,
                weights: (0..t * k).map(|_| rng.random_range(0.1f32..1.0)).collect(),
                ids,
            };
            let held: Vec<ExpertRecord<'_>> = routing
                .ids
                .iter()
                .map(|&id| ExpertRecord {
                    bytes: &records[id as usize],
                    slot: None,
                })
                .collect();
            let x = random(t * hidden);
            let want = cpu
                .download(&cpu.moe_experts(
                    &cpu.upload(&x, t, hidden),
                    &routing,
                    &held,
                    &layout,
                    None,
                ))
                .unwrap();
            let got = g
                .download(&g.moe_experts(&g.upload(&x, t, hidden), &routing, &held, &layout, None))
                .unwrap();
            assert_rel(
                &format!("gate {gate:?} up {up:?} down {down:?} {dtype:?} T={t}"),
                &got,
                &want,
                1e-5,
            );
        }
    }
}

/// A weight past the adapter's storage binding limit (a real model's embedding or lm_head
/// on lavapipe) is split into row ranges of one binding each, and its matmul, fused
/// SwiGLU and embedding rows still match the CPU backend; a single row past the limit is
/// refused. The limit is lowered to 64 KiB here so that small weights split.
#[test]
fn weights_past_the_binding_limit_are_split_into_row_ranges() {
    let mut g = crate::common::gpu();
    let limit = 64 << 10;
    g.gpu.limits.max_storage_buffer_binding_size = limit;
    let cpu = CpuBackend;
    let spec = |bits, group_size| QuantSpec { bits, group_size };
    let weights = [
        (
            "4-bit",
            random_quantized(1000, 256, spec(4, 64), Dtype::BF16),
        ),
        ("8-bit", random_quantized(600, 128, spec(8, 32), Dtype::F32)),
        (
            "dense",
            LinearWeight::Dense(DenseMatrix {
                rows: 300,
                cols: 96,
                data: random(300 * 96),
            }),
        ),
    ];
    for (what, w) in weights {
        let (rows, cols) = w.shape();
        let gw = g.upload_weight(w.clone()).unwrap();
        let slotstream::backend::gpu::GpuWeight::Rows(parts) = &gw else {
            panic!("{what}: a {rows}x{cols} weight past {limit} bytes is not split");
        };
        assert!(parts.len() >= 2, "{what}: {} parts", parts.len());
        for t in [1usize, 3, 24] {
            let x = random(t * cols);
            let want = cpu
                .download(&cpu.matmul(&cpu.upload(&x, t, cols), &w))
                .unwrap();
            let got = g.download(&g.matmul(&g.upload(&x, t, cols), &gw)).unwrap();
            let scale = abs_products(&cpu, &w, &x, t);
            assert_scaled(
                &format!("{what} matmul T={t}"),
                &got,
                &want,
                &scale,
                "|W||x|",
                1e-5,
            );
            // The stacked-SwiGLU path over the same rows: a matmul, then SwiGLU over halves.
            let want = cpu
                .download(&cpu.matmul_swiglu(&cpu.upload(&x, t, cols), &w))
                .unwrap();
            let got = g
                .download(&g.matmul_swiglu(&g.upload(&x, t, cols), &gw))
                .unwrap();
            assert_rel(&format!("{what} matmul_swiglu T={t}"), &got, &want, 1e-5);
        }
        // Ids in every part, repeated, first and last rows included.
        let ids = [
            0u32,
            rows as u32 - 1,
            1,
            rows as u32 / 2,
            0,
            rows as u32 - 2,
        ];
        let want = cpu.download(&cpu.embed(&w, &ids).unwrap()).unwrap();
        let got = g.download(&g.embed(&gw, &ids).unwrap()).unwrap();
        assert_rel(&format!("{what} embed"), &got, &want, 1e-6);
    }
    let wide = LinearWeight::Dense(DenseMatrix {
        rows: 2,
        cols: 20_000,
        data: vec![0.0; 40_000],
    });
    let err = g.upload_weight(wide).unwrap_err().to_string();
    assert!(
        err.contains("one row") && err.contains("storage binding limit"),
        "{err}"
    );
}
