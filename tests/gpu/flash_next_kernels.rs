//! GPU kernels of Qwen3.8-Flash-Next against the CPU backend: hyper-connection mixing and
//! injection, the PLE gate, scaled SiLU, RMSNorm with a weight per column, the sigmoid
//! gated RMSNorm and the dilated causal conv.
//!
//! Every test needs a GPU adapter and fails without one (lavapipe from Mesa's
//! mesa-vulkan-drivers works). Inputs are fresh random values at several shapes, including
//! widths that are not multiples of the workgroup size; outputs must match the CPU within
//! 1e-5 norm-wise relative error with no NaN (new GPU buffers are NaN-filled).

use crate::common::compare::assert_rel;
use crate::common::{gpu, random};

use slotstream::backend::cpu::CpuBackend;
use slotstream::backend::gpu::{GpuBackend, GpuTensor};
use slotstream::backend::Backend;
use slotstream::config::GateActivation;

const TOL: f64 = 1e-5;

/// Downloads `got` and compares it with [`assert_rel`] at `TOL`, printing the error.
fn check(what: &str, g: &GpuBackend, got: &GpuTensor, want: &[f32]) {
    let e = assert_rel(what, &g.download(got).expect("download"), want, TOL);
    eprintln!("{what}: error {e:.2e}");
}

/// (tokens, streams, stream width): the released 4 x 2560, small odd widths, a prefill.
const SHAPES: [(usize, usize, usize); 4] = [(1, 4, 2560), (3, 4, 100), (37, 2, 33), (70, 4, 128)];

#[test]
fn hyper_connection_mix_and_inject_match_cpu() {
    let g = gpu();
    for (t, s, h) in SHAPES {
        let n = random(t * s * h, -2.0, 2.0);
        let mix = random(t * s * h, -4.0, 4.0);
        let want = CpuBackend.hyper_mix(
            &CpuBackend.upload(&n, t, s * h),
            &CpuBackend.upload(&mix, t, s * h),
            s,
        );
        let got = g.hyper_mix(&g.upload(&n, t, s * h), &g.upload(&mix, t, s * h), s);
        check(
            &format!("hyper_mix T={t} S={s} H={h}"),
            &g,
            &got,
            &want.data,
        );

        let y = random(t * h, -1.0, 1.0);
        let inject = random(t * s, -8.0, 8.0);
        let want = CpuBackend.hyper_inject(
            &CpuBackend.upload(&n, t, s * h),
            &CpuBackend.upload(&y, t, h),
            &CpuBackend.upload(&inject, t, s),
        );
        let got = g.hyper_inject(
            &g.upload(&n, t, s * h),
            &g.upload(&y, t, h),
            &g.upload(&inject, t, s),
        );
        check(
            &format!("hyper_inject T={t} S={s} H={h}"),
            &g,
            &got,
            &want.data,
        );
    }
}

#[test]
fn ple_gate_and_scaled_silu_match_cpu() {
    let g = gpu();
    for (t, s, h) in SHAPES {
        let key = random(t * s * h, -1.0, 1.0);
        let query = random(t * s * h, -1.0, 1.0);
        let value = random(t * h, -2.0, 2.0);
        let want = CpuBackend.ple_gate(
            &CpuBackend.upload(&key, t, s * h),
            &CpuBackend.upload(&query, t, s * h),
            &CpuBackend.upload(&value, t, h),
        );
        let got = g.ple_gate(
            &g.upload(&key, t, s * h),
            &g.upload(&query, t, s * h),
            &g.upload(&value, t, h),
        );
        check(&format!("ple_gate T={t} S={s} H={h}"), &g, &got, &want.data);

        let scale = 1.0 / s as f32;
        let want = CpuBackend.silu(&CpuBackend.upload(&key, t, s * h), scale);
        let got = g.silu(&g.upload(&key, t, s * h), scale);
        check(
            &format!("silu x/{s} [{t}, {}]", s * h),
            &g,
            &got,
            &want.data,
        );
    }
}

#[test]
fn rms_norm_with_a_weight_per_column_and_sigmoid_gate_match_cpu() {
    let g = gpu();
    for (t, s, h) in SHAPES {
        let x = random(t * s * h, -3.0, 3.0);
        let w = random(s * h, 0.5, 1.5);
        let want = CpuBackend.rms_norm(
            &CpuBackend.upload(&x, t, s * h),
            Some(&CpuBackend.upload(&w, 1, s * h)),
            h,
            1e-6,
            1.0,
        );
        let got = g.rms_norm(
            &g.upload(&x, t, s * h),
            Some(&g.upload(&w, 1, s * h)),
            h,
            1e-6,
            1.0,
        );
        check(
            &format!("rms_norm groups of {h}, weight per column [{t}, {}]", s * h),
            &g,
            &got,
            &want.data,
        );

        let z = random(t * s * h, -4.0, 4.0);
        let wg = random(h, 0.5, 1.5);
        for act in [GateActivation::Sigmoid, GateActivation::Silu] {
            let want = CpuBackend.rms_norm_gated(
                &CpuBackend.upload(&x, t, s * h),
                &CpuBackend.upload(&z, t, s * h),
                &CpuBackend.upload(&wg, 1, h),
                h,
                1e-6,
                act,
            );
            let got = g.rms_norm_gated(
                &g.upload(&x, t, s * h),
                &g.upload(&z, t, s * h),
                &g.upload(&wg, 1, h),
                h,
                1e-6,
                act,
            );
            check(
                &format!("rms_norm_gated {act:?} [{t}, {}]", s * h),
                &g,
                &got,
                &want.data,
            );
        }
    }
}

#[test]
fn dilated_causal_conv_with_state_matches_cpu() {
    let g = gpu();
    // (channels, kernel, dilation) and a sequence of calls (prefill, decodes, a second
    // prefill, a long one in three blocks of tokens).
    // Dilation 30 keeps 90 rows of state: blocks of tokens longer than the usual 64.
    for (c, k, d) in [(320, 4, 3), (100, 4, 1), (33, 3, 2), (40, 4, 30)] {
        let w = random(c * k, -0.5, 0.5);
        let (cw, gw) = (CpuBackend.upload(&w, c, k), g.upload(&w, c, k));
        let keep = (k - 1) * d;
        let mut cs = CpuBackend.zeros(keep, c);
        let mut gs = g.zeros(keep, c);
        for (i, t) in [5usize, 1, 1, 12, 1, 140].into_iter().enumerate() {
            let x = random(t * c, -2.0, 2.0);
            let want = CpuBackend.causal_conv1d_silu(&CpuBackend.upload(&x, t, c), &cw, &mut cs, d);
            let got = g.causal_conv1d_silu(&g.upload(&x, t, c), &gw, &mut gs, d);
            let what = format!("conv C={c} K={k} dilation {d} step {i} T={t}");
            check(&what, &g, &got, &want.data);
            check(&format!("{what} state"), &g, &gs, &cs.data);
        }
    }
}
