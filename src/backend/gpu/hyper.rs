//! Flash-Next's hyper-connection and PLE kernels (`wgsl/hyper.wgsl`).
//!
//! The residual state is `S` streams of width `H` side by side, `[T, S*H]`
//! (transformers `Qwen4ExpTextGatedResidual`, `Qwen4ExpTextPLELayer`).
use super::device::{grid, uniform_block, Access, Kernel};
use super::{GpuBackend, GpuTensor};

uniform_block! {
    /// `Params` of `wgsl/hyper.wgsl` (what each field means is per entry there).
    pub(super) struct HyperParams {
        n: u32,
        h: u32,
        s: u32,
        scale: f32,
    }
}

/// Invocations per workgroup (`@workgroup_size` in `wgsl/hyper.wgsl`).
const WG: usize = 256;

const fn kernel(entry: &'static str) -> Kernel {
    Kernel::new(
        "hyper.wgsl",
        entry,
        &[Access::Read, Access::Read, Access::Read, Access::ReadWrite],
    )
}

const SILU_SCALED: Kernel = kernel("silu_scaled");
const HYPER_MIX: Kernel = kernel("hyper_mix");
const HYPER_INJECT: Kernel = kernel("hyper_inject");
const PLE_GATE: Kernel = kernel("ple_gate");

/// Dispatches `k` into a new `[rows, cols]` output over `workgroups` workgroups.
fn run(
    b: &GpuBackend,
    k: &Kernel,
    inputs: [&GpuTensor; 3],
    (rows, cols): (usize, usize),
    params: HyperParams,
    workgroups: usize,
) -> GpuTensor {
    let out = b.empty(rows, cols);
    let [gx, gy] = grid(u32::try_from(workgroups).expect("hyper: too many workgroups"));
    b.gpu.dispatch(
        k,
        &params,
        &[&inputs[0].buf, &inputs[1].buf, &inputs[2].buf, &out.buf],
        [gx, gy, 1],
    );
    out
}

fn elements(n: usize) -> u32 {
    u32::try_from(n).expect("hyper: tensor too large for u32 indexing")
}

/// `silu(scale * x)`.
pub(super) fn silu(b: &GpuBackend, x: &GpuTensor, scale: f32) -> GpuTensor {
    let n = x.rows * x.cols;
    run(
        b,
        &SILU_SCALED,
        [x, x, x],
        (x.rows, x.cols),
        HyperParams {
            n: elements(n),
            h: 0,
            s: 0,
            scale,
        },
        n.div_ceil(WG),
    )
}

/// `mean_s sigmoid(mix) * n` over `streams` streams: `[T, S*H]` -> `[T, H]`.
pub(super) fn hyper_mix(
    b: &GpuBackend,
    n: &GpuTensor,
    mix: &GpuTensor,
    streams: usize,
) -> GpuTensor {
    assert_eq!((n.rows, n.cols), (mix.rows, mix.cols), "hyper_mix shapes");
    assert!(
        streams > 0 && n.cols.is_multiple_of(streams),
        "hyper_mix: {} columns in {streams} streams",
        n.cols
    );
    let h = n.cols / streams;
    let count = n.rows * h;
    run(
        b,
        &HYPER_MIX,
        [n, mix, n],
        (n.rows, h),
        HyperParams {
            n: elements(count),
            h: h as u32,
            s: streams as u32,
            scale: 0.0,
        },
        count.div_ceil(WG),
    )
}

/// `h + y * 2 sigmoid(inject / S)` per stream.
pub(super) fn hyper_inject(
    b: &GpuBackend,
    h: &GpuTensor,
    y: &GpuTensor,
    inject: &GpuTensor,
) -> GpuTensor {
    let streams = inject.cols;
    assert_eq!(
        (h.rows, h.cols),
        (y.rows, y.cols * streams),
        "hyper_inject shapes"
    );
    assert_eq!(inject.rows, h.rows, "hyper_inject: inject rows");
    let count = h.rows * h.cols;
    let params = HyperParams {
        n: elements(count),
        h: y.cols as u32,
        s: streams as u32,
        scale: 0.0,
    };
    run(
        b,
        &HYPER_INJECT,
        [h, y, inject],
        (h.rows, h.cols),
        params,
        count.div_ceil(WG),
    )
}

/// The PLE gate: `sigmoid(signed_sqrt(key . query / sqrt(H))) * value` per stream.
pub(super) fn ple_gate(
    b: &GpuBackend,
    key: &GpuTensor,
    query: &GpuTensor,
    value: &GpuTensor,
) -> GpuTensor {
    let width = value.cols;
    assert_eq!(
        (key.rows, key.cols),
        (query.rows, query.cols),
        "ple_gate shapes"
    );
    assert!(
        width > 0 && key.cols.is_multiple_of(width) && key.rows == value.rows,
        "ple_gate: value shape"
    );
    let streams = key.cols / width;
    let pairs = key.rows * streams;
    let params = HyperParams {
        n: elements(pairs),
        h: width as u32,
        s: streams as u32,
        scale: 0.0,
    };
    run(
        b,
        &PLE_GATE,
        [key, query, value],
        (key.rows, key.cols),
        params,
        pairs,
    )
}
