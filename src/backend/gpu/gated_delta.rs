//! The gated delta rule recurrence (`wgsl/gated_delta.wgsl`).
//!
//! Two dispatches: `delta_gates` computes `(g, beta)` per token and value head, then
//! `gated_delta` runs the recurrence with one workgroup per (value head, block of 8 state
//! rows), the state rows held in registers across the whole token loop.

use super::device::{grid, Access, Kernel};
use super::{GpuBackend, GpuTensor};
use crate::backend::DeltaDims;

const GATES: Kernel = Kernel::new(
    "gated_delta.wgsl",
    "delta_gates",
    &[
        Access::Read,
        Access::Read,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
    ],
);

const RECURRENCE: Kernel = Kernel::new(
    "gated_delta.wgsl",
    "gated_delta",
    &[
        Access::Read,
        Access::Read,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
        Access::ReadWrite,
    ],
);

/// State rows per workgroup (`ROWS` in the shader).
const ROWS: usize = 8;
/// Largest key width the shader holds in registers (`LANES * MAXE`).
const MAX_KEY_DIM: usize = 256;

#[allow(clippy::too_many_arguments)]
pub(super) fn gated_delta(
    b: &GpuBackend,
    q: &GpuTensor,
    k: &GpuTensor,
    v: &GpuTensor,
    a: &GpuTensor,
    bb: &GpuTensor,
    a_log: &GpuTensor,
    dt_bias: &GpuTensor,
    state: &mut GpuTensor,
    dims: DeltaDims,
) -> GpuTensor {
    let DeltaDims {
        key_heads,
        value_heads,
        key_dim: dk,
        value_dim: dv,
    } = dims;
    let t_len = q.rows;
    assert!(
        key_heads > 0 && value_heads % key_heads == 0,
        "value heads must be a multiple of key heads"
    );
    assert!(
        dk <= MAX_KEY_DIM,
        "gated_delta: key dim {dk} above the shader's {MAX_KEY_DIM}"
    );
    assert_eq!(
        (q.cols, k.cols, k.rows),
        (key_heads * dk, key_heads * dk, t_len),
        "gated_delta q/k shape"
    );
    assert_eq!(
        (v.rows, v.cols),
        (t_len, value_heads * dv),
        "gated_delta v shape"
    );
    assert_eq!(
        (a.rows, a.cols, bb.rows, bb.cols),
        (t_len, value_heads, t_len, value_heads),
        "gated_delta a/b shape"
    );
    assert_eq!(
        (state.rows, state.cols),
        (value_heads, dv * dk),
        "gated_delta state shape"
    );

    let out = b.empty(t_len, value_heads * dv);
    if t_len == 0 {
        return out;
    }
    let row_blocks = dv.div_ceil(ROWS);
    let params = [
        t_len as u32,
        key_heads as u32,
        value_heads as u32,
        dk as u32,
        dv as u32,
        (value_heads / key_heads) as u32,
        row_blocks as u32,
        0,
    ];
    let gates = b.gpu.scratch((t_len * value_heads * 2 * 4) as u64);
    let [gx, gy] = grid((t_len * value_heads).div_ceil(256) as u32);
    b.gpu.dispatch(
        &GATES,
        &params,
        &[&a.buf, &bb.buf, &a_log.buf, &dt_bias.buf, &gates],
        [gx, gy, 1],
    );
    let [gx, gy] = grid((value_heads * row_blocks) as u32);
    b.gpu.dispatch(
        &RECURRENCE,
        &params,
        &[&q.buf, &k.buf, &v.buf, &gates, &state.buf, &out.buf],
        [gx, gy, 1],
    );
    out
}
