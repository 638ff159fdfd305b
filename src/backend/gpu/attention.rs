//! RoPE and attention over the KV cache (`wgsl/attention.wgsl`).
use super::{GpuBackend, GpuKvCache, GpuTensor};
use crate::backend::AttnDims;

pub(super) fn rope(_b: &GpuBackend, _x: &GpuTensor, _head_dim: usize, _rotary_dim: usize, _theta: f64, _start: usize) -> GpuTensor {
    todo!()
}
pub(super) fn attention(_b: &GpuBackend, _q: &GpuTensor, _k: &GpuTensor, _v: &GpuTensor, _cache: &mut GpuKvCache, _dims: AttnDims) -> GpuTensor {
    todo!()
}
