//! Causal depthwise conv with state (`wgsl/conv.wgsl`).
use super::{GpuBackend, GpuTensor};

pub(super) fn causal_conv1d_silu(_b: &GpuBackend, _x: &GpuTensor, _w: &GpuTensor, _state: &mut GpuTensor) -> GpuTensor {
    todo!()
}
