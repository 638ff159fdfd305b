//! Causal depthwise conv with state (`wgsl/conv.wgsl`).
//!
//! One dispatch writes the output and shifts the state in place (the last `(K-1)*d` rows
//! of `[state; x]`), one invocation per channel, so the state keeps its buffer (and the
//! bind groups that bind it) from step to step.
use super::device::{grid, uniform_block, Access, Kernel};
use super::{GpuBackend, GpuTensor};

uniform_block! {
    /// `Params` of `wgsl/conv.wgsl`: tokens, channels, kernel width, dilation and
    /// tokens per invocation.
    pub(super) struct ConvParams {
        t: u32,
        c: u32,
        k: u32,
        d: u32,
        block: u32,
    }
}

/// Invocations per workgroup (`@workgroup_size` in `wgsl/conv.wgsl`).
const WG: usize = 256;
/// Tokens each invocation convolves in a long input: a prompt's chunk runs as blocks of
/// channels x tokens, not one sequential loop over its tokens per channel.
const TOKEN_BLOCK: usize = 64;

const CONV: Kernel = Kernel::new(
    "conv.wgsl",
    "causal_conv1d_silu",
    &[
        Access::Read,
        Access::Read,
        Access::ReadWrite,
        Access::ReadWrite,
    ],
);

/// `out[t,c] = silu(sum_j w[c,j] * in[t+j*d,c])` over `in = [state; x]`; `w` `[C, K]`,
/// dilation `d`, `state` `[(K-1)*d, C]` replaced by the last `(K-1)*d` rows of `in`.
pub(super) fn causal_conv1d_silu(
    b: &GpuBackend,
    x: &GpuTensor,
    w: &GpuTensor,
    state: &mut GpuTensor,
    dilation: usize,
) -> GpuTensor {
    let (c, k) = (w.rows, w.cols);
    assert!(
        k >= 1 && dilation >= 1,
        "conv: kernel width and dilation must be at least 1"
    );
    let keep = (k - 1) * dilation;
    assert_eq!(
        (state.rows, state.cols, x.cols),
        (keep, c, c),
        "conv shapes"
    );
    let t = x.rows;
    let out = b.empty(t, c);
    if t == 0 {
        return out;
    }
    u32::try_from(t.max(keep) * c).expect("conv: tensor too large for u32 indexing");
    let [gx, gy] = grid(c.div_ceil(WG) as u32);
    // Only the first block may read the state (see wgsl/conv.wgsl): later blocks start at
    // least `keep` tokens in.
    let block = TOKEN_BLOCK.max(keep);
    b.gpu.dispatch(
        &CONV,
        &ConvParams {
            t: t as u32,
            c: c as u32,
            k: k as u32,
            d: dilation as u32,
            block: block as u32,
        },
        &[&x.buf, &w.buf, &state.buf, &out.buf],
        [gx, gy, t.div_ceil(block) as u32],
    );
    out
}
