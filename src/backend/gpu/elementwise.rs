//! Elementwise kernels: add, SwiGLU, sigmoid gating, column gathers (`wgsl/elementwise.wgsl`).
//!
//! One invocation per output element, [`WG`] per workgroup, over a [`grid`] of workgroups.
use super::device::{grid, uniform_block, Access, Kernel};
use super::{GpuBackend, GpuTensor};

uniform_block! {
    /// `Params` of `wgsl/elementwise.wgsl`.
    pub(super) struct ElementwiseParams {
        n: u32,
        cols: u32,
        extra: u32,
    }
}

/// Invocations per workgroup (`@workgroup_size` in `wgsl/elementwise.wgsl`).
const WG: usize = 256;

const fn kernel(entry: &'static str) -> Kernel {
    Kernel::new(
        "elementwise.wgsl",
        entry,
        &[Access::Read, Access::Read, Access::ReadWrite],
    )
}

const ADD: Kernel = kernel("add");
const SWIGLU: Kernel = kernel("swiglu");
const MUL_SIGMOID: Kernel = kernel("mul_sigmoid");
const GATHER_COLUMNS: Kernel = kernel("gather_columns");

/// Dispatches `k` over the `rows * cols` elements of a new output: `[rows, cols]`, bound
/// after `inputs`.
fn run(
    b: &GpuBackend,
    k: &Kernel,
    inputs: [&GpuTensor; 2],
    rows: usize,
    cols: usize,
    cols_param: usize,
    extra: u32,
) -> GpuTensor {
    let n = rows * cols;
    let n32 = u32::try_from(n).expect("elementwise: tensor too large for u32 indexing");
    let out = b.empty(rows, cols);
    let [gx, gy] = grid(n.div_ceil(WG) as u32);
    let binds: [&wgpu::Buffer; 3] = [&inputs[0].buf, &inputs[1].buf, &out.buf];
    b.gpu.dispatch(
        k,
        &ElementwiseParams {
            n: n32,
            cols: cols_param as u32,
            extra,
        },
        &binds,
        [gx, gy, 1],
    );
    out
}

fn same_shape(op: &str, a: &GpuTensor, c: &GpuTensor) {
    assert_eq!(
        (a.rows, a.cols),
        (c.rows, c.cols),
        "{op}: elementwise shapes"
    );
}

/// `a + c`.
pub(super) fn add(b: &GpuBackend, a: &GpuTensor, c: &GpuTensor) -> GpuTensor {
    same_shape("add", a, c);
    run(b, &ADD, [a, c], a.rows, a.cols, a.cols, 0)
}

/// `silu(gate) * up`.
pub(super) fn swiglu(b: &GpuBackend, gate: &GpuTensor, up: &GpuTensor) -> GpuTensor {
    same_shape("swiglu", gate, up);
    run(b, &SWIGLU, [gate, up], gate.rows, gate.cols, gate.cols, 0)
}

/// `silu(gate) * up` for `x = [gate | up]` `[T, 2 C]`: `[T, C]`.
pub(super) fn swiglu_halves(b: &GpuBackend, x: &GpuTensor) -> GpuTensor {
    assert_eq!(x.cols % 2, 0, "swiglu: odd width {}", x.cols);
    let c = x.cols / 2;
    run(b, &SWIGLU, [x, x], x.rows, c, c, 1)
}

/// `x * sigmoid(gate)`, `gate` `[T, cols]` or `[T, 1]` (broadcast over the row).
pub(super) fn mul_sigmoid(b: &GpuBackend, x: &GpuTensor, gate: &GpuTensor) -> GpuTensor {
    let broadcast = if gate.cols == x.cols {
        assert_eq!(gate.rows, x.rows, "mul_sigmoid: elementwise shapes");
        0
    } else {
        assert_eq!(
            (gate.rows, gate.cols),
            (x.rows, 1),
            "gate must be [T, cols] or [T, 1]"
        );
        1
    };
    run(
        b,
        &MUL_SIGMOID,
        [x, gate],
        x.rows,
        x.cols,
        x.cols,
        broadcast,
    )
}

/// `out[:, j] = x[:, idx[j]]`; `idx` is a `[1, m]` list of u32 column indices, each
/// below `x.cols` (not checked on the device: the indices never come back to the host).
pub(super) fn gather_columns(b: &GpuBackend, x: &GpuTensor, idx: &GpuTensor) -> GpuTensor {
    let m = idx.rows * idx.cols;
    run(b, &GATHER_COLUMNS, [x, idx], x.rows, m, x.cols, m as u32)
}
