//! Quantized matmul, embedding rows and the routed-expert gather-matmul (`wgsl/quant.wgsl`).
use super::{GpuBackend, GpuTensor, GpuWeight};
use crate::backend::Routing;
use crate::checkpoint::{LinearWeight, RecordLayout};
use crate::error::Result;
use crate::experts::ExpertRecord;

pub(super) fn upload_weight(_b: &GpuBackend, _w: LinearWeight) -> Result<GpuWeight> {
    todo!()
}
pub(super) fn embed(_b: &GpuBackend, _t: &GpuWeight, _ids: &[u32]) -> Result<GpuTensor> {
    todo!()
}
pub(super) fn matmul(_b: &GpuBackend, _x: &GpuTensor, _w: &GpuWeight) -> GpuTensor {
    todo!()
}
pub(super) fn moe_experts(_b: &GpuBackend, _x: &GpuTensor, _r: &Routing, _records: &[ExpertRecord<'_>], _l: &RecordLayout) -> GpuTensor {
    todo!()
}
