//! The gated delta rule recurrence (`wgsl/gated_delta.wgsl`).
//!
//! One dispatch per call: one workgroup per (value head, block of state rows), each row
//! split over a few lanes that hold its columns in registers across the whole token
//! loop. The kernel reads q, k and v straight from the conv output and b, a from the
//! `[b | a]` projection, normalizes q and k and computes the decay and write strength
//! itself, so nothing is gathered or normalized by separate dispatches.

use super::device::{grid, uniform_block, Access, Kernel};
use super::{GpuBackend, GpuTensor};
use crate::backend::DeltaDims;

uniform_block! {
    /// `Params` of `wgsl/gated_delta.wgsl` (padded as the WGSL struct is).
    pub(super) struct DeltaParams {
        t_len: u32,
        key_heads: u32,
        value_heads: u32,
        dk: u32,
        dv: u32,
        group: u32,
        row_blocks: u32,
        lanes: u32,
        eps: f32,
        q_scale: f32,
        k_scale: f32,
        _pad2: u32,
    }
}

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

/// Invocations per workgroup (`WG` in the shader).
const WG: usize = 256;
/// State row columns each lane holds (the shader's `Cols`: four vectors).
const COLS: usize = 16;
/// Largest key width the shader holds in registers (32 lanes of [`COLS`]).
const MAX_KEY_DIM: usize = 32 * COLS;

/// [`crate::backend::Backend::gated_delta`] on the GPU.
pub(super) fn gated_delta(
    b: &GpuBackend,
    qkv: &GpuTensor,
    ba: &GpuTensor,
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
    let t_len = qkv.rows;
    assert!(
        key_heads > 0 && value_heads % key_heads == 0,
        "value heads must be a multiple of key heads"
    );
    assert!(
        dk <= MAX_KEY_DIM,
        "gated_delta: key dim {dk} above the shader's {MAX_KEY_DIM}"
    );
    assert_eq!(
        qkv.cols,
        2 * key_heads * dk + value_heads * dv,
        "gated_delta qkv shape"
    );
    assert_eq!(
        (ba.rows, ba.cols),
        (t_len, 2 * value_heads),
        "gated_delta ba shape"
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
    // As few lanes a row as hold its columns: a row's sums then take the fewest shuffle
    // rounds, and a token's chain of dependent steps stays short.
    let lanes = dk.div_ceil(COLS).next_power_of_two();
    let row_blocks = dv.div_ceil(WG / lanes);
    let (eps, q_scale, k_scale) = dims.qk_norm();
    let params = DeltaParams {
        t_len: t_len as u32,
        key_heads: key_heads as u32,
        value_heads: value_heads as u32,
        dk: dk as u32,
        dv: dv as u32,
        group: (value_heads / key_heads) as u32,
        row_blocks: row_blocks as u32,
        lanes: lanes as u32,
        eps,
        q_scale,
        k_scale,
        ..Default::default()
    };
    let [gx, gy] = grid((value_heads * row_blocks) as u32);
    b.gpu.dispatch(
        &RECURRENCE,
        &params,
        &[
            &qkv.buf,
            &ba.buf,
            &a_log.buf,
            &dt_bias.buf,
            &state.buf,
            &out.buf,
        ],
        [gx, gy, 1],
    );
    out
}
