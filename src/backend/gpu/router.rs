//! Router softmax and top-k (`wgsl/router.wgsl`).
//!
//! One workgroup per token computes the softmax and picks the `k` largest probabilities
//! on the device; ids and weights land in one small buffer that is read back in one go
//! (the layer's one read-back).
use super::device::{grid, uniform_block, Access, Kernel};
use super::{GpuBackend, GpuTensor};
use crate::backend::{Backend, Routing};
use crate::error::{Error, Result};

uniform_block! {
    /// `Params` of `wgsl/router.wgsl`.
    pub(super) struct RouterParams {
        tokens: u32,
        experts: u32,
        k: u32,
        /// 1: the k weights are scaled to sum 1.
        renormalize: u32,
    }
}

/// Largest `k` the shader holds picks for (`MAX_K` in `wgsl/router.wgsl`).
const MAX_K: usize = 64;

const ROUTER_TOP_K: Kernel = Kernel::new(
    "router.wgsl",
    "router_top_k",
    &[Access::Read, Access::ReadWrite],
);

/// Softmax over each row of `logits` `[T, E]`, the `k` largest probabilities (highest
/// first, ties to the lower id), renormalized to sum 1 if asked.
/// Errors: `k` beyond `E` or beyond [`MAX_K`]; a failed read-back.
pub(super) fn router_top_k(
    b: &GpuBackend,
    logits: &GpuTensor,
    k: usize,
    renormalize: bool,
) -> Result<Routing> {
    let out = router_top_k_device(b, logits, k, renormalize)?;
    Routing::from_device(&b.download(&out)?, k, logits.cols)
}

/// [`router_top_k`] left on the device: `[1, 2 * T * k]`, the ids then the weights (f32
/// bits). Errors: `k` beyond `E` or beyond [`MAX_K`].
pub(super) fn router_top_k_device(
    b: &GpuBackend,
    logits: &GpuTensor,
    k: usize,
    renormalize: bool,
) -> Result<GpuTensor> {
    let (tokens, experts) = (logits.rows, logits.cols);
    if k > experts || k > MAX_K {
        return Err(Error::InvalidInput(format!(
            "router: top-{k} of {experts} experts (at most {MAX_K} supported)"
        )));
    }
    let n = tokens * k;
    let out = b.empty(1, 2 * n);
    if n > 0 {
        let [gx, gy] = grid(u32::try_from(tokens).expect("router: too many tokens"));
        b.gpu.dispatch(
            &ROUTER_TOP_K,
            &RouterParams {
                tokens: tokens as u32,
                experts: experts as u32,
                k: k as u32,
                renormalize: renormalize as u32,
            },
            &[&logits.buf, &out.buf],
            [gx, gy, 1],
        );
    }
    Ok(out)
}
