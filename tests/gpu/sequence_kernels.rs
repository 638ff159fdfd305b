//! GPU kernels against the CPU backend: gated delta rule, RoPE, attention with a KV cache.
//!
//! Every test needs a GPU adapter and fails without one (lavapipe from Mesa's
//! mesa-vulkan-drivers works). Inputs are fresh random values at several shapes, including
//! sizes that are not multiples of the kernels' workgroup sizes; outputs and updated state
//! must match the CPU within 1e-5 norm-wise relative error (the gated delta's output
//! relative to the scale of its rounding error, see `delta_output_bound`), with no NaN
//! (new GPU output buffers are NaN-filled, so an element a kernel forgets to write fails).

use crate::common::compare::{assert_rel, assert_scaled};
use crate::common::{gpu, random};

use slotstream::backend::cpu::{CpuBackend, CpuTensor};
use slotstream::backend::gpu::{GpuBackend, GpuTensor};
use slotstream::backend::{rope_table, AttnDims, Backend, DeltaDims, KeyMask};

const TOL: f64 = 1e-5;

/// Both backends' copies of the same values.
struct Pair {
    cpu: CpuTensor,
    gpu: GpuTensor,
}

fn pair(g: &GpuBackend, data: &[f32], rows: usize, cols: usize) -> Pair {
    Pair {
        cpu: CpuBackend.upload(data, rows, cols),
        gpu: g.upload(data, rows, cols),
    }
}

/// The GPU tensor's values, after asserting its shape is the CPU one's: what the
/// comparisons of [`crate::common::compare`] take.
fn values(what: &str, g: &GpuBackend, got: &GpuTensor, want: &CpuTensor) -> Vec<f32> {
    assert_eq!(g.shape(got), (want.rows, want.cols), "{what}: shape");
    g.download(got).expect("download")
}

/// The scale of the rounding error of the gated delta's output `y[t, h, i] = S_t[h, i] .
/// q_t` (S_t the state after token t, q_t normalized as the kernels do): `sum_j |S_t[h, i,
/// j]| |q_t[j]|`, from the CPU backend run one token at a time from `state`. A `y` near zero
/// by cancellation (a q nearly orthogonal to a fresh state's rows, after a decay that wiped
/// the old state) has a much larger rounding error than its own size.
fn delta_output_bound(
    qkv: &CpuTensor,
    ba: &CpuTensor,
    a_log: &CpuTensor,
    dt_bias: &CpuTensor,
    state: &CpuTensor,
    dims: DeltaDims,
) -> Vec<f32> {
    let cpu = CpuBackend;
    let (hk, hv, dk, dv) = (
        dims.key_heads,
        dims.value_heads,
        dims.key_dim,
        dims.value_dim,
    );
    let (eps, q_scale, _) = dims.qk_norm();
    let mut s = state.clone();
    let mut bound = Vec::with_capacity(qkv.rows * hv * dv);
    for t in 0..qkv.rows {
        let row = cpu.rows(qkv, t, 1);
        cpu.gated_delta(&row, &cpu.rows(ba, t, 1), a_log, dt_bias, &mut s, dims);
        let q = cpu.rms_norm(
            &cpu.upload(&row.data[..hk * dk], 1, hk * dk),
            None,
            dk,
            eps,
            q_scale,
        );
        for h in 0..hv {
            let qh = &q.data[h / (hv / hk) * dk..][..dk];
            for i in 0..dv {
                let srow = &s.data[(h * dv + i) * dk..][..dk];
                bound.push(srow.iter().zip(qh).map(|(a, b)| (a * b).abs()).sum());
            }
        }
    }
    bound
}

struct DeltaCase {
    key_heads: usize,
    value_heads: usize,
    dk: usize,
    dv: usize,
    /// Half-width of the range of `a` (large values exercise both softplus branches).
    a_range: f32,
}

/// The conv output `[T, 2 Hk Dk + Hv Dv]` (q and k at random scales per row, which the
/// kernel normalizes away) and `[b | a]` `[T, 2 Hv]`.
fn delta_inputs(g: &GpuBackend, c: &DeltaCase, t: usize) -> [Pair; 2] {
    let (hk, hv, dk, dv) = (c.key_heads, c.value_heads, c.dk, c.dv);
    let width = 2 * hk * dk + hv * dv;
    let mut qkv = random(t * width, -1.0, 1.0);
    for (row, scale) in qkv.chunks_exact_mut(width).zip(random(t, 0.01, 30.0)) {
        row[..2 * hk * dk].iter_mut().for_each(|v| *v *= scale);
    }
    let mut ba = random(t * 2 * hv, -4.0, 4.0);
    for row in ba.chunks_exact_mut(2 * hv) {
        let a = random(hv, -c.a_range, c.a_range);
        row[hv..].copy_from_slice(&a);
    }
    [pair(g, &qkv, t, width), pair(g, &ba, t, 2 * hv)]
}

fn run_delta_case(g: &GpuBackend, c: &DeltaCase) {
    let (hv, dk, dv) = (c.value_heads, c.dk, c.dv);
    let dims = DeltaDims {
        key_heads: c.key_heads,
        value_heads: hv,
        key_dim: dk,
        value_dim: dv,
    };
    let a_log = pair(g, &random(hv, -2.0, 1.5), 1, hv);
    let dt_bias = pair(g, &random(hv, -1.0, 1.0), 1, hv);
    let init = random(hv * dv * dk, -0.5, 0.5);
    let mut cpu_state = CpuBackend.upload(&init, hv, dv * dk);
    let mut gpu_state = g.upload(&init, hv, dv * dk);
    // A single token, a prefill, and a further call continuing from the updated state.
    for (step, t) in [1usize, 37, 5, 1].into_iter().enumerate() {
        let [qkv, ba] = delta_inputs(g, c, t);
        let bound = delta_output_bound(
            &qkv.cpu,
            &ba.cpu,
            &a_log.cpu,
            &dt_bias.cpu,
            &cpu_state,
            dims,
        );
        let want = CpuBackend.gated_delta(
            &qkv.cpu,
            &ba.cpu,
            &a_log.cpu,
            &dt_bias.cpu,
            &mut cpu_state,
            dims,
        );
        let got = g.gated_delta(
            &qkv.gpu,
            &ba.gpu,
            &a_log.gpu,
            &dt_bias.gpu,
            &mut gpu_state,
            dims,
        );
        let what = format!(
            "gated_delta Hk={} Hv={hv} Dk={dk} Dv={dv} step {step} T={t}",
            c.key_heads
        );
        let (what_y, what_s) = (format!("{what}: y"), format!("{what}: state"));
        let ey = assert_scaled(
            &what_y,
            &values(&what_y, g, &got, &want),
            &want.data,
            &bound,
            "the rounding bound",
            TOL,
        );
        let es = assert_rel(
            &what_s,
            &values(&what_s, g, &gpu_state, &cpu_state),
            &cpu_state.data,
            TOL,
        );
        eprintln!("{what}: y error {ey:.2e}, state error {es:.2e}");
    }
}

#[test]
fn gated_delta_matches_cpu() {
    let gpus = crate::common::gpus();
    let cases = [
        DeltaCase {
            key_heads: 2,
            value_heads: 4,
            dk: 32,
            dv: 32,
            a_range: 3.0,
        },
        DeltaCase {
            key_heads: 1,
            value_heads: 3,
            dk: 48,
            dv: 48,
            a_range: 12.0,
        },
        DeltaCase {
            key_heads: 2,
            value_heads: 6,
            dk: 128,
            dv: 128,
            a_range: 6.0,
        },
        // Dk not a multiple of a lane's 16 columns, Dv not of a workgroup's rows.
        DeltaCase {
            key_heads: 1,
            value_heads: 2,
            dk: 20,
            dv: 50,
            a_range: 20.0,
        },
        // A row in one lane (no sums across lanes), and in 16 lanes.
        DeltaCase {
            key_heads: 1,
            value_heads: 2,
            dk: 16,
            dv: 40,
            a_range: 3.0,
        },
        DeltaCase {
            key_heads: 1,
            value_heads: 1,
            dk: 256,
            dv: 24,
            a_range: 3.0,
        },
        // Dk at the shader's maximum (32 lanes of 16 columns).
        DeltaCase {
            key_heads: 1,
            value_heads: 1,
            dk: 512,
            dv: 24,
            a_range: 3.0,
        },
    ];
    for c in &cases {
        // Both reduction paths: a row's sums by subgroup shuffles where its lanes share a
        // subgroup (on lavapipe's subgroups of 8, up to Dk 128), and through workgroup
        // memory (the portable backend, every Dk past one lane).
        for g in &gpus {
            run_delta_case(g, c);
        }
    }
}

#[test]
fn rope_matches_cpu() {
    let g = gpu();
    // (T, heads, head_dim, rotary_dim, theta, start)
    let cases: [(usize, usize, usize, usize, f64, usize); 5] = [
        (5, 4, 64, 64, 10_000.0, 0),
        (3, 2, 256, 64, 10_000_000.0, 8_000),
        (17, 3, 48, 32, 1_000_000.0, 123),
        (1, 16, 256, 64, 10_000_000.0, 8_191),
        (70, 5, 64, 64, 10_000.0, 2_000),
    ];
    for (t, heads, hd, rd, theta, start) in cases {
        let x = pair(&g, &random(t * heads * hd, -2.0, 2.0), t, heads * hd);
        let angles = rope_table(start, t, rd, theta);
        let want = CpuBackend.rope(&x.cpu, hd, rd, &angles);
        let got = g.rope(&x.gpu, hd, rd, &angles);
        let what =
            format!("rope T={t} heads={heads} hd={hd} rotary={rd} theta={theta} start={start}");
        let e = assert_rel(&what, &values(&what, &g, &got, &want), &want.data, TOL);
        eprintln!("{what}: error {e:.2e}");
    }
}

/// Runs the same sequence of attention calls (token counts `steps`) on both backends,
/// each with a fresh cache, comparing every call's output. With `masked`, each query also
/// keeps only a random subset of its past keys (and itself), as the QSA indexer's
/// selection does.
fn run_attention(
    g: &GpuBackend,
    q_heads: usize,
    kv_heads: usize,
    hd: usize,
    steps: &[usize],
    masked: bool,
) {
    let dims = AttnDims {
        q_heads,
        kv_heads,
        head_dim: hd,
        scale: (hd as f32).powf(-0.5),
    };
    let kv_dim = kv_heads * hd;
    let mut cpu_cache = CpuBackend.new_kv_cache(kv_dim);
    let mut gpu_cache = g.new_kv_cache(kv_dim);
    for (i, &t) in steps.iter().enumerate() {
        let q = pair(g, &random(t * q_heads * hd, -2.0, 2.0), t, q_heads * hd);
        let k = pair(g, &random(t * kv_dim, -2.0, 2.0), t, kv_dim);
        let v = pair(g, &random(t * kv_dim, -1.0, 1.0), t, kv_dim);
        let past = CpuBackend.kv_len(&cpu_cache);
        let mask = masked.then(|| {
            let mut m = KeyMask::new(t, past + t);
            let coin = random((past + t) * t, 0.0, 1.0);
            for row in 0..t {
                for key in 0..=past + row {
                    if key == past + row || coin[row * (past + t) + key] < 0.4 {
                        m.keep(row, key);
                    }
                }
            }
            m
        });
        let want =
            CpuBackend.attention(&q.cpu, &k.cpu, &v.cpu, &mut cpu_cache, dims, mask.as_ref());
        let got = g.attention(&q.gpu, &k.gpu, &v.gpu, &mut gpu_cache, dims, mask.as_ref());
        assert_eq!(
            g.kv_len(&gpu_cache),
            CpuBackend.kv_len(&cpu_cache),
            "kv_len after step {i}"
        );
        let what =
            format!("attention Hq={q_heads} Hkv={kv_heads} hd={hd} masked={masked} step {i}: T={t} past={past}");
        let e = assert_rel(&what, &values(&what, g, &got, &want), &want.data, TOL);
        eprintln!("{what}: error {e:.2e}");
    }
}

#[test]
fn attention_prefill_then_decode_matches_cpu() {
    let g = gpu();
    // (Hq, Hkv, head_dim): group sizes 1, 2 and 8; head dims 64 and 256.
    let configs = [
        (4, 4, 64),
        (4, 2, 64),
        (8, 1, 64),
        (16, 2, 256),
        (2, 1, 256),
        (3, 3, 40),
    ];
    for (hq, hkv, hd) in configs {
        // A prefill, single-token decodes (crossing the cache's 64-position growth), a
        // second multi-token call after them, and more decodes.
        run_attention(&g, hq, hkv, hd, &[37, 1, 1, 1, 1, 30, 1, 1], false);
    }
    // A decode from an empty cache.
    run_attention(&g, 4, 2, 64, &[1, 1, 1], false);
}

#[test]
fn attention_with_a_key_mask_matches_cpu() {
    let g = gpu();
    // Masks over more than 32 keys (several words per query), prefill and decode.
    run_attention(&g, 4, 2, 64, &[45, 1, 1, 33, 1], true);
    run_attention(&g, 24, 2, 256, &[70, 1, 1], true);
}

#[test]
fn attention_long_context_matches_cpu() {
    let g = gpu();
    // ~3000 cached positions: a long prefill (its scores take more than one scratch chunk
    // on the 128 MiB budget: 2600 x 8 heads x 2600 positions x 4 bytes), another long
    // call, then decodes.
    run_attention(&g, 8, 1, 64, &[2600, 1, 400, 1, 1], false);
}
