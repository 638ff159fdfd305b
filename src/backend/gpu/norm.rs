//! RMSNorm kernels (`wgsl/norm.wgsl`).
//!
//! The tensor is a flat run of groups of `group` values (a row or a head). Each workgroup
//! of 256 invocations handles `256 / tpg` groups with `tpg` invocations each, `tpg` the
//! power of two that covers the group (at most 256), so small per-head groups do not
//! leave most of a workgroup idle.
use super::device::{grid, uniform_block, Access, Kernel};
use super::{GpuBackend, GpuTensor};
use crate::config::GateActivation;

/// Invocations per workgroup (`@workgroup_size` in `wgsl/norm.wgsl`).
const WG: usize = 256;

const RMS_NORM: Kernel = Kernel::new(
    "norm.wgsl",
    "rms_norm",
    &[Access::Read, Access::Read, Access::ReadWrite],
);

const RMS_NORM_GATED: Kernel = Kernel::new(
    "norm.wgsl",
    "rms_norm_gated",
    &[Access::Read, Access::Read, Access::ReadWrite, Access::Read],
);

const ADD_RMS_NORM: Kernel = Kernel::new(
    "norm.wgsl",
    "add_rms_norm",
    &[
        Access::Read,
        Access::Read,
        Access::ReadWrite,
        Access::Read,
        Access::ReadWrite,
    ],
);

uniform_block! {
    /// `Params` of `wgsl/norm.wgsl`: groups and their width, invocations per group and
    /// groups per workgroup, epsilon, output scale, whether there is a weight and its
    /// length, the gate's activation (0 silu, 1 sigmoid).
    pub(super) struct NormParams {
        groups: u32,
        group: u32,
        tpg: u32,
        gpw: u32,
        eps: f32,
        scale: f32,
        has_weight: u32,
        wlen: u32,
        act: u32,
    }
}

/// Uniform parameters and workgroup grid for `x` in groups of `group` values.
fn layout(
    x: &GpuTensor,
    weight: Option<&GpuTensor>,
    group: usize,
    eps: f32,
    scale: f32,
    act: GateActivation,
) -> (NormParams, [u32; 3]) {
    let n = x.rows * x.cols;
    assert!(
        group > 0 && n.is_multiple_of(group),
        "rms_norm: group {group} does not divide [{}, {}]",
        x.rows,
        x.cols
    );
    let wlen = weight.map_or(group, |w| w.rows * w.cols);
    assert!(
        wlen == group || wlen == x.cols,
        "rms_norm: weight of {wlen} is neither the group {group} nor the row {}",
        x.cols
    );
    let groups = n / group;
    let tpg = group.next_power_of_two().min(WG);
    let gpw = WG / tpg;
    let [gx, gy] = grid(u32::try_from(groups.div_ceil(gpw)).expect("rms_norm: too many groups"));
    let params = NormParams {
        groups: u32::try_from(groups).expect("rms_norm: too many groups"),
        group: u32::try_from(group).expect("rms_norm: group too large"),
        tpg: tpg as u32,
        gpw: gpw as u32,
        eps,
        scale,
        has_weight: weight.is_some() as u32,
        wlen: wlen as u32,
        act: match act {
            GateActivation::Silu => 0,
            GateActivation::Sigmoid => 1,
        },
    };
    (params, [gx, gy, 1])
}

/// `scale * w * x / sqrt(mean(x^2) + eps)` per group of `group` columns (`w = 1` if `None`;
/// `w` of the group's length, or of the row's for a weight per column).
pub(super) fn rms_norm(
    b: &GpuBackend,
    x: &GpuTensor,
    w: Option<&GpuTensor>,
    group: usize,
    eps: f32,
    scale: f32,
) -> GpuTensor {
    let (params, groups) = layout(x, w, group, eps, scale, GateActivation::Silu);
    let out = b.empty(x.rows, x.cols);
    // Without a weight the shader never reads binding 2; x stands in for it.
    let wbuf = w.map_or(&x.buf, |w| &w.buf);
    b.gpu
        .dispatch(&RMS_NORM, &params, &[&x.buf, wbuf, &out.buf], groups);
    out
}

/// `act(gate) * w * x / sqrt(mean(x^2) + eps)` per group of `group` columns.
pub(super) fn rms_norm_gated(
    b: &GpuBackend,
    x: &GpuTensor,
    gate: &GpuTensor,
    w: &GpuTensor,
    group: usize,
    eps: f32,
    act: GateActivation,
) -> GpuTensor {
    assert_eq!(
        (gate.rows, gate.cols),
        (x.rows, x.cols),
        "rms_norm_gated: gate shape"
    );
    let (params, groups) = layout(x, Some(w), group, eps, 1.0, act);
    let out = b.empty(x.rows, x.cols);
    b.gpu.dispatch(
        &RMS_NORM_GATED,
        &params,
        &[&x.buf, &w.buf, &out.buf, &gate.buf],
        groups,
    );
    out
}

/// `(x + y, w * (x + y) / sqrt(mean((x + y)^2) + eps))` over whole rows, in one dispatch.
pub(super) fn add_rms_norm(
    b: &GpuBackend,
    x: &GpuTensor,
    y: &GpuTensor,
    w: &GpuTensor,
    eps: f32,
) -> (GpuTensor, GpuTensor) {
    assert_eq!((y.rows, y.cols), (x.rows, x.cols), "add_rms_norm: shapes");
    let (params, groups) = layout(x, Some(w), x.cols, eps, 1.0, GateActivation::Silu);
    let (sum, out) = (b.empty(x.rows, x.cols), b.empty(x.rows, x.cols));
    b.gpu.dispatch(
        &ADD_RMS_NORM,
        &params,
        &[&x.buf, &w.buf, &out.buf, &y.buf, &sum.buf],
        groups,
    );
    (sum, out)
}
