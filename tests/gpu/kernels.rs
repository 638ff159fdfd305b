//! GPU kernels against the CPU backend: elementwise ops, RMSNorm, the causal conv and
//! the router's softmax + top-k. Requires a GPU adapter (lavapipe will do): without one
//! these tests fail rather than skip.

use std::sync::OnceLock;

use crate::common::compare::assert_rel;
use crate::common::random;

use rand::seq::SliceRandom;
use rand::Rng;
use slotstream::backend::cpu::CpuBackend;
use slotstream::backend::gpu::GpuBackend;
use slotstream::backend::Backend;
use slotstream::config::GateActivation;

const TOL: f64 = 1e-5;

fn gpu() -> &'static GpuBackend {
    &gpus()[0]
}

/// With subgroup operations where the adapter has them, and without: for the kernels
/// that reduce (norms, top-k).
fn gpus() -> &'static [GpuBackend; 2] {
    static GPUS: OnceLock<[GpuBackend; 2]> = OnceLock::new();
    GPUS.get_or_init(crate::common::gpus)
}

/// [`assert_rel`] at `TOL`, the bound of every comparison here.
fn check(what: &str, got: &[f32], want: &[f32]) {
    assert_rel(what, got, want, TOL);
}

const TS: &[usize] = &[1, 5, 64];
const COLS: &[usize] = &[1, 7, 127, 129, 2048, 4099];

#[test]
fn add_swiglu_mul_sigmoid_match_cpu() {
    let (cpu, gpu) = (CpuBackend, gpu());
    for &t in TS {
        for &cols in COLS {
            let n = t * cols;
            let (a, b) = (random(n, -6.0, 6.0), random(n, -6.0, 6.0));
            let (ca, cb) = (cpu.upload(&a, t, cols), cpu.upload(&b, t, cols));
            let (ga, gb) = (gpu.upload(&a, t, cols), gpu.upload(&b, t, cols));
            let what = |op: &str| format!("{op} [{t}, {cols}]");

            let want = cpu.add(&ca, &cb).data;
            check(
                &what("add"),
                &gpu.download(&gpu.add(&ga, &gb)).unwrap(),
                &want,
            );
            let want = cpu.swiglu(&ca, &cb).data;
            check(
                &what("swiglu"),
                &gpu.download(&gpu.swiglu(&ga, &gb)).unwrap(),
                &want,
            );
            let want = cpu.mul_sigmoid(&ca, &cb).data;
            check(
                &what("mul_sigmoid"),
                &gpu.download(&gpu.mul_sigmoid(&ga, &gb)).unwrap(),
                &want,
            );

            let g = random(t, -6.0, 6.0);
            let want = cpu.mul_sigmoid(&ca, &cpu.upload(&g, t, 1)).data;
            let got = gpu
                .download(&gpu.mul_sigmoid(&ga, &gpu.upload(&g, t, 1)))
                .unwrap();
            check(&what("mul_sigmoid broadcast"), &got, &want);
        }
    }
}

/// More than 65,535 workgroups: the 2-D grid.
#[test]
fn add_over_a_2d_grid() {
    let (cpu, gpu) = (CpuBackend, gpu());
    let n = 70_000 * 256 + 13;
    let (a, b) = (random(n, -1.0, 1.0), random(n, -1.0, 1.0));
    let want = cpu.add(&cpu.upload(&a, 1, n), &cpu.upload(&b, 1, n)).data;
    let got = gpu
        .download(&gpu.add(&gpu.upload(&a, 1, n), &gpu.upload(&b, 1, n)))
        .unwrap();
    check("add [1, 70000*256+13]", &got, &want);
}

#[test]
fn gather_columns_matches_cpu() {
    let (cpu, gpu) = (CpuBackend, gpu());
    let mut rng = rand::rng();
    for &t in TS {
        for &cols in COLS {
            for m in [1, 3, cols, cols + 5, 300] {
                let x = random(t * cols, -3.0, 3.0);
                let idx: Vec<u32> = (0..m).map(|_| rng.random_range(0..cols as u32)).collect();
                let want = cpu.gather_columns(&cpu.upload(&x, t, cols), &cpu.upload_index(&idx));
                let got = gpu.gather_columns(&gpu.upload(&x, t, cols), &gpu.upload_index(&idx));
                assert_eq!(gpu.shape(&got), (t, m));
                let got = gpu.download(&got).unwrap();
                assert_eq!(got, want.data, "gather_columns [{t}, {cols}] -> {m}");
            }
        }
    }
}

#[test]
fn rms_norm_matches_cpu() {
    let cpu = CpuBackend;
    for gpu in gpus() {
        // (cols, group): whole rows and per-head groups, sizes off the workgroup width.
        let shapes: &[(usize, usize)] = &[
            (1, 1),
            (7, 7),
            (127, 127),
            (129, 129),
            (2048, 2048),
            (4099, 4099),
            (2048, 32),
            (2048, 64),
            (2048, 128),
            (2048, 256),
            (4096, 512),
            (21, 7),
            (387, 129),
        ];
        for &t in TS {
            for &(cols, group) in shapes {
                let x = random(t * cols, -4.0, 4.0);
                let w = random(group, 0.5, 1.5);
                let (cx, gx) = (cpu.upload(&x, t, cols), gpu.upload(&x, t, cols));
                let (cw, gw) = (cpu.upload(&w, 1, group), gpu.upload(&w, 1, group));
                for (eps, scale) in [(1e-6f32, 1.0f32), (1e-5, 0.0625)] {
                    let what = format!("rms_norm [{t}, {cols}] group {group} eps {eps} scale {scale}, subgroup lanes {}", gpu.gpu.subgroup_lanes);
                    let want = cpu.rms_norm(&cx, Some(&cw), group, eps, scale).data;
                    let got = gpu
                        .download(&gpu.rms_norm(&gx, Some(&gw), group, eps, scale))
                        .unwrap();
                    check(&format!("{what} weighted"), &got, &want);
                    let want = cpu.rms_norm(&cx, None, group, eps, scale).data;
                    let got = gpu
                        .download(&gpu.rms_norm(&gx, None, group, eps, scale))
                        .unwrap();
                    check(&format!("{what} unweighted"), &got, &want);
                }
            }
        }
    }
}

/// The fused residual add and norm against the CPU backend's add, then rms_norm.
#[test]
fn add_rms_norm_matches_cpu() {
    let cpu = CpuBackend;
    for gpu in gpus() {
        for &t in TS {
            for cols in [1usize, 129, 2048, 4099] {
                let (h, y, w) = (
                    random(t * cols, -4.0, 4.0),
                    random(t * cols, -4.0, 4.0),
                    random(cols, 0.5, 1.5),
                );
                let (ch, cy, cw) = (
                    cpu.upload(&h, t, cols),
                    cpu.upload(&y, t, cols),
                    cpu.upload(&w, 1, cols),
                );
                let sum = cpu.add(&ch, &cy);
                let normed = cpu.rms_norm(&sum, Some(&cw), cols, 1e-6, 1.0);
                let (gsum, gnormed) = gpu.add_rms_norm(
                    &gpu.upload(&h, t, cols),
                    &gpu.upload(&y, t, cols),
                    &gpu.upload(&w, 1, cols),
                    1e-6,
                );
                let what = format!(
                    "add_rms_norm [{t}, {cols}], subgroup lanes {}",
                    gpu.gpu.subgroup_lanes
                );
                check(
                    &format!("{what} sum"),
                    &gpu.download(&gsum).unwrap(),
                    &sum.data,
                );
                check(
                    &format!("{what} norm"),
                    &gpu.download(&gnormed).unwrap(),
                    &normed.data,
                );
            }
        }
    }
}

/// More than 65,535 workgroups of norm groups.
#[test]
fn rms_norm_over_a_2d_grid() {
    let (cpu, gpu) = (CpuBackend, gpu());
    let (t, cols, group) = (66_000, 256, 256);
    let x = random(t * cols, -4.0, 4.0);
    let w = random(group, 0.5, 1.5);
    let want = cpu
        .rms_norm(
            &cpu.upload(&x, t, cols),
            Some(&cpu.upload(&w, 1, group)),
            group,
            1e-6,
            1.0,
        )
        .data;
    let got = gpu.rms_norm(
        &gpu.upload(&x, t, cols),
        Some(&gpu.upload(&w, 1, group)),
        group,
        1e-6,
        1.0,
    );
    check("rms_norm [66000, 256]", &gpu.download(&got).unwrap(), &want);
}

#[test]
fn rms_norm_gated_matches_cpu() {
    let (cpu, gpu) = (CpuBackend, gpu());
    let shapes: &[(usize, usize)] = &[
        (1, 1),
        (7, 7),
        (129, 129),
        (4099, 4099),
        (2048, 32),
        (2048, 128),
        (4096, 256),
        (387, 129),
    ];
    for &t in TS {
        for &(cols, group) in shapes {
            let (x, z) = (random(t * cols, -4.0, 4.0), random(t * cols, -6.0, 6.0));
            let w = random(group, 0.5, 1.5);
            let want = cpu
                .rms_norm_gated(
                    &cpu.upload(&x, t, cols),
                    &cpu.upload(&z, t, cols),
                    &cpu.upload(&w, 1, group),
                    group,
                    1e-6,
                    GateActivation::Silu,
                )
                .data;
            let got = gpu.rms_norm_gated(
                &gpu.upload(&x, t, cols),
                &gpu.upload(&z, t, cols),
                &gpu.upload(&w, 1, group),
                group,
                1e-6,
                GateActivation::Silu,
            );
            check(
                &format!("rms_norm_gated [{t}, {cols}] group {group}"),
                &gpu.download(&got).unwrap(),
                &want,
            );
        }
    }
}

#[test]
fn causal_conv1d_silu_matches_cpu_with_carried_state() {
    let (cpu, gpu) = (CpuBackend, gpu());
    for &c in &[1usize, 7, 129, 2051] {
        for &k in &[1usize, 2, 4] {
            // 150 tokens: three blocks of tokens, only the first reading the state.
            for &(t1, t2) in &[
                (1usize, 1usize),
                (5, 1),
                (64, 5),
                (1, 64),
                (150, 3),
                (2, 150),
            ] {
                let w = random(c * k, -1.0, 1.0);
                let s0 = random((k - 1) * c, -2.0, 2.0);
                let (cw, gw) = (cpu.upload(&w, c, k), gpu.upload(&w, c, k));
                let mut cs = cpu.upload(&s0, k - 1, c);
                let mut gs = gpu.upload(&s0, k - 1, c);
                for (step, t) in [t1, t2].into_iter().enumerate() {
                    let what = format!("conv C {c} K {k} step {step} T {t}");
                    let x = random(t * c, -2.0, 2.0);
                    let want = cpu
                        .causal_conv1d_silu(&cpu.upload(&x, t, c), &cw, &mut cs, 1)
                        .data;
                    let got = gpu.causal_conv1d_silu(&gpu.upload(&x, t, c), &gw, &mut gs, 1);
                    assert_eq!(gpu.shape(&got), (t, c), "{what}: output shape");
                    check(
                        &format!("{what} output"),
                        &gpu.download(&got).unwrap(),
                        &want,
                    );
                    assert_eq!(gpu.shape(&gs), (k - 1, c), "{what}: state shape");
                    if k > 1 {
                        // The state is a copy of inputs: exact.
                        assert_eq!(gpu.download(&gs).unwrap(), cs.data, "{what}: state");
                    }
                }
            }
        }
    }
}

/// Logits `[t, e]` of distinct values at least `gap` apart (no near-ties), each row
/// shifted by up to +-30 so the max subtraction matters.
fn distinct_logits(t: usize, e: usize, gap: f32) -> Vec<f32> {
    let mut rng = rand::rng();
    let mut out = Vec::with_capacity(t * e);
    for _ in 0..t {
        let mut levels: Vec<usize> = (0..e).collect();
        levels.shuffle(&mut rng);
        let shift = rng.random_range(-30.0f32..30.0);
        out.extend(levels.iter().map(|&l| shift + l as f32 * gap));
    }
    out
}

fn check_routing(
    what: &str,
    got: &slotstream::backend::Routing,
    want: &slotstream::backend::Routing,
) {
    assert_eq!(got.top_k, want.top_k, "{what}: top_k");
    assert_eq!(got.ids, want.ids, "{what}: ids");
    assert_eq!(got.weights.len(), want.weights.len(), "{what}: weights");
    for (i, (&g, &w)) in got.weights.iter().zip(&want.weights).enumerate() {
        assert!((g - w).abs() <= 1e-5, "{what}: weight {i}: {g} vs {w}");
    }
    check(&format!("{what} weights"), &got.weights, &want.weights);
}

#[test]
fn router_top_k_matches_cpu() {
    let cpu = CpuBackend;
    for gpu in gpus() {
        for &t in TS {
            for &(e, ks) in &[
                (1usize, &[1usize][..]),
                (7, &[1, 2, 7][..]),
                (64, &[4, 8][..]),
                (128, &[8, 10][..]),
                (512, &[1, 10, 16][..]),
                (513, &[16][..]),
                // Past the 1,024 probabilities the kernel keeps in shared memory.
                (1100, &[10][..]),
            ] {
                // Gaps of 0.01 keep probability ratios >= 1.01, far above rounding.
                let logits = distinct_logits(t, e, 0.01 + 4.0 / e as f32);
                let (cl, gl) = (cpu.upload(&logits, t, e), gpu.upload(&logits, t, e));
                for &k in ks {
                    for renormalize in [false, true] {
                        let what = format!(
                            "router [{t}, {e}] k {k} renormalize {renormalize}, subgroup lanes {}",
                            gpu.gpu.subgroup_lanes
                        );
                        let want = cpu.router_top_k(&cl, k, renormalize).unwrap();
                        let got = gpu.router_top_k(&gl, k, renormalize).unwrap();
                        check_routing(&what, &got, &want);
                    }
                }
            }
        }
    }
}

/// Exactly equal logits give exactly equal probabilities on both backends: the lower id
/// must come first.
#[test]
fn router_top_k_breaks_ties_by_lower_id() {
    let cpu = CpuBackend;
    for gpu in gpus() {
        let mut rng = rand::rng();
        let (t, e) = (16, 512);
        // Eight well-separated levels, each shared by many experts.
        let logits: Vec<f32> = (0..t * e)
            .map(|_| rng.random_range(0..8) as f32 * 0.25)
            .collect();
        let (cl, gl) = (cpu.upload(&logits, t, e), gpu.upload(&logits, t, e));
        for k in [1, 8, 16] {
            let want = cpu.router_top_k(&cl, k, true).unwrap();
            let got = gpu.router_top_k(&gl, k, true).unwrap();
            check_routing(
                &format!(
                    "router ties k {k}, subgroup lanes {}",
                    gpu.gpu.subgroup_lanes
                ),
                &got,
                &want,
            );
        }
    }
}

/// More than 65,535 tokens: one workgroup each over the 2-D grid.
#[test]
fn router_top_k_over_a_2d_grid() {
    let (cpu, gpu) = (CpuBackend, gpu());
    let (t, e, k) = (66_000, 8, 2);
    let logits = distinct_logits(t, e, 0.5);
    let want = cpu
        .router_top_k(&cpu.upload(&logits, t, e), k, true)
        .unwrap();
    let got = gpu
        .router_top_k(&gpu.upload(&logits, t, e), k, true)
        .unwrap();
    check_routing("router [66000, 8]", &got, &want);
}

#[test]
fn router_top_k_rejects_k_beyond_experts() {
    let gpu = gpu();
    let logits = gpu.upload(&[0.0; 8], 2, 4);
    assert!(gpu.router_top_k(&logits, 5, true).is_err());
}

/// Kernel outputs come from a pool of reused buffers: a buffer freed while the dispatches
/// that read it are still only recorded is handed to the next output at once (wgpu orders
/// the new writes after the old reads), so results stay exact, and a steady loop creates
/// no new buffers or bind groups.
#[test]
fn reused_output_buffers_keep_results_and_stop_allocating() {
    let cpu = CpuBackend;
    let gpu = crate::common::gpu(); // its own device, so other tests do not move its counters
    let (t, cols) = (3, 1000);
    let (a, b) = (random(t * cols, -2.0, 2.0), random(t * cols, -2.0, 2.0));
    let (ca, cb) = (cpu.upload(&a, t, cols), cpu.upload(&b, t, cols));
    let (ga, gb) = (gpu.upload(&a, t, cols), gpu.upload(&b, t, cols));
    let (mut cacc, mut gacc) = (cpu.zeros(t, cols), gpu.zeros(t, cols));
    let mut steady = None;
    for step in 0..40 {
        let cy = cpu.add(&ca, &cb);
        let cz = cpu.swiglu(&cy, &ca);
        cacc = cpu.add(&cacc, &cz);
        let gy = gpu.add(&ga, &gb);
        let gz = gpu.swiglu(&gy, &ga);
        // gy's buffer returns to the pool before swiglu has run; the next add reuses it.
        drop(gy);
        gacc = gpu.add(&gacc, &gz);
        if step == 10 {
            steady = Some(gpu.gpu.counters());
        }
        if step % 13 == 0 {
            check(
                &format!("step {step}"),
                &gpu.download(&gacc).unwrap(),
                &cacc.data,
            );
        }
    }
    check("after 40 steps", &gpu.download(&gacc).unwrap(), &cacc.data);
    let d = gpu.gpu.counters() - steady.unwrap();
    assert_eq!(d.dispatches, 29 * 3, "dispatches");
    // Only the read-backs' staging buffers are new (four downloads after step 10).
    assert_eq!(d.buffers_created, 4, "buffers created in the steady state");
    assert_eq!(
        d.bind_groups_created, 0,
        "bind groups created in the steady state"
    );
}

/// A cached bind group keeps the buffers it binds alive, so it leaves the cache when one
/// of them goes for good: an uploaded tensor that is dropped, and a KV cache's buffers when
/// they are replaced by larger ones or dropped with the cache. Kernel outputs go back to
/// the buffer pool instead, and their bind groups stay (the next step reuses both).
#[test]
fn bind_groups_do_not_keep_dropped_buffers_alive() {
    use slotstream::backend::AttnDims;
    let gpu = crate::common::gpu();
    let (t, cols) = (2, 300);
    let a = gpu.upload(&random(t * cols, -1.0, 1.0), t, cols);
    let b = gpu.upload(&random(t * cols, -1.0, 1.0), t, cols);
    let y = gpu.add(&a, &b);
    gpu.download(&y).unwrap();
    let (a_buf, y_buf): (wgpu::Buffer, wgpu::Buffer) = ((**a.buf).clone(), (**y.buf).clone());
    assert_eq!(
        gpu.gpu.cached_bind_groups_of(&a_buf),
        1,
        "the add's bind group"
    );
    drop(y);
    assert_eq!(
        gpu.gpu.cached_bind_groups_of(&y_buf),
        1,
        "a pooled output keeps its bind groups"
    );
    drop(a);
    assert_eq!(gpu.gpu.cached_bind_groups_of(&a_buf), 0, "a dropped upload");

    let dims = AttnDims {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 8,
        scale: 0.35,
    };
    let mut cache = gpu.new_kv_cache(16);
    let mut replaced = Vec::new();
    for step in 0..300 {
        let q = gpu.upload(&random(32, -1.0, 1.0), 1, 32);
        let k = gpu.upload(&random(16, -1.0, 1.0), 1, 16);
        let v = gpu.upload(&random(16, -1.0, 1.0), 1, 16);
        let before = cache.keys.as_ref().map(|b| (**b).clone());
        let out = gpu.attention(&q, &k, &v, &mut cache, dims, None);
        if step % 50 == 0 {
            gpu.download(&out).unwrap();
        }
        let now = cache.keys.as_ref().map(|b| (**b).clone()).unwrap();
        assert!(gpu.gpu.cached_bind_groups_of(&now) > 0, "step {step}");
        if let Some(old) = before.filter(|old| *old != now) {
            replaced.push(old);
        }
    }
    assert!(
        replaced.len() >= 2,
        "the cache grew {} times",
        replaced.len()
    );
    for old in &replaced {
        assert_eq!(
            gpu.gpu.cached_bind_groups_of(old),
            0,
            "a replaced KV buffer"
        );
    }
    let last = cache.keys.as_ref().map(|b| (**b).clone()).unwrap();
    drop(cache);
    assert_eq!(
        gpu.gpu.cached_bind_groups_of(&last),
        0,
        "a dropped KV cache"
    );
}
