//! The head: the final norm (Flash-Next: a hyper-connection mixer of the streams) and
//! the LM head.

use super::load::Loader;
use super::residual::HyperConnection;
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::Result;

/// What turns the last layer's residual into logits.
pub(super) struct Head<B: Backend> {
    norm: FinalNorm<B>,
    /// `lm_head`; `None` when it is tied to the embedding.
    lm_head: Option<B::Weight>,
}

/// What comes before the LM head.
pub(super) enum FinalNorm<B: Backend> {
    /// `model.norm`.
    Norm(B::Tensor),
    /// Flash-Next's `hyper_connection_mixer`.
    Mixer(HyperConnection<B>),
}

impl<B: Backend> Head<B> {
    /// Loads `lm_head` (unless tied) and the final norm or mixer.
    pub(super) fn load(l: &Loader<'_, B>) -> Result<Self> {
        let cfg = l.cfg;
        let d = cfg.hidden_size;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(l.linear(&cfg.name("lm_head"), cfg.vocab_size, d)?)
        };
        let norm = match &cfg.flash_next {
            Some(_) => {
                let mixer = cfg.name("model.hyper_connection_mixer");
                FinalNorm::Mixer(HyperConnection::load(l, &mixer, false)?)
            }
            None => FinalNorm::Norm(l.vector(&cfg.name("model.norm.weight"), d)?),
        };
        Ok(Head { norm, lm_head })
    }

    /// The final norm (or mixer) of the residual rows `h`: what the LM head reads, and
    /// the hidden state an MTP head takes.
    pub(super) fn norm(&self, backend: &B, cfg: &ModelConfig, h: &B::Tensor) -> B::Tensor {
        match &self.norm {
            FinalNorm::Norm(w) => {
                backend.rms_norm(h, Some(w), cfg.hidden_size, cfg.rms_norm_eps, 1.0)
            }
            FinalNorm::Mixer(hc) => hc.forward(backend, cfg, h).0,
        }
    }

    /// The logits of normed rows `y` ([`Head::norm`]); `embed` is the LM head when it is
    /// tied.
    pub(super) fn logits(&self, backend: &B, y: &B::Tensor, embed: &B::Weight) -> B::Tensor {
        backend.matmul(y, self.lm_head.as_ref().unwrap_or(embed))
    }
}
