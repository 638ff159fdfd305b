//! The MTP (multi-token prediction) draft head of Qwen3-Next and Qwen3.5-MoE, as vLLM's
//! predictor runs it (`qwen3_next_mtp.py`; ../shared/spec/models.md §2.9):
//!
//! ```text
//! e = rms_norm(E(t_{i+1}); pre_fc_norm_embedding)     E: the model's embedding
//! g = rms_norm(h_i; pre_fc_norm_hidden)               h_i: the model's final-normed hidden state
//! x = fc(concat(e, g))                                [2 hidden] -> [hidden]
//! x = DecoderLayer(x)        one full-attention + MoE layer, with its own KV cache
//! y = rms_norm(x; mtp.norm)  -> the shared lm_head's logits for t_{i+2}; y is also the
//!                               hidden state of the next draft step
//! ```
//!
//! The head's KV cache holds, at position `i`, the pair `(t_{i+1}, h_i)`: a main-model
//! position is run through the head once the token after it is known. Drafts past the
//! first use the head's own `y` in place of `h` and are dropped from its cache once made.
//! We follow vLLM in feeding the final-normed hidden state (some MLX ports feed the
//! pre-norm one). The head's norms are used as stored, in the MLX convention (`1 + w`
//! folded in, as the reference system's `mtp.safetensors` stores them); a head whose
//! norms look zero-centered (the raw release) is refused, since using them as stored
//! would be a silent wrong answer. Its routed experts are read from the mapped
//! checkpoint, apart from the pool.

use std::sync::Arc;

use super::attention::Attention;
use super::load::{Loader, NormConvention};
use super::moe::{Mlp, StepHold};
use super::residual::{self, Block, Residual};
use super::routes::StepSource;
use super::{Layer, Logits, Mixer, Model, SequenceState};
use crate::backend::{Backend, ResidualAdd};
use crate::checkpoint::{Checkpoint, ExpertIndex};
use crate::error::{Error, Result};
use crate::experts::MappedExperts;

/// A loaded MTP head ([`Model::load_mtp`]).
pub(super) struct MtpHead<B: Backend> {
    norm_embedding: B::Tensor,
    norm_hidden: B::Tensor,
    /// `fc`'s columns that read the embedding and the hidden state.
    fc_embedding: B::Weight,
    fc_hidden: B::Weight,
    layer: Layer<B>,
    norm: B::Tensor,
    experts: MappedExperts,
    index: Arc<ExpertIndex>,
}

/// A drafting sequence's head state: its KV cache, which holds positions
/// `0..done`, and the model's final hidden rows of positions `done..` (one tensor per
/// forward chunk), which the head has not run yet.
pub(super) struct MtpState<B: Backend> {
    kv: B::KvCache,
    pub(super) behind: Vec<B::Tensor>,
    done: usize,
}

impl<B: Backend> MtpState<B> {
    /// Drops the hidden rows of positions from `len` on (a rewound sequence).
    pub(super) fn truncate(&mut self, backend: &B, len: usize) {
        let mut keep = len.saturating_sub(self.done);
        self.behind.retain_mut(|t| {
            let rows = backend.shape(t).0;
            let kept = rows.min(keep);
            keep -= kept;
            if kept > 0 && kept < rows {
                *t = backend.rows(t, 0, kept);
            }
            kept > 0
        });
    }
}

/// The names of the head's tensors, under the family's prefix.
fn name(l: &Loader<'_, impl Backend>, rest: &str) -> String {
    l.cfg.name(&format!("mtp.{rest}"))
}

impl<B: Backend> MtpHead<B> {
    fn load(l: &Loader<'_, B>, ckpt: &Arc<Checkpoint>) -> Result<Self> {
        let cfg = l.cfg;
        let d = cfg.hidden_size;
        if cfg.flash_next.is_some() {
            return Err(Error::InvalidInput(
                "the MTP head of Qwen3.8-Flash-Next (scheme A) is not implemented; run without drafts".into(),
            ));
        }
        check_norms(l)?;
        let fc = name(l, "fc");
        let (fc_embedding, fc_hidden) = l.ckpt.linear(&fc, d, 2 * d)?.split_columns(&fc, d)?;
        let p = name(l, "layers.0");
        let layer = Layer {
            residual: Residual::load(l, &p)?,
            ple: None,
            mixer: Mixer::Attention(Attention::load(l, &p)?),
            mlp: Mlp::load(l, &p, cfg.num_experts > 0)?,
        };
        let index = Arc::new(ExpertIndex::build_block(
            ckpt,
            &format!("{p}.mlp.switch_mlp"),
        )?);
        Ok(MtpHead {
            norm_embedding: l.vector(&name(l, "pre_fc_norm_embedding.weight"), d)?,
            norm_hidden: l.vector(&name(l, "pre_fc_norm_hidden.weight"), d)?,
            fc_embedding: l.upload(&fc, fc_embedding)?,
            fc_hidden: l.upload(&fc, fc_hidden)?,
            layer,
            norm: l.vector(&name(l, "norm.weight"), d)?,
            experts: MappedExperts::new(ckpt.clone(), index.clone()),
            index,
        })
    }
}

/// Refuses a head whose `1 + w` norms look zero-centered ([`NormConvention::detect`]).
fn check_norms(l: &Loader<'_, impl Backend>) -> Result<()> {
    let prefix = name(l, "");
    let mut values = Vec::new();
    for t in l.ckpt.tensors().filter(|t| {
        t.name.starts_with(&prefix)
            && (t.name.ends_with("norm.weight") || t.name.contains("pre_fc_norm"))
    }) {
        values.extend(l.ckpt.floats(&t.name, &t.shape)?);
    }
    if NormConvention::detect(&values) == NormConvention::Centered {
        return Err(Error::bad_tensor(
            &name(l, "norm.weight"),
            "the MTP head's norm weights look zero-centered (as released); fold the +1 in \
             as MLX conversions do (the reference system's mtp.safetensors does)",
        ));
    }
    Ok(())
}

impl<B: Backend> Model<B> {
    /// Whether `ckpt` holds an MTP head (`mtp.fc.weight` under the family's prefix).
    pub fn has_mtp(ckpt: &Checkpoint) -> bool {
        ckpt.contains(&ckpt.config.name("mtp.fc.weight"))
    }

    /// Loads the checkpoint's MTP head (its `mtp.*` tensors, which
    /// [`Checkpoint::add_file`] may have added from a file of their own) for drafting.
    /// Errors: a missing or mis-shaped tensor, named; zero-centered norms; a head whose
    /// experts' quantization differs within the head; Flash-Next (not implemented).
    pub fn load_mtp(&mut self, ckpt: &Arc<Checkpoint>, backend: &B) -> Result<()> {
        let l = Loader::new(ckpt, backend)?;
        self.mtp = Some(MtpHead::load(&l, ckpt)?);
        Ok(())
    }

    /// Whether the MTP head is loaded.
    pub fn drafts(&self) -> bool {
        self.mtp.is_some()
    }

    /// A fresh sequence that keeps what the MTP head needs ([`Model::draft`]). Errors:
    /// no head loaded.
    pub fn new_drafting_state(&self, backend: &B) -> Result<SequenceState<B>> {
        let mut state = self.new_state(backend);
        self.start_drafting(backend, &mut state)?;
        Ok(state)
    }

    /// Makes `state` a drafting sequence from here on (its head cache starts empty: a
    /// state restored from a snapshot drafts from positions it runs after this). Errors:
    /// no head loaded.
    pub fn start_drafting(&self, backend: &B, state: &mut SequenceState<B>) -> Result<()> {
        if self.mtp.is_none() {
            return Err(Error::InvalidInput(
                "the model has no MTP head loaded".into(),
            ));
        }
        if state.mtp.is_none() {
            state.mtp = Some(MtpState {
                kv: backend.new_kv_cache(self.config.num_key_value_heads * self.config.head_dim),
                behind: Vec::new(),
                done: state.tokens.len(),
            });
        }
        Ok(())
    }

    /// Runs the MTP head over every position of `state` it has not run, the last with
    /// `next` (the token sampled after the sequence) as its following token, and returns
    /// the head's logits (`[positions, vocab]`, or the last row: see [`Logits`]) with its
    /// output rows `[positions, hidden]`. Errors: a sequence that does not draft, an
    /// out-of-range `next`, a read-back's.
    pub fn mtp_catch_up(
        &self,
        backend: &B,
        state: &mut SequenceState<B>,
        next: u32,
        which: Logits,
    ) -> Result<(Vec<f32>, B::Tensor)> {
        let (head, mtp) = self.drafting(&mut state.mtp)?;
        let behind = std::mem::take(&mut mtp.behind);
        let total: usize = behind.iter().map(|t| backend.shape(t).0).sum();
        if total == 0 || mtp.done + total != state.tokens.len() {
            return Err(Error::Internal(format!(
                "the MTP head has {total} positions to run after {} for a sequence of {}",
                mtp.done,
                state.tokens.len()
            )));
        }
        // The token after each position: the sequence's own, then `next`.
        let mut after = state.tokens[mtp.done + 1..].to_vec();
        after.push(next);
        let (mut logits, mut last) = (Vec::new(), None);
        let mut at = 0;
        let parts = behind.len();
        for (n, hidden) in behind.iter().enumerate() {
            let rows = backend.shape(hidden).0;
            let want = (which == Logits::All || n + 1 == parts).then_some(which);
            let (values, y) = head.forward(
                self,
                backend,
                &mut mtp.kv,
                &after[at..at + rows],
                hidden,
                want,
            )?;
            logits.extend(values);
            last = Some(y);
            at += rows;
        }
        mtp.done += total;
        Ok((logits, last.expect("at least one chunk of hidden rows")))
    }

    /// `k` drafts of the tokens after `next` (the token sampled after `state`'s last),
    /// each picked by `pick` from the head's logits (`[vocab]`): the head's catch-up
    /// ([`Model::mtp_catch_up`]) gives the first, each further draft runs the head on the
    /// previous draft and the head's own output. The head's cache keeps only the
    /// sequence's positions afterwards. Errors: as [`Model::mtp_catch_up`], and `pick`'s.
    pub fn draft(
        &self,
        backend: &B,
        state: &mut SequenceState<B>,
        next: u32,
        k: usize,
        mut pick: impl FnMut(&[f32]) -> Result<u32>,
    ) -> Result<Vec<u32>> {
        let mut drafts = Vec::with_capacity(k);
        if k == 0 {
            return Ok(drafts);
        }
        let (logits, mut y) = self.mtp_catch_up(backend, state, next, Logits::Last)?;
        drafts.push(pick(&logits)?);
        let (head, mtp) = self.drafting(&mut state.mtp)?;
        let done = mtp.done;
        let rows = backend.shape(&y).0;
        if rows > 1 {
            y = backend.rows(&y, rows - 1, 1);
        }
        // The drafts' rows leave the head's cache however the loop ends.
        let mut made = Ok(());
        while drafts.len() < k && made.is_ok() {
            let prev = *drafts.last().expect("one draft made");
            made = head
                .forward(self, backend, &mut mtp.kv, &[prev], &y, Some(Logits::Last))
                .and_then(|(logits, out)| {
                    drafts.push(pick(&logits)?);
                    y = out;
                    Ok(())
                });
        }
        backend.kv_truncate(&mut mtp.kv, done);
        made.map(|()| drafts)
    }

    /// The head and the head state of a drafting `state`.
    fn drafting<'a>(
        &'a self,
        state: &'a mut Option<MtpState<B>>,
    ) -> Result<(&'a MtpHead<B>, &'a mut MtpState<B>)> {
        match (&self.mtp, state.as_mut()) {
            (Some(head), Some(mtp)) => Ok((head, mtp)),
            _ => Err(Error::InvalidInput(
                "this sequence does not draft (no MTP head, or made without one)".into(),
            )),
        }
    }
}

impl<B: Backend> MtpHead<B> {
    /// The head on `tokens` (each the token after the position of its row of `hidden`,
    /// `[T, hidden]`), appending to its cache `kv`: the logits `which` asks for and
    /// the output rows `[T, hidden]`.
    fn forward(
        &self,
        model: &Model<B>,
        backend: &B,
        kv: &mut B::KvCache,
        tokens: &[u32],
        hidden: &B::Tensor,
        which: Option<Logits>,
    ) -> Result<(Vec<f32>, B::Tensor)> {
        let cfg = &model.config;
        let (d, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let e = backend.embed(&model.embed, tokens)?;
        let e = backend.rms_norm(&e, Some(&self.norm_embedding), d, eps, 1.0);
        let g = backend.rms_norm(hidden, Some(&self.norm_hidden), d, eps, 1.0);
        let x = backend.add(
            &backend.matmul(&e, &self.fc_embedding),
            &backend.matmul(&g, &self.fc_hidden),
        );
        let layer = &self.layer;
        let (input, _) = layer.residual.input(backend, cfg, Block::Mixer, &x);
        let Mixer::Attention(attention) = &layer.mixer else {
            unreachable!("the MTP head's layer is a full-attention layer")
        };
        // The head's own cache positions: with images a draft's rotation differs from the
        // model's, which costs acceptance, never correctness (the model verifies).
        let r = attention.forward(backend, cfg, &input, kv, None, None)?;
        let post = layer.residual.pre_norm(Block::Mlp);
        let (h, normed) = residual::add(backend, eps, &x, &r, None, post);
        let input = match normed {
            Some(n) => n,
            None => layer.residual.input(backend, cfg, Block::Mlp, &h).0,
        };
        let then = Some(ResidualAdd {
            h: &h,
            norm: Some((&self.norm, eps)),
        });
        let mut hold = StepHold::new(backend);
        let (out, y) = match &layer.mlp {
            Mlp::Moe(w) => {
                let mut routes = StepSource::Router;
                let layout = &self.index.layout;
                let hold = &mut hold;
                w.forward(
                    backend,
                    cfg,
                    layout,
                    0,
                    &input,
                    &mut routes,
                    &self.experts,
                    hold,
                    then,
                )?
            }
            Mlp::Dense(w) => ResidualAdd::apply_to(then, backend, w.forward(backend, &input)),
        };
        let y = y.unwrap_or_else(|| backend.rms_norm(&out, Some(&self.norm), d, eps, 1.0));
        let logits = match which {
            None => backend.rows(&y, 0, 1),
            Some(Logits::All) => model.head.logits(backend, &y, &model.embed),
            Some(Logits::Last) => {
                let last = backend.rows(&y, tokens.len() - 1, 1);
                model.head.logits(backend, &last, &model.embed)
            }
        };
        let (values, _) = hold.read_back(&logits)?;
        let values = match which {
            None => Vec::new(),
            Some(_) => values.into_iter().next().unwrap_or_default(),
        };
        Ok((values, y))
    }
}
