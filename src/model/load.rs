//! What the blocks' loads share: a checkpoint's tensors put on the backend, named in
//! errors, and Flash-Next's `1 + w` norms read in the checkpoint's convention.

use crate::backend::Backend;
use crate::checkpoint::{Checkpoint, LinearWeight};
use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// A checkpoint being loaded onto a backend: each block reads its tensors through it.
pub(super) struct Loader<'a, B: Backend> {
    pub(super) ckpt: &'a Checkpoint,
    pub(super) backend: &'a B,
    pub(super) cfg: &'a ModelConfig,
    /// How the checkpoint stores its `1 + w` norms (Flash-Next only).
    pub(super) norms: Option<NormConvention>,
}

impl<'a, B: Backend> Loader<'a, B> {
    /// Errors: a bad `SLOTSTREAM_NORMS`, or an unreadable `1 + w` norm (Flash-Next).
    pub(super) fn new(ckpt: &'a Checkpoint, backend: &'a B) -> Result<Self> {
        let norms = match &ckpt.config.flash_next {
            Some(_) => Some(norm_convention(ckpt)?),
            None => None,
        };
        Ok(Loader {
            ckpt,
            backend,
            cfg: &ckpt.config,
            norms,
        })
    }

    /// The vector `name` of `len` floats, on the backend.
    pub(super) fn vector(&self, name: &str, len: usize) -> Result<B::Tensor> {
        Ok(self
            .backend
            .upload(&self.ckpt.floats(name, &[len])?, 1, len))
    }

    /// `w` on the backend; a weight the backend cannot hold (past a GPU's binding limit)
    /// is named.
    pub(super) fn upload(&self, name: &str, w: LinearWeight) -> Result<B::Weight> {
        self.backend.upload_weight(w).map_err(|e| match e {
            Error::Gpu(m) => Error::Gpu(format!("`{name}`: {m}")),
            other => other,
        })
    }

    /// The linear layer `name`, `[out, inp]`, on the backend.
    pub(super) fn linear(&self, name: &str, out: usize, inp: usize) -> Result<B::Weight> {
        self.upload(name, self.ckpt.linear(name, out, inp)?)
    }

    /// A `1 + w` norm, as a plain multiplier.
    pub(super) fn centered(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let mut w = self.ckpt.floats(name, &[len])?;
        if self.norms == Some(NormConvention::Centered) {
            w.iter_mut().for_each(|v| *v += 1.0);
        }
        Ok(w)
    }

    /// [`Loader::centered`] on the backend.
    pub(super) fn centered_vector(&self, name: &str, len: usize) -> Result<B::Tensor> {
        Ok(self.backend.upload(&self.centered(name, len)?, 1, len))
    }
}

/// How a checkpoint stores the norms a model applies as `1 + w` (Flash-Next's q/k norms,
/// indexer norms, hyper-connection and PLE norms; ../shared/spec/models.md §5.2b).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormConvention {
    /// `w` as trained (Hugging Face release): the loader adds 1.
    Centered,
    /// `1 + w` already (MLX conversions, the reference system's checkpoint): used as stored.
    Folded,
}

impl NormConvention {
    /// The environment variable that overrides detection: `centered` or `folded`.
    pub const OVERRIDE: &'static str = "SLOTSTREAM_NORMS";

    /// Whether tensor `name` is one of the norms Flash-Next applies as `1 + w` (the
    /// gated DeltaNet norm is a plain multiplier and is not).
    pub fn applies_to(name: &str) -> bool {
        const CENTERED: [&str; 8] = [
            ".self_attn.q_norm.weight",
            ".self_attn.k_norm.weight",
            ".indexer.q_layernorm.weight",
            ".indexer.k_layernorm.weight",
            ".hc_norm.weight",
            ".ple.norm_key.weight",
            ".ple.norm_query.weight",
            ".ple.norm_conv.weight",
        ];
        CENTERED.iter().any(|s| name.ends_with(s))
    }

    /// Detects the convention from the stored weights: trained centered weights sit near
    /// 0 and folded ones near 1, so the mean over all of them decides (at 0.5).
    pub fn detect(values: &[f32]) -> Self {
        let mean = values.iter().map(|&v| v as f64).sum::<f64>() / values.len().max(1) as f64;
        if mean > 0.5 {
            NormConvention::Folded
        } else {
            NormConvention::Centered
        }
    }
}

/// The checkpoint's convention for Flash-Next's `1 + w` norms: `SLOTSTREAM_NORMS` if set,
/// else [`NormConvention::detect`] over the text model's norm weights. An MTP head's norms
/// (`mtp.*`, which the engine does not run) may be stored in the other convention: they
/// are judged on their own, and only logged.
fn norm_convention(ckpt: &Checkpoint) -> Result<NormConvention> {
    let convention = match std::env::var(NormConvention::OVERRIDE).ok().as_deref() {
        Some("centered") => NormConvention::Centered,
        Some("folded") => NormConvention::Folded,
        Some(other) => {
            return Err(Error::InvalidInput(format!(
                "{}={other:?}: expected `centered` or `folded`",
                NormConvention::OVERRIDE
            )))
        }
        None => {
            let (model, mtp) = norm_weights(ckpt)?;
            let detected = NormConvention::detect(&model);
            tracing::info!(convention = ?detected, weights = model.len(), "zero-centered norms: convention detected (override with {})", NormConvention::OVERRIDE);
            if !mtp.is_empty() {
                tracing::info!(convention = ?NormConvention::detect(&mtp), weights = mtp.len(), "zero-centered norms of the MTP head (not run): convention detected");
            }
            return Ok(detected);
        }
    };
    tracing::info!(convention = ?convention, "zero-centered norms: convention set by {}", NormConvention::OVERRIDE);
    Ok(convention)
}

/// The values of the `1 + w` norm weights ([`NormConvention::applies_to`]) of the text
/// model and of its MTP head. Errors: an unreadable weight.
fn norm_weights(ckpt: &Checkpoint) -> Result<(Vec<f32>, Vec<f32>)> {
    let (mut model, mut mtp) = (Vec::new(), Vec::new());
    for t in ckpt
        .tensors()
        .filter(|t| NormConvention::applies_to(&t.name))
    {
        let values = ckpt.floats(&t.name, &t.shape)?;
        if ckpt.config.is_text_tensor(&t.name) {
            model.extend(values);
        } else if t.name.contains("mtp.") {
            mtp.extend(values);
        }
    }
    Ok((model, mtp))
}
