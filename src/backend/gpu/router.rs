//! Router softmax and top-k (`wgsl/router.wgsl`).
use super::{GpuBackend, GpuTensor};
use crate::backend::Routing;
use crate::error::Result;

pub(super) fn router_top_k(_b: &GpuBackend, _logits: &GpuTensor, _k: usize, _renormalize: bool) -> Result<Routing> {
    todo!()
}
