//! The gated delta rule recurrence (`wgsl/gated_delta.wgsl`).
use super::{GpuBackend, GpuTensor};
use crate::backend::DeltaDims;

#[allow(clippy::too_many_arguments)]
pub(super) fn gated_delta(
    _b: &GpuBackend, _q: &GpuTensor, _k: &GpuTensor, _v: &GpuTensor, _a: &GpuTensor, _bb: &GpuTensor,
    _a_log: &GpuTensor, _dt_bias: &GpuTensor, _state: &mut GpuTensor, _dims: DeltaDims,
) -> GpuTensor {
    todo!()
}
