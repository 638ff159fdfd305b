//! Elementwise kernels: add, SwiGLU, sigmoid gating, column gathers (`wgsl/elementwise.wgsl`).
use super::{GpuBackend, GpuTensor};

pub(super) fn add(_b: &GpuBackend, _a: &GpuTensor, _c: &GpuTensor) -> GpuTensor {
    todo!()
}
pub(super) fn swiglu(_b: &GpuBackend, _gate: &GpuTensor, _up: &GpuTensor) -> GpuTensor {
    todo!()
}
pub(super) fn mul_sigmoid(_b: &GpuBackend, _x: &GpuTensor, _gate: &GpuTensor) -> GpuTensor {
    todo!()
}
pub(super) fn gather_columns(_b: &GpuBackend, _x: &GpuTensor, _idx: &GpuTensor) -> GpuTensor {
    todo!()
}
