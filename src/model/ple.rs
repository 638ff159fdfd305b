//! Flash-Next's PLE block (transformers `Qwen4ExpTextPLELayer`): the residual gated by
//! rows of a hashed n-gram table that the token ids pick ([`NgramTable`]).

use std::sync::Arc;

use super::load::Loader;
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::ngram::NgramTable;

/// Flash-Next's PLE block (transformers `Qwen4ExpTextPLELayer`).
pub(super) struct Ple<B: Backend> {
    /// The n-gram rows, read from the SSD.
    pub(super) table: Arc<NgramTable>,
    /// `key_proj` `[S*H, ple_embed_dim]`, `value_proj` `[H, ple_embed_dim]`.
    key: B::Weight,
    value: B::Weight,
    /// `norm_key`, `norm_query`, `norm_conv` `[S*H]`, `1 + w`.
    norm_key: B::Tensor,
    norm_query: B::Tensor,
    norm_conv: B::Tensor,
    /// Dilated depthwise conv `[S*H, kernel]`.
    conv: B::Tensor,
}

impl<B: Backend> Ple<B> {
    /// Loads the PLE block of layer `i` under `p` (`model.layers.{i}`) and opens its
    /// n-gram table; `None` on a layer without one.
    pub(super) fn load(l: &Loader<'_, B>, p: &str, i: usize) -> Result<Option<Self>> {
        let cfg = l.cfg;
        let ple = cfg.flash_next.as_ref().and_then(|x| x.ple.as_ref());
        let Some(c) = ple.filter(|c| c.layers.contains(&i)) else {
            return Ok(None);
        };
        let (d, width) = (cfg.hidden_size, cfg.residual_width());
        let (e, k) = (c.embed_dim, c.conv_kernel);
        let conv = l
            .ckpt
            .floats(&format!("{p}.ple.conv1d.weight"), &[width, k, 1])?;
        Ok(Some(Ple {
            table: Arc::new(NgramTable::open(l.ckpt, i, c)?),
            key: l.linear(&format!("{p}.ple.key_proj"), width, e)?,
            value: l.linear(&format!("{p}.ple.value_proj"), d, e)?,
            norm_key: l.centered_vector(&format!("{p}.ple.norm_key.weight"), width)?,
            norm_query: l.centered_vector(&format!("{p}.ple.norm_query.weight"), width)?,
            norm_conv: l.centered_vector(&format!("{p}.ple.norm_conv.weight"), width)?,
            conv: l.backend.upload(&conv, width, k),
        }))
    }

    /// The PLE block on the residual `h` given the chunk's n-gram rows `e`
    /// `[T, ple_embed_dim]` (transformers `Qwen4ExpTextPLELayer.forward`): returns
    /// `h + gated + silu(conv(norm(gated)))`.
    pub(super) fn forward(
        &self,
        backend: &B,
        cfg: &ModelConfig,
        h: &B::Tensor,
        e: &[f32],
        conv_state: &mut B::Tensor,
    ) -> B::Tensor {
        let (hd, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let (t, _) = backend.shape(h);
        let e = backend.upload(e, t, e.len() / t.max(1));
        let key = backend.rms_norm(
            &backend.matmul(&e, &self.key),
            Some(&self.norm_key),
            hd,
            eps,
            1.0,
        );
        let value = backend.matmul(&e, &self.value);
        let query = backend.rms_norm(h, Some(&self.norm_query), hd, eps, 1.0);
        let gated = backend.ple_gate(&key, &query, &value);
        let normed = backend.rms_norm(&gated, Some(&self.norm_conv), hd, eps, 1.0);
        let dilation = self.table.ngram_size;
        let conv = backend.causal_conv1d_silu(&normed, &self.conv, conv_state, dilation);
        backend.add(h, &backend.add(&gated, &conv))
    }
}
