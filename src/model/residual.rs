//! The residual stream between blocks: Qwen3-Next / Qwen3.5's pre-norms, or Flash-Next's
//! hyper-connections (transformers `Qwen4ExpTextGatedResidual`), which keep `hc_count`
//! streams side by side and mix them into each block's input.

use super::load::Loader;
use crate::backend::{Backend, ResidualAdd};
use crate::config::ModelConfig;
use crate::error::Result;

/// The two blocks of a decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Block {
    /// The token mixer (gated DeltaNet or attention).
    Mixer,
    /// The MoE block (or dense MLP).
    Mlp,
}

/// Flash-Next's hyper-connection (transformers `Qwen4ExpTextGatedResidual`).
pub(super) struct HyperConnection<B: Backend> {
    /// `hc_norm` `[S*H]`, `1 + w`: an RMSNorm per stream with a weight per column.
    norm: B::Tensor,
    /// `input_mix_weight_down` `[hc_lowrank, S*H]`.
    down: B::Weight,
    /// `input_mix_weight_up` `[S*H, hc_lowrank]`.
    up: B::Weight,
    /// `block_inject_weight` `[S, S*H]`; the final mixer has none.
    inject: Option<B::Weight>,
}

/// How a layer's blocks read and add to the residual stream.
pub(super) enum Residual<B: Backend> {
    /// Qwen3-Next / Qwen3.5: `h += block(rms_norm(h))` for the mixer and the MLP.
    PreNorm { input: B::Tensor, post: B::Tensor },
    /// Flash-Next: each block reads its hyper-connection's mix of the streams and is
    /// added back to every stream with a learned weight.
    Hyper {
        attn: HyperConnection<B>,
        mlp: HyperConnection<B>,
    },
}

impl<B: Backend> HyperConnection<B> {
    /// Loads the hyper-connection under `prefix`, with its inject weight when `inject`.
    pub(super) fn load(l: &Loader<'_, B>, prefix: &str, inject: bool) -> Result<Self> {
        let cfg = l.cfg;
        let width = cfg.residual_width();
        let (streams, rank) = cfg
            .flash_next
            .as_ref()
            .map_or((1, 1), |x| (x.hc_count, x.hc_lowrank));
        Ok(HyperConnection {
            norm: l.centered_vector(&format!("{prefix}.hc_norm.weight"), width)?,
            down: l.linear(&format!("{prefix}.input_mix_weight_down"), rank, width)?,
            up: l.linear(&format!("{prefix}.input_mix_weight_up"), width, rank)?,
            inject: if inject {
                Some(l.linear(&format!("{prefix}.block_inject_weight"), streams, width)?)
            } else {
                None
            },
        })
    }

    /// A hyper-connection (transformers `Qwen4ExpTextGatedResidual.forward`):
    /// `n = group_rms_norm(h)`, `x = mean_s sigmoid(up(silu(down(n) / S))) * n`, and the
    /// inject logits `inj(n)` when it has them.
    pub(super) fn forward(
        &self,
        backend: &B,
        cfg: &ModelConfig,
        h: &B::Tensor,
    ) -> (B::Tensor, Option<B::Tensor>) {
        let streams = cfg.flash_next.as_ref().map_or(1, |x| x.hc_count);
        let n = backend.rms_norm(h, Some(&self.norm), cfg.hidden_size, cfg.rms_norm_eps, 1.0);
        let low = backend.silu(&backend.matmul(&n, &self.down), 1.0 / streams as f32);
        let mix = backend.matmul(&low, &self.up);
        let x = backend.hyper_mix(&n, &mix, streams);
        let inject = self.inject.as_ref().map(|w| backend.matmul(&n, w));
        (x, inject)
    }
}

impl<B: Backend> Residual<B> {
    /// Loads the residual weights of the layer under `p` (`model.layers.{i}`).
    pub(super) fn load(l: &Loader<'_, B>, p: &str) -> Result<Self> {
        let d = l.cfg.hidden_size;
        Ok(match &l.cfg.flash_next {
            Some(_) => Residual::Hyper {
                attn: HyperConnection::load(l, &format!("{p}.attn_hyper_connection"), true)?,
                mlp: HyperConnection::load(l, &format!("{p}.mlp_hyper_connection"), true)?,
            },
            None => Residual::PreNorm {
                input: l.vector(&format!("{p}.input_layernorm.weight"), d)?,
                post: l.vector(&format!("{p}.post_attention_layernorm.weight"), d)?,
            },
        })
    }

    /// The input of a layer's mixer or MLP block read from the residual `h`, and the
    /// hyper-connection's inject logits `[T, streams]` when it has streams.
    pub(super) fn input(
        &self,
        backend: &B,
        cfg: &ModelConfig,
        block: Block,
        h: &B::Tensor,
    ) -> (B::Tensor, Option<B::Tensor>) {
        match (self, block) {
            (Residual::PreNorm { .. }, _) => {
                let w = self.pre_norm(block);
                let x = backend.rms_norm(h, w, cfg.hidden_size, cfg.rms_norm_eps, 1.0);
                (x, None)
            }
            (Residual::Hyper { attn: hc, .. }, Block::Mixer)
            | (Residual::Hyper { mlp: hc, .. }, Block::Mlp) => hc.forward(backend, cfg, h),
        }
    }

    /// The norm weight of `block`'s input when the layer is pre-norm (`None` with
    /// hyper-connections).
    pub(super) fn pre_norm(&self, block: Block) -> Option<&B::Tensor> {
        match (self, block) {
            (Residual::PreNorm { input, .. }, Block::Mixer) => Some(input),
            (Residual::PreNorm { post, .. }, Block::Mlp) => Some(post),
            (Residual::Hyper { .. }, _) => None,
        }
    }
}

/// `h + y`, or with hyper-connections `h + y * 2 sigmoid(inject / S)` per stream; with
/// `next`, the next block's pre-norm weight, also that block's input `rms_norm(h + y)`
/// from the same pass; `eps` is the norm's.
pub(super) fn add<B: Backend>(
    backend: &B,
    eps: f32,
    h: &B::Tensor,
    y: &B::Tensor,
    inject: Option<&B::Tensor>,
    next: Option<&B::Tensor>,
) -> (B::Tensor, Option<B::Tensor>) {
    match inject {
        Some(inject) => (backend.hyper_inject(h, y, inject), None),
        None => ResidualAdd {
            h,
            norm: next.map(|w| (w, eps)),
        }
        .apply(backend, y),
    }
}
