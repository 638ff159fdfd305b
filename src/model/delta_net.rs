//! The gated DeltaNet (linear attention) block (mlx-lm `qwen3_next.py`
//! `Qwen3NextGatedDeltaNet`, `gated_delta.py`; ../shared/spec/models.md §2.4).

use super::load::Loader;
use super::projections::Projections;
use crate::backend::{Backend, DeltaDims};
use crate::checkpoint::LinearWeight;
use crate::config::{DeltaNetProjections, ModelConfig};
use crate::error::Result;

/// A gated DeltaNet layer. Its input projections are regrouped at load: Qwen3-Next's
/// `in_proj_qkvz` and `in_proj_ba` interleave q, k, v, z (and b, a) per key-head group, and
/// Qwen3.5 / Flash-Next have separate `in_proj_b` and `in_proj_a`; here every family has
/// the same three, stacked where they can be, and a step gathers no columns.
pub(super) struct DeltaNet<B: Backend> {
    /// `[2 Hk Dk + Hv Dv, hidden]`: the conv input `[q_all | k_all | v_all]`;
    /// `[Hv Dv, hidden]`: the output gate's input; `[2 Hv, hidden]`: `[b_all | a_all]`.
    in_proj: Projections<B, 3>,
    /// `[conv_dim, kernel]`.
    conv: B::Tensor,
    a_log: B::Tensor,
    dt_bias: B::Tensor,
    norm: B::Tensor,
    out_proj: B::Weight,
}

impl<B: Backend> DeltaNet<B> {
    /// Loads the layer under `p` (`model.layers.{i}`), regrouping Qwen3-Next's fused
    /// projections by `fused_rows`.
    pub(super) fn load(l: &Loader<'_, B>, p: &str, fused_rows: &FusedRows) -> Result<Self> {
        let (cfg, ckpt) = (l.cfg, l.ckpt);
        let d = cfg.hidden_size;
        let (kd, vd, nv) = (
            cfg.linear_key_dim(),
            cfg.linear_value_dim(),
            cfg.linear_num_value_heads,
        );
        let (c, k) = (cfg.conv_dim(), cfg.linear_conv_kernel_dim);
        let conv = ckpt.floats(&format!("{p}.linear_attn.conv1d.weight"), &[c, k, 1])?;
        let name = |m: &str| format!("{p}.linear_attn.{m}");
        // The regrouped weights, and the modules they come from (for errors).
        let (qkv, z, ba, [qkv_name, z_name, ba_name]) = match cfg.family.delta_net_projections() {
            DeltaNetProjections::Fused => {
                let qkvz = ckpt.linear(&name("in_proj_qkvz"), 2 * kd + 2 * vd, d)?;
                let ba = ckpt.linear(&name("in_proj_ba"), 2 * nv, d)?;
                (
                    qkvz.select_rows(&fused_rows.qkv),
                    qkvz.select_rows(&fused_rows.z),
                    ba.select_rows(&fused_rows.ba),
                    ["in_proj_qkvz", "in_proj_qkvz", "in_proj_ba"],
                )
            }
            DeltaNetProjections::Split => {
                let qkv = ckpt.linear(&name("in_proj_qkv"), c, d)?;
                let z = ckpt.linear(&name("in_proj_z"), vd, d)?;
                let b = ckpt.linear(&name("in_proj_b"), nv, d)?;
                let a = ckpt.linear(&name("in_proj_a"), nv, d)?;
                // Small enough to dequantize if the two differ.
                (
                    qkv,
                    z,
                    LinearWeight::stack_rows(&name("in_proj_a"), vec![b, a])?,
                    ["in_proj_qkv", "in_proj_z", "in_proj_b"],
                )
            }
        };
        Ok(DeltaNet {
            in_proj: Projections::new(
                [
                    (name(qkv_name), qkv),
                    (name(z_name), z),
                    (name(ba_name), ba),
                ],
                |n, w| l.upload(n, w),
            )?,
            conv: l.backend.upload(&conv, c, k),
            a_log: l.vector(&name("A_log"), nv)?,
            dt_bias: l.vector(&name("dt_bias"), nv)?,
            norm: l.vector(&name("norm.weight"), cfg.linear_value_head_dim)?,
            out_proj: l.linear(&name("out_proj"), d, vd)?,
        })
    }

    /// The layer on its input `x`, advancing the sequence's `conv_state` and `recurrent`
    /// state.
    pub(super) fn forward(
        &self,
        backend: &B,
        cfg: &ModelConfig,
        x: &B::Tensor,
        conv_state: &mut B::Tensor,
        recurrent: &mut B::Tensor,
    ) -> B::Tensor {
        let [qkv, z, ba] = self.in_proj.apply(backend, x);
        let conv = backend.causal_conv1d_silu(&qkv, &self.conv, conv_state, 1);
        let dims = DeltaDims {
            key_heads: cfg.linear_num_key_heads,
            value_heads: cfg.linear_num_value_heads,
            key_dim: cfg.linear_key_head_dim,
            value_dim: cfg.linear_value_head_dim,
        };
        let y = backend.gated_delta(&conv, &ba, &self.a_log, &self.dt_bias, recurrent, dims);
        let o = backend.rms_norm_gated(
            &y,
            &z,
            &self.norm,
            cfg.linear_value_head_dim,
            cfg.rms_norm_eps,
            cfg.gate_activation,
        );
        backend.matmul(&o, &self.out_proj)
    }
}

/// Qwen3-Next's fused DeltaNet projections regrouped (../shared/spec/models.md §2.4
/// step 1): the rows of `in_proj_qkvz` that give `[q_all | k_all | v_all]` and `z_all`,
/// and those of `in_proj_ba` that give `[b_all | a_all]`.
pub(super) struct FusedRows {
    qkv: Vec<usize>,
    z: Vec<usize>,
    ba: Vec<usize>,
}

impl FusedRows {
    pub(super) fn new(cfg: &ModelConfig) -> Self {
        let (nk, dk, dv) = (
            cfg.linear_num_key_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        );
        let r = cfg.linear_num_value_heads / nk;
        // Each key-head group of in_proj_qkvz holds [q(dk) | k(dk) | v(r*dv) | z(r*dv)],
        // and each of in_proj_ba [b(r) | a(r)].
        let width = 2 * dk + 2 * r * dv;
        let per_group = |width: usize, off: usize, len: usize| -> Vec<usize> {
            (0..nk)
                .flat_map(|g| g * width + off..g * width + off + len)
                .collect()
        };
        let mut qkv = per_group(width, 0, dk);
        qkv.extend(per_group(width, dk, dk));
        qkv.extend(per_group(width, 2 * dk, r * dv));
        let mut ba = per_group(2 * r, 0, r);
        ba.extend(per_group(2 * r, r, r));
        FusedRows {
            qkv,
            z: per_group(width, 2 * dk + r * dv, r * dv),
            ba,
        }
    }
}
