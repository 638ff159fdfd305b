//! The full attention block (mlx-lm `Qwen3NextAttention`: gated output, q/k norms,
//! partial RoPE) and Flash-Next's QSA indexer, which restricts each query's keys.

use super::load::Loader;
use super::projections::Projections;
use crate::backend::cpu::{dot, CpuBackend, CpuTensor};
use crate::backend::{mrope_table, rope_table, rotate_half, AttnDims, Backend, KeyMask};
use crate::config::{IndexerConfig, ModelConfig};
use crate::error::{Error, Result};

/// A full attention layer with its output gate (mlx-lm `Qwen3NextAttention`).
pub(super) struct Attention<B: Backend> {
    /// The queries' rows of `q_proj` (`[H hd, hidden]`; the checkpoint interleaves each
    /// head's queries with its output gates), the output gates' rows of `q_proj`
    /// (`[H hd, hidden]`), `k_proj` and `v_proj`.
    qkv: Projections<B, 4>,
    o_proj: B::Weight,
    q_norm: B::Tensor,
    k_norm: B::Tensor,
    /// Flash-Next's QSA indexer.
    pub(super) indexer: Option<Indexer<B>>,
}

/// The QSA indexer of one attention layer (transformers `Qwen4ExpTextQSAIndexer`).
pub(super) struct Indexer<B: Backend> {
    /// The query rows of `index_qk_proj` (`[(heads + 1) * head_dim, hidden]`: the queries,
    /// then the key), `[heads * head_dim, hidden]`.
    q: B::Weight,
    /// Its key rows, `[head_dim, hidden]`.
    k: B::Weight,
    /// `q_layernorm` `[head_dim]`, `1 + w`.
    q_norm: B::Tensor,
    /// `k_layernorm`, `1 + w`, on the host where the blocks are pooled and scored.
    k_norm: CpuTensor,
}

impl<B: Backend> Attention<B> {
    /// Loads the layer under `p` (`model.layers.{i}`), with its indexer when the config
    /// has one.
    pub(super) fn load(l: &Loader<'_, B>, p: &str) -> Result<Self> {
        let (cfg, ckpt) = (l.cfg, l.ckpt);
        let d = cfg.hidden_size;
        let (h, kvh, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let indexer = match cfg.flash_next.as_ref().and_then(|x| x.indexer.as_ref()) {
            Some(ix) => Some(Indexer::load(l, p, ix)?),
            None => None,
        };
        // Each head's rows are [queries (hd) | output gate (hd)].
        let q_name = format!("{p}.self_attn.q_proj");
        let q_proj = ckpt.linear(&q_name, 2 * h * hd, d)?;
        let half = |off: usize| -> Vec<usize> {
            (0..h)
                .flat_map(|i| i * 2 * hd + off..i * 2 * hd + off + hd)
                .collect()
        };
        let (k_name, v_name) = (
            format!("{p}.self_attn.k_proj"),
            format!("{p}.self_attn.v_proj"),
        );
        Ok(Attention {
            qkv: Projections::new(
                [
                    (q_name.clone(), q_proj.select_rows(&half(0))),
                    (q_name.clone(), q_proj.select_rows(&half(hd))),
                    (k_name.clone(), ckpt.linear(&k_name, kvh * hd, d)?),
                    (v_name.clone(), ckpt.linear(&v_name, kvh * hd, d)?),
                ],
                |n, w| l.upload(n, w),
            )?,
            o_proj: l.linear(&format!("{p}.self_attn.o_proj"), d, h * hd)?,
            q_norm: l.centered_vector(&format!("{p}.self_attn.q_norm.weight"), hd)?,
            k_norm: l.centered_vector(&format!("{p}.self_attn.k_norm.weight"), hd)?,
            indexer,
        })
    }

    /// The layer on its input `x`, appending to the sequence's `kv` cache and, with an
    /// indexer, to its `index` keys. The rows rotate by their cache positions, or by
    /// `positions` (one (t, h, w) position a row, M-RoPE with the config's `mrope`) in a
    /// sequence with images. (The QSA indexer's keys keep cache positions.) Errors: a
    /// failed read-back of the indexer's keys or queries, `positions` without `mrope`.
    pub(super) fn forward(
        &self,
        backend: &B,
        cfg: &ModelConfig,
        x: &B::Tensor,
        kv: &mut B::KvCache,
        index: Option<&mut IndexKeys<B>>,
        positions: Option<&[[usize; 3]]>,
    ) -> Result<B::Tensor> {
        let hd = cfg.head_dim;
        let [q, gate, k, v] = self.qkv.apply(backend, x);
        let q = backend.rms_norm(&q, Some(&self.q_norm), hd, cfg.rms_norm_eps, 1.0);
        let k = backend.rms_norm(&k, Some(&self.k_norm), hd, cfg.rms_norm_eps, 1.0);
        let pos = backend.kv_len(kv);
        let (rd, theta) = (cfg.rotary_dim, cfg.rope_theta);
        let angles = match (positions, &cfg.mrope) {
            (None, _) => rope_table(pos, backend.shape(x).0, rd, theta),
            (Some(p), Some(mrope)) => mrope_table(p, rd, theta, mrope),
            (Some(_), None) => {
                return Err(Error::InvalidInput(
                    "multimodal positions for a model without mrope_section".into(),
                ))
            }
        };
        let q = backend.rope(&q, hd, rd, &angles);
        let k = backend.rope(&k, hd, rd, &angles);
        let dims = AttnDims {
            q_heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: hd,
            scale: (hd as f64).powf(-0.5) as f32,
        };
        let mask = match (
            &self.indexer,
            index,
            cfg.flash_next.as_ref().and_then(|f| f.indexer.as_ref()),
        ) {
            (Some(ix), Some(keys), Some(icfg)) => {
                let mask = ix.mask(backend, cfg, icfg, x, keys, pos)?;
                if let Some(kept) = keys.selections.as_mut() {
                    let (t, _) = backend.shape(x);
                    kept.push(mask.clone().unwrap_or_else(|| KeyMask::causal(t, pos + t)));
                }
                mask
            }
            _ => None,
        };
        let o = backend.attention(&q, &k, &v, kv, dims, mask.as_ref());
        Ok(backend.matmul(&backend.mul_sigmoid(&o, &gate), &self.o_proj))
    }
}

impl<B: Backend> Indexer<B> {
    /// Loads the indexer of the attention layer under `p`.
    fn load(l: &Loader<'_, B>, p: &str, ix: &IndexerConfig) -> Result<Self> {
        let module = format!("{p}.self_attn.indexer.index_qk_proj");
        let qk = l
            .ckpt
            .linear(&module, (ix.heads + 1) * ix.head_dim, l.cfg.hidden_size)?;
        let queries = ix.heads * ix.head_dim;
        let rows = |from: usize, n: usize| (from..from + n).collect::<Vec<_>>();
        Ok(Indexer {
            q: l.upload(&module, qk.select_rows(&rows(0, queries)))?,
            k: l.upload(&module, qk.select_rows(&rows(queries, ix.head_dim)))?,
            q_norm: l.centered_vector(
                &format!("{p}.self_attn.indexer.q_layernorm.weight"),
                ix.head_dim,
            )?,
            k_norm: CpuBackend.upload(
                &l.centered(
                    &format!("{p}.self_attn.indexer.k_layernorm.weight"),
                    ix.head_dim,
                )?,
                1,
                ix.head_dim,
            ),
        })
    }

    /// The QSA indexer's key selection for the `T` queries of `x` at positions
    /// `past .. past + T` (transformers `Qwen4ExpTextQSAIndexer.forward`; reference-system.md
    /// A.5): the keys of the blocks of `compress_ratio` tokens entirely in a query's past
    /// are mean-pooled, normalized and rotated to the block's first position; a block
    /// scores `sum_h relu(q_h . k_block) / sqrt(head_dim)` and a query keeps its best
    /// `budget / compress_ratio` blocks plus its own partial block. `None` while every
    /// query keeps every key (no more complete blocks than that), which also spares the
    /// read-back of the indexer's keys and queries.
    fn mask(
        &self,
        backend: &B,
        cfg: &ModelConfig,
        icfg: &IndexerConfig,
        x: &B::Tensor,
        keys: &mut IndexKeys<B>,
        past: usize,
    ) -> Result<Option<KeyMask>> {
        let (d, ratio, top_k) = (icfg.head_dim, icfg.compress_ratio, icfg.block_top_k());
        keys.pending.push(backend.matmul(x, &self.k));
        let (t, _) = backend.shape(x);
        let total = past + t;
        if total / ratio <= top_k {
            return Ok(None);
        }
        for k in keys.pending.drain(..) {
            keys.raw.extend(backend.download(&k)?);
        }
        // Pool the blocks completed since the last call: mean, k_layernorm, RoPE at the
        // block's first position (on the host, where the scores are taken).
        let (first, blocks) = (keys.pooled.len() / d, total / ratio);
        if blocks > first {
            let means: Vec<f32> = keys.raw[first * ratio * d..blocks * ratio * d]
                .chunks_exact(ratio * d)
                .flat_map(|block| {
                    (0..d).map(move |j| block.iter().skip(j).step_by(d).sum::<f32>() / ratio as f32)
                })
                .collect();
            let cpu = CpuBackend;
            let mut normed = cpu.rms_norm(
                &cpu.upload(&means, blocks - first, d),
                Some(&self.k_norm),
                d,
                cfg.rms_norm_eps,
                1.0,
            );
            for (i, row) in normed.data.chunks_exact_mut(d).enumerate() {
                rotate_half(
                    row,
                    &rope_table((first + i) * ratio, 1, cfg.rotary_dim, cfg.rope_theta),
                );
            }
            keys.pooled.extend(normed.data);
        }
        let q = backend.rms_norm(
            &backend.matmul(x, &self.q),
            Some(&self.q_norm),
            d,
            cfg.rms_norm_eps,
            1.0,
        );
        let angles = rope_table(past, backend.shape(&q).0, cfg.rotary_dim, cfg.rope_theta);
        let q = backend.download(&backend.rope(&q, d, cfg.rotary_dim, &angles))?;
        let scale = 1.0 / (d as f32).sqrt();
        let mut mask = KeyMask::new(t, total);
        for row in 0..t {
            let pos = past + row;
            let complete = (pos + 1) / ratio;
            let kept_blocks: Vec<usize> = if complete <= top_k {
                (0..complete).collect()
            } else {
                let qr = &q[row * icfg.heads * d..(row + 1) * icfg.heads * d];
                let mut scored: Vec<(f32, usize)> = (0..complete)
                    .map(|b| {
                        let kb = &keys.pooled[b * d..(b + 1) * d];
                        let s: f32 = qr.chunks_exact(d).map(|qh| dot(qh, kb).max(0.0)).sum();
                        (s * scale, b)
                    })
                    .collect();
                // Highest score first; ties to the lower block, NaN last.
                scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                scored.truncate(top_k);
                scored.into_iter().map(|(_, b)| b).collect()
            };
            for b in kept_blocks {
                (b * ratio..(b + 1) * ratio).for_each(|key| mask.keep(row, key));
            }
            (complete * ratio..=pos).for_each(|key| mask.keep(row, key));
        }
        Ok(Some(mask))
    }
}

/// The QSA indexer's cache: one raw key per token (`[tokens, head_dim]`), and the pooled,
/// normalized and rotated keys of the complete blocks (`[blocks, head_dim]`).
pub(super) struct IndexKeys<B: Backend> {
    /// Keys of the calls whose selection needed none yet; read back when one does.
    pub(super) pending: Vec<B::Tensor>,
    pub(super) raw: Vec<f32>,
    pub(super) pooled: Vec<f32>,
    /// Each call's key selection, once [`super::SequenceState::keep_qsa_selections`]
    /// asked for it.
    pub(super) selections: Option<Vec<KeyMask>>,
}
