//! The Qwen3-Next / Qwen3.5-MoE forward pass, written once over [`Backend`].
//!
//! Follows mlx-lm 0.32.2 `mlx_lm/models/qwen3_next.py`, `qwen3_5.py` (which reuses
//! qwen3_next's attention, MLP, gated norm and MoE block) and `gated_delta.py`
//! (../shared/spec/models.md §2, §2.10). The families differ only in data chosen at load
//! time: tensor names ([`ModelConfig::name`]) and the gated DeltaNet's input projections
//! ([`crate::config::DeltaNetProjections`]: fused and interleaved per key-head group, or split and
//! contiguous). Where the spec and mlx-lm differ, mlx-lm wins: q and k of the gated
//! DeltaNet are L2-normalized with eps 1e-6 added to `sum(x^2)` (`normalize_qk`), and norm
//! weights of an MLX checkpoint are used as stored.
//!
//! Qwen3.8-Flash-Next (`qwen4_exp`) follows transformers 5.24 `modular_qwen4_exp.py`
//! (its reference; mlx-lm 0.32.2 lacks it): the residual is `hc_count` streams joined by
//! hyper-connections instead of pre-norms ([`Residual::Hyper`]), a hyper-connection mixer
//! replaces the final norm ([`head::FinalNorm::Mixer`]), attention layers restrict their
//! keys with the QSA indexer ([`attention::Indexer`]), and layer 1 starts with the PLE
//! block over hashed n-gram rows read from the SSD ([`Ple`], [`NgramTable`]). Its
//! zero-centered norms are applied as `1 + w`; a checkpoint may store them centered (the
//! Hugging Face release) or with the `+1` folded in (MLX conversions): [`NormConvention`]
//! tells them apart.
//!
//! Each block of a layer lives in its own module with its weights, its load (by the
//! block's tensor names) and its forward: [`delta_net`], [`attention`] (with the QSA
//! indexer), [`moe`] (and the dense MLP), [`residual`] (pre-norms or hyper-connections),
//! [`ple`] and [`head`]; [`projections`] stacks a block's input projections and [`load`]
//! reads the checkpoint for them all. This file strings them together: [`Model::load`]
//! and the forward pass, layer by layer. A sequence may hold images ([`images`]: the
//! vision tower's rows over their placeholder tokens, and multimodal positions).

mod attention;
mod delta_net;
mod head;
mod images;
mod load;
mod moe;
mod mtp;
mod ple;
mod projections;
mod residual;
mod routes;
mod snapshot;
mod vision;

use std::sync::{Arc, Mutex};

use attention::{Attention, IndexKeys};
use delta_net::{DeltaNet, FusedRows};
use head::Head;
use images::PlacedImage;
pub use images::{ImageEmbedding, ImageSpan};
use load::Loader;
pub use load::NormConvention;
pub use moe::SWEEP_MIN_TOKENS;
use moe::{Mlp, StepHold};
use mtp::{MtpHead, MtpState};
use ple::Ple;
use residual::{Block, Residual};
pub use routes::RouteSource;
use routes::StepSource;
use snapshot::{lock_kv, SharedKv, Writer};
pub use snapshot::{ImageTensor, RewindPoint, Snapshot, StateImage};
pub use vision::{VisionTower, VISION_PREFIXES};

use crate::backend::{Backend, KeyMask, ResidualAdd, Routing};
use crate::checkpoint::{Checkpoint, ExpertIndex};
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::ngram::NgramTable;
use crate::records::ExpertSource;
use crate::routing_model::{RoutingModel, RoutingState, ROUTING_FILE};

/// A layer's token mixer.
enum Mixer<B: Backend> {
    DeltaNet(DeltaNet<B>),
    Attention(Attention<B>),
}

/// A decoder layer.
struct Layer<B: Backend> {
    residual: Residual<B>,
    /// Flash-Next's PLE block, run on the residual before this layer's mixer.
    ple: Option<Ple<B>>,
    mixer: Mixer<B>,
    mlp: Mlp<B>,
}

impl<B: Backend> Layer<B> {
    /// Loads layer `i`, of `kind`, block by block.
    fn load(l: &Loader<'_, B>, i: usize, kind: LayerKind, fused_rows: &FusedRows) -> Result<Self> {
        let p = l.cfg.name(&format!("model.layers.{i}"));
        let mixer = match kind {
            LayerKind::LinearAttention => Mixer::DeltaNet(DeltaNet::load(l, &p, fused_rows)?),
            LayerKind::FullAttention => Mixer::Attention(Attention::load(l, &p)?),
        };
        Ok(Layer {
            mlp: Mlp::load(l, &p, l.cfg.is_moe_layer(i))?,
            residual: Residual::load(l, &p)?,
            ple: Ple::load(l, &p, i)?,
            mixer,
        })
    }
}

/// A loaded model: resident weights on backend `B` and the index of its expert records.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub experts: ExpertIndex,
    /// Where the MoE layers' expert ids come from: the router, or the synthetic routing
    /// model of the checkpoint directory ([`ROUTING_FILE`]) when it has one (the router's
    /// mixing weights stay).
    pub routes: RouteSource,
    /// How the checkpoint stores its `1 + w` norms (Flash-Next only).
    pub norms: Option<NormConvention>,
    embed: B::Weight,
    head: Head<B>,
    layers: Vec<Layer<B>>,
    /// Flash-Next: the columns that copy the embedding into its `hc_count` residual
    /// streams side by side.
    tile: Option<B::Index>,
    /// The most tokens one sequence may hold ([`Model::context`]).
    context: usize,
    /// The MTP draft head, once [`Model::load_mtp`] has loaded it.
    mtp: Option<MtpHead<B>>,
}

/// Recurrent and attention state of one layer for one sequence.
enum LayerState<B: Backend> {
    DeltaNet {
        conv: B::Tensor,
        recurrent: B::Tensor,
        /// The PLE block's conv state, on a layer that has one.
        ple_conv: Option<B::Tensor>,
    },
    Attention {
        /// Shared with the sequence's prompt-cache snapshots, which keep a prefix of it
        /// ([`Snapshot`]).
        kv: SharedKv<B>,
        /// The QSA indexer's keys, on a layer that has one.
        index: Option<IndexKeys<B>>,
    },
}

/// Everything one sequence carries between forward calls: per-layer conv and recurrent
/// states, KV caches, and the tokens consumed so far. [`SequenceState::snapshot`] keeps a
/// copy to continue from later.
pub struct SequenceState<B: Backend> {
    layers: Vec<LayerState<B>>,
    /// Tokens already processed, in order.
    pub tokens: Vec<u32>,
    /// The images placed in the sequence ([`Model::place_images`]), in order: those run
    /// give later tokens their positions, those not yet run their rows too.
    images: Vec<PlacedImage>,
    /// The route source's state ([`RouteSource::new_state`]): the synthetic routing
    /// model's, when the model has one.
    routing: Option<RoutingState>,
    /// Set while a forward call runs: a call that failed part-way leaves some layers
    /// advanced and others not, so the state must not be used again.
    broken: bool,
    /// This sequence appends to its KV caches, which snapshots may share.
    writer: Writer,
    /// The MTP head's cache and the hidden rows it has not run yet, on a sequence that
    /// drafts ([`Model::new_drafting_state`]).
    mtp: Option<MtpState<B>>,
}

impl<B: Backend> SequenceState<B> {
    /// The rotary position the next text token takes: the token count, plus what each
    /// image run so far adds (`max(h, w)` positions for its `t h w` tokens, as
    /// transformers' `get_rope_index`).
    pub fn next_position(&self) -> usize {
        images::next_position(&self.images, self.tokens.len())
    }

    /// Whether the sequence has images placed (run or about to be).
    pub fn has_images(&self) -> bool {
        !self.images.is_empty()
    }

    /// Keeps the QSA indexer's key selection of every later forward call, for
    /// inspection (see [`SequenceState::qsa_selections`]). Costs a bit per query and key.
    pub fn keep_qsa_selections(&mut self) {
        for layer in &mut self.layers {
            if let LayerState::Attention {
                index: Some(keys), ..
            } = layer
            {
                keys.selections.get_or_insert_with(Vec::new);
            }
        }
    }

    /// The kept QSA selections by layer (layers with an indexer): one [`KeyMask`] per
    /// forward pass (per chunk of a long input), whose rows are its queries and whose keys
    /// are the positions up to its last query; every causal key is kept while the context
    /// is within the indexer's budget.
    pub fn qsa_selections(&self) -> Vec<(usize, &[KeyMask])> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(i, layer)| match layer {
                LayerState::Attention {
                    index: Some(keys), ..
                } => keys.selections.as_deref().map(|s| (i, s)),
                _ => None,
            })
            .collect()
    }
}

/// One chunk's way through the layers.
struct Pass<B: Backend> {
    /// The residual stream `[tokens, residual width]`.
    h: B::Tensor,
    /// The next block's input when the residual add before it also normed it.
    normed: Option<B::Tensor>,
}

impl<B: Backend> Pass<B> {
    /// Takes an MLP block's output (as [`moe::Moe::forward`] returns it): with hyper-connections
    /// (`inject`) the block's output, added per stream; else the residual sum and
    /// perhaps the next block's input.
    fn mlp_done(
        &mut self,
        backend: &B,
        (out, normed): (B::Tensor, Option<B::Tensor>),
        inject: Option<B::Tensor>,
    ) {
        (self.h, self.normed) = match &inject {
            Some(inject) => (backend.hyper_inject(&self.h, &out, inject), None),
            None => (out, normed),
        };
    }
}

/// A PLE layer's n-gram rows being read: `[tokens, width]` f32 ([`NgramTable::embed`]).
type RowsRead<'scope> = std::thread::ScopedJoinHandle<'scope, Result<Vec<f32>>>;

/// Which positions' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// `[T, vocab]`, for scoring.
    All,
    /// `[1, vocab]` for the last position, for generation.
    Last,
}

impl<B: Backend> Model<B> {
    /// Loads every non-expert weight onto `backend` and indexes the expert records.
    /// Errors: any missing or mis-shaped tensor, named.
    ///
    /// Flash-Next's `1 + w` norms are taken as centered or folded by
    /// [`NormConvention::detect`], unless `SLOTSTREAM_NORMS` says which.
    pub fn load(ckpt: &Checkpoint, backend: &B) -> Result<Self> {
        let l = Loader::new(ckpt, backend)?;
        let cfg = l.cfg;
        let embed = l.linear(
            &cfg.name("model.embed_tokens"),
            cfg.vocab_size,
            cfg.hidden_size,
        )?;
        let head = Head::load(&l)?;
        // The same regrouping serves every DeltaNet layer.
        let fused_rows = FusedRows::new(cfg);
        let layers = (cfg.layer_kinds.iter().enumerate())
            .map(|(i, &kind)| Layer::load(&l, i, kind, &fused_rows))
            .collect::<Result<Vec<_>>>()?;
        check_layer_count(ckpt)?;
        let experts = ExpertIndex::build(ckpt)?;
        let tile = cfg.flash_next.as_ref().map(|x| {
            let idx: Vec<u32> = (0..x.hc_count)
                .flat_map(|_| 0..cfg.hidden_size as u32)
                .collect();
            backend.upload_index(&idx)
        });
        let routes = match open_routing(ckpt)? {
            Some(model) => RouteSource::Synthetic(model),
            None => RouteSource::Router,
        };
        Ok(Model {
            context: cfg.max_position_embeddings.unwrap_or(usize::MAX),
            config: cfg.clone(),
            experts,
            routes,
            norms: l.norms,
            embed,
            head,
            layers,
            tile,
            mtp: None,
        })
    }

    /// The most tokens, prompt and generated, one sequence may hold: the config's
    /// `max_position_embeddings` (unbounded without one) unless [`Model::set_context`]
    /// lowered it. `generate::generate` stops there.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Bounds sequences at `requested` tokens, at most the model's own
    /// ([`crate::context::limit`]); returns the context in effect.
    pub fn set_context(&mut self, requested: usize) -> usize {
        self.context = crate::context::limit(requested, &self.config);
        self.context
    }

    /// The PLE layers' n-gram tables (for their counters: [`crate::ngram::total`]).
    pub fn ngram_tables(&self) -> Vec<Arc<NgramTable>> {
        self.layers
            .iter()
            .filter_map(|l| l.ple.as_ref())
            .map(|ple| ple.table.clone())
            .collect()
    }

    /// A fresh sequence: zero conv and recurrent states, empty KV caches.
    pub fn new_state(&self, backend: &B) -> SequenceState<B> {
        let cfg = &self.config;
        let ple = cfg.flash_next.as_ref().and_then(|x| x.ple.as_ref());
        let layers = cfg
            .layer_kinds
            .iter()
            .zip(&self.layers)
            .map(|(kind, layer)| match kind {
                LayerKind::LinearAttention => LayerState::DeltaNet {
                    conv: backend.zeros(cfg.linear_conv_kernel_dim - 1, cfg.conv_dim()),
                    recurrent: backend.zeros(
                        cfg.linear_num_value_heads,
                        cfg.linear_value_head_dim * cfg.linear_key_head_dim,
                    ),
                    ple_conv: match (&layer.ple, ple) {
                        (Some(_), Some(c)) => {
                            Some(backend.zeros(c.conv_state_rows(), cfg.residual_width()))
                        }
                        _ => None,
                    },
                },
                LayerKind::FullAttention => LayerState::Attention {
                    kv: Arc::new(Mutex::new(
                        backend.new_kv_cache(cfg.num_key_value_heads * cfg.head_dim),
                    )),
                    index: match &layer.mixer {
                        Mixer::Attention(Attention {
                            indexer: Some(_), ..
                        }) => Some(IndexKeys {
                            pending: Vec::new(),
                            raw: Vec::new(),
                            pooled: Vec::new(),
                            selections: None,
                        }),
                        _ => None,
                    },
                },
            })
            .collect();
        SequenceState {
            layers,
            tokens: Vec::new(),
            images: Vec::new(),
            routing: self.routes.new_state(),
            broken: false,
            writer: Writer::new_line(),
            mtp: None,
        }
    }

    /// Places `images` in `state` over the image placeholder tokens (`image_token_id`) of
    /// `ids`, the tokens the next [`Model::forward`] calls run, in order: those calls
    /// then take each image's rows in place of its placeholders' embeddings, and give its
    /// tokens and every later one their multimodal positions ([`images`]).
    ///
    /// Errors ([`Error::InvalidInput`]): a model without a vision tower or without
    /// `mrope_section`, placeholder runs that do not hold the images' token counts, an
    /// image whose rows are not `tokens x hidden_size`.
    pub fn place_images(
        &self,
        state: &mut SequenceState<B>,
        ids: &[u32],
        images: &[ImageEmbedding],
    ) -> Result<()> {
        if images.is_empty() {
            return Ok(());
        }
        let cfg = &self.config;
        let (Some(vision), Some(_)) = (&cfg.vision, &cfg.mrope) else {
            return Err(Error::InvalidInput(
                "this model takes no images: its config has no vision_config (or no mrope_section)"
                    .into(),
            ));
        };
        let len = state.tokens.len();
        let placed = images::place(ids, len, vision.image_token_id, cfg.hidden_size, images)?;
        state.images.retain(|img| img.at < len);
        state.images.extend(placed);
        Ok(())
    }

    /// Where `images` lie among `ids` (a sequence's first tokens), as
    /// [`Model::place_images`] would place them. Errors: as [`Model::place_images`].
    pub fn image_spans(&self, ids: &[u32], images: &[ImageEmbedding]) -> Result<Vec<ImageSpan>> {
        let mut state = SequenceState::<B> {
            layers: Vec::new(),
            tokens: Vec::new(),
            images: Vec::new(),
            routing: None,
            broken: false,
            writer: Writer::new_line(),
            mtp: None,
        };
        self.place_images(&mut state, ids, images)?;
        Ok(state.images.iter().map(PlacedImage::span).collect())
    }

    /// Runs `ids` through the model after the tokens already in `state`, updating it.
    /// Returns row-major logits, `[ids.len(), vocab]` or `[1, vocab]` (see [`Logits`]).
    /// Long inputs run in chunks of [`Model::prefill_chunk`] tokens, which bounds
    /// workspaces and per-dispatch sizes; the result is the same as one pass (the model
    /// is causal).
    ///
    /// Chunk by chunk (every layer for one chunk, then the next chunk), unless the input
    /// is longer than a chunk and `experts` streams ([`ExpertSource::streams`]: it cannot
    /// hold every record): then layer by layer, every chunk through one layer before the
    /// next, so that each layer's routed records are fetched once for the whole call
    /// rather than once per chunk (a pool reads them in one sweep, and the next MoE
    /// layer's while this one computes). That holds every chunk's hidden state between
    /// layers (`[ids.len(), residual width]` f32, twice: the residual and the next block's
    /// normed input; the plan's `prompt_states`). The mixers still see the chunks in
    /// order, so every state advances as chunk by chunk, and the output is identical.
    /// [`Model::prefill_piece`] says how long a caller's pieces of a prompt should be.
    ///
    /// Errors: empty input, a token id beyond the vocabulary, a failure of `experts`, or a
    /// state left inconsistent by an earlier failed call (start a new sequence).
    pub fn forward<E: ExpertSource>(
        &self,
        backend: &B,
        state: &mut SequenceState<B>,
        ids: &[u32],
        experts: &E,
        which: Logits,
    ) -> Result<Vec<f32>> {
        self.forward_with_progress(backend, state, ids, experts, which, &mut |_| {})
    }

    /// [`Model::forward`], telling `progress` how many of `ids`' tokens' worth of work is
    /// done: after each chunk chunk by chunk, after each layer layer by layer (`ids.len()`
    /// times the share of the layers done, rounded down), so that a long prompt's progress
    /// display moves in either order. Errors: as [`Model::forward`].
    pub fn forward_with_progress<E: ExpertSource>(
        &self,
        backend: &B,
        state: &mut SequenceState<B>,
        ids: &[u32],
        experts: &E,
        which: Logits,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(Error::InvalidInput("no tokens to run".into()));
        }
        if let Some(&bad) = ids
            .iter()
            .find(|&&id| id as usize >= self.config.vocab_size)
        {
            return Err(Error::InvalidInput(format!(
                "token id {bad} is out of range for a vocabulary of {}",
                self.config.vocab_size
            )));
        }
        if state.broken {
            return Err(Error::InvalidInput(
                "this sequence's state is inconsistent after a failed forward pass; start a new sequence".into(),
            ));
        }
        state.broken = true;
        let chunks: Vec<&[u32]> = ids.chunks(self.prefill_chunk(backend, which)).collect();
        let out = if chunks.len() > 1 && experts.streams() {
            self.forward_layers(backend, state, &chunks, experts, which, progress)?
        } else {
            let (mut out, mut done) = (Vec::new(), 0);
            for (n, chunk) in chunks.iter().enumerate() {
                let last = n + 1 == chunks.len();
                let want = match which {
                    Logits::All => Some(Logits::All),
                    Logits::Last if last => Some(Logits::Last),
                    Logits::Last => None,
                };
                out.extend(self.forward_chunk(backend, state, chunk, experts, want)?);
                done += chunk.len();
                progress(done);
            }
            out
        };
        state.broken = false;
        Ok(out)
    }

    /// Tokens per pass of a long input on `backend` ([`Backend::prefill_chunk`] for this
    /// model's widest activation row and top-k).
    pub fn prefill_chunk(&self, backend: &B, which: Logits) -> usize {
        crate::backend::prefill_chunk(backend, &self.config, which == Logits::All)
    }

    /// The most prompt tokens a caller should hand one [`Model::forward`] call between its
    /// own stops (prompt-cache snapshots): one [`Model::prefill_chunk`] when `experts`
    /// holds every record (a cancelled prompt then stops within a chunk), unbounded when it
    /// streams, so that the call runs layer by layer and reads each routed record once.
    pub fn prefill_piece<E: ExpertSource>(&self, backend: &B, experts: &E) -> usize {
        if experts.streams() {
            usize::MAX
        } else {
            self.prefill_chunk(backend, Logits::Last)
        }
    }

    /// One chunk of [`Model::forward`], every layer; `which: None` skips the head.
    fn forward_chunk<E: ExpertSource>(
        &self,
        backend: &B,
        state: &mut SequenceState<B>,
        ids: &[u32],
        experts: &E,
        which: Option<Logits>,
    ) -> Result<Vec<f32>> {
        let cfg = &self.config;
        experts.begin_step();
        // Where this chunk starts in its sequence (synthetic routing is per position).
        let start = state.tokens.len() as u64;
        let positions = images::positions(&state.images, start as usize, ids.len());
        let mut pass = self.embed_pass(backend, ids, &state.images, start as usize)?;
        let history = &state.tokens;
        let layer_states = &mut state.layers;
        let routing_state = state.routing.as_mut();
        let mut hold = StepHold::new(backend);
        let h = std::thread::scope(|scope| -> Result<B::Tensor> {
            let mut rows = self.read_rows(scope, history, ids, experts);
            // A long chunk reads its experts outside the pool: guesses would only churn it.
            let lookahead = experts.lookahead() && ids.len() < SWEEP_MIN_TOKENS;
            let mut routes = self.routes.step(
                scope,
                routing_state,
                cfg.moe_layers(),
                (start, ids),
                lookahead,
            )?;
            for (i, (layer, st)) in self.layers.iter().zip(layer_states.iter_mut()).enumerate() {
                let at = positions.as_deref();
                let (x, inject) =
                    self.mixer_block(backend, i, st, &mut pass, rows[i].take(), at)?;
                if lookahead {
                    self.lookahead(backend, i + 2, &pass.h, experts, &mut routes)?;
                }
                let then = self.mlp_then(i, &pass.h, &inject);
                let out = match &layer.mlp {
                    Mlp::Moe(w) => {
                        let layout = &self.experts.layout;
                        let (routes, hold) = (&mut routes, &mut hold);
                        w.forward(backend, cfg, layout, i, &x, routes, experts, hold, then)?
                    }
                    Mlp::Dense(w) => ResidualAdd::apply_to(then, backend, w.forward(backend, &x)),
                };
                pass.mlp_done(backend, out, inject);
            }
            Ok(pass.h)
        })?;
        state.tokens.extend_from_slice(ids);
        let behind = state.mtp.as_mut().map(|m| &mut m.behind);
        self.finish(backend, hold, &h, which, experts, behind)
    }

    /// [`Model::forward`] layer by layer over `chunks` (at least two), each layer's routed
    /// records fetched once for all of them ([`moe::Moe::route_on_host`]); the source streams,
    /// so no layer is routed on the device. The chunks run through each mixer in order,
    /// and the synthetic route source routes the whole call at once (token by token, as
    /// chunk by chunk would), so every state ends as [`Model::forward_chunk`] over each
    /// chunk would leave it. No lookahead: the sweeps read whole layers, and the next
    /// layer's ahead.
    fn forward_layers<E: ExpertSource>(
        &self,
        backend: &B,
        state: &mut SequenceState<B>,
        chunks: &[&[u32]],
        experts: &E,
        which: Logits,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Vec<f32>> {
        let cfg = &self.config;
        experts.begin_step();
        let ids = chunks.concat();
        let start = state.tokens.len() as u64;
        // Each chunk's history for the n-gram rows: the sequence, then the chunks before it.
        let mut histories = Vec::with_capacity(chunks.len());
        if self.layers.iter().any(|l| l.ple.is_some()) {
            let mut history = state.tokens.clone();
            for chunk in chunks {
                histories.push(history.clone());
                history.extend_from_slice(chunk);
            }
        }
        // Each chunk's first sequence index, its embeddings and positions.
        let firsts: Vec<usize> = chunks
            .iter()
            .scan(start as usize, |at, c| {
                *at += c.len();
                Some(*at - c.len())
            })
            .collect();
        let positions: Vec<_> = (chunks.iter().zip(&firsts))
            .map(|(c, &at)| images::positions(&state.images, at, c.len()))
            .collect();
        let mut passes = (chunks.iter().zip(&firsts))
            .map(|(chunk, &at)| self.embed_pass(backend, chunk, &state.images, at))
            .collect::<Result<Vec<_>>>()?;
        let layer_states = &mut state.layers;
        let routing_state = state.routing.as_mut();
        let mut hold = StepHold::new(backend);
        let layout = &self.experts.layout;
        let passes = std::thread::scope(|scope| -> Result<Vec<Pass<B>>> {
            let mut rows: Vec<_> = chunks
                .iter()
                .enumerate()
                .map(|(c, chunk)| {
                    let history = histories.get(c).map_or(&[][..], Vec::as_slice);
                    self.read_rows(scope, history, chunk, experts)
                })
                .collect();
            let moe_layers = cfg.moe_layers();
            let mut routes =
                self.routes
                    .step(scope, routing_state, moe_layers, (start, &ids), false)?;
            for (i, (layer, st)) in self.layers.iter().zip(layer_states.iter_mut()).enumerate() {
                let mut inputs = Vec::with_capacity(passes.len());
                for ((pass, rows), at) in passes.iter_mut().zip(&mut rows).zip(&positions) {
                    let at = at.as_deref();
                    inputs.push(self.mixer_block(backend, i, st, pass, rows[i].take(), at)?);
                }
                // Each chunk's input is dropped once its block is done, and its output
                // replaces its residual at once: the pass holds about two hidden states a
                // token (the plan's `prompt_states`).
                match &layer.mlp {
                    Mlp::Moe(w) => {
                        let xs: Vec<&B::Tensor> = inputs.iter().map(|(x, _)| x).collect();
                        let (routes, hold) = (&mut routes, &mut hold);
                        let routed =
                            w.route_on_host(backend, cfg, i, &xs, routes, experts, hold)?;
                        for (c, (pass, (x, inject))) in passes.iter_mut().zip(inputs).enumerate() {
                            let then = self.mlp_then(i, &pass.h, &inject);
                            let out = w.experts_on_host(backend, layout, &x, &routed, c, then);
                            pass.mlp_done(backend, out, inject);
                        }
                    }
                    Mlp::Dense(w) => {
                        for (pass, (x, inject)) in passes.iter_mut().zip(inputs) {
                            let then = self.mlp_then(i, &pass.h, &inject);
                            let out = ResidualAdd::apply_to(then, backend, w.forward(backend, &x));
                            pass.mlp_done(backend, out, inject);
                        }
                    }
                }
                progress(ids.len() * (i + 1) / self.layers.len());
            }
            Ok(passes)
        })?;
        state.tokens.extend_from_slice(&ids);
        let mut out = Vec::new();
        let Some((last, earlier)) = passes.split_last() else {
            return Err(Error::Internal("a layer-major pass of no chunks".into()));
        };
        let mut behind = state.mtp.as_mut().map(|m| &mut m.behind);
        for pass in earlier {
            let drafting = behind.is_some();
            if which == Logits::All || drafting {
                let y = self.head.norm(backend, cfg, &pass.h);
                if which == Logits::All {
                    out.extend(backend.download(&self.head.logits(backend, &y, &self.embed))?);
                }
                if let Some(behind) = behind.as_mut() {
                    behind.push(y);
                }
            }
        }
        out.extend(self.finish(backend, hold, &last.h, Some(which), experts, behind)?);
        Ok(out)
    }

    /// The PLE layers' n-gram rows of `ids` after `history`, each read on a thread of
    /// `scope` while the layers before it run (they depend only on the token ids); `None`
    /// for a layer without PLE.
    fn read_rows<'scope, 'env, E: ExpertSource>(
        &'env self,
        scope: &'scope std::thread::Scope<'scope, 'env>,
        history: &'env [u32],
        ids: &'env [u32],
        experts: &'env E,
    ) -> Vec<Option<RowsRead<'scope>>> {
        self.layers
            .iter()
            .map(|l| {
                l.ple
                    .as_ref()
                    .map(|ple| scope.spawn(|| ple.table.embed(history, ids, experts)))
            })
            .collect()
    }

    /// The embedding of `ids`, the sequence's tokens from index `first`, the start of their
    /// pass (copied into every residual stream with hyper-connections); the rows of
    /// `images`' tokens among them are the images'. Errors: a failed read-back.
    fn embed_pass(
        &self,
        backend: &B,
        ids: &[u32],
        images: &[PlacedImage],
        first: usize,
    ) -> Result<Pass<B>> {
        let mut embedded = backend.embed(&self.embed, ids)?;
        if images::overlaps(images, first, ids.len()) {
            // Rare (a chunk holding image tokens) and small beside the tower's own work:
            // the rows are replaced on the host.
            let width = self.config.hidden_size;
            let mut rows = backend.download(&embedded)?;
            images::splice(images, first, width, &mut rows);
            embedded = backend.upload(&rows, ids.len(), width);
        }
        let h = match &self.tile {
            Some(tile) => backend.gather_columns(&embedded, tile),
            None => embedded,
        };
        Ok(Pass { h, normed: None })
    }

    /// Layer `i`'s PLE block (on its n-gram `rows`), token mixer (advancing its state
    /// `st`; an attention layer rotates by `positions`, the pass's multimodal positions,
    /// when the sequence has images) and the residual add after it, on `pass`; returns the
    /// MLP block's input and, with hyper-connections, its inject logits. Errors: the
    /// mixer's, or a failed n-gram read.
    fn mixer_block(
        &self,
        backend: &B,
        i: usize,
        st: &mut LayerState<B>,
        pass: &mut Pass<B>,
        rows: Option<RowsRead<'_>>,
        positions: Option<&[[usize; 3]]>,
    ) -> Result<(B::Tensor, Option<B::Tensor>)> {
        let (cfg, layer) = (&self.config, &self.layers[i]);
        if let (Some(ple), Some(job)) = (&layer.ple, rows) {
            let e = job
                .join()
                .map_err(|_| Error::Internal("the n-gram row reader panicked".into()))??;
            let LayerState::DeltaNet {
                ple_conv: Some(conv),
                ..
            } = st
            else {
                unreachable!("a PLE layer's state has a PLE conv state")
            };
            pass.h = ple.forward(backend, cfg, &pass.h, &e, conv);
        }
        let (x, inject) = match pass.normed.take() {
            Some(x) => (x, None),
            None => layer.residual.input(backend, cfg, Block::Mixer, &pass.h),
        };
        let r = match (&layer.mixer, st) {
            (
                Mixer::DeltaNet(w),
                LayerState::DeltaNet {
                    conv, recurrent, ..
                },
            ) => w.forward(backend, cfg, &x, conv, recurrent),
            (Mixer::Attention(w), LayerState::Attention { kv, index }) => w.forward(
                backend,
                cfg,
                &x,
                &mut lock_kv(kv),
                index.as_mut(),
                positions,
            )?,
            _ => unreachable!("state layout follows the model's layer kinds"),
        };
        let post = layer.residual.pre_norm(Block::Mlp);
        let eps = cfg.rms_norm_eps;
        (pass.h, pass.normed) = residual::add(backend, eps, &pass.h, &r, inject.as_ref(), post);
        Ok(match pass.normed.take() {
            Some(x) => (x, None),
            None => layer.residual.input(backend, cfg, Block::Mlp, &pass.h),
        })
    }

    /// What layer `i`'s MLP block adds its output to, `h`, and the next block's pre-norm
    /// when the block can norm the sum for it in its own last pass; `None` with
    /// hyper-connections (`inject`), whose output is added per stream.
    fn mlp_then<'a>(
        &'a self,
        i: usize,
        h: &'a B::Tensor,
        inject: &Option<B::Tensor>,
    ) -> Option<ResidualAdd<'a, B::Tensor>> {
        let next = self.layers.get(i + 1).filter(|l| l.ple.is_none());
        let input = next.and_then(|l| l.residual.pre_norm(Block::Mixer));
        inject.is_none().then_some(ResidualAdd {
            h,
            norm: input.map(|w| (w, self.config.rms_norm_eps)),
        })
    }

    /// The end of a pass: its head (`which: None`: none, only a wait for its work), the
    /// step's read-back (`hold`: the records released after it, the device-routed
    /// lookups counted) of the last chunk's residual stream `h`, `[tokens, residual width]`.
    fn finish<'e, E: ExpertSource>(
        &self,
        backend: &B,
        hold: StepHold<'e, B>,
        h: &B::Tensor,
        which: Option<Logits>,
        experts: &'e E,
        behind: Option<&mut Vec<B::Tensor>>,
    ) -> Result<Vec<f32>> {
        let cfg = &self.config;
        let tokens = backend.shape(h).0;
        // A drafting sequence keeps every row's final hidden state for the MTP head.
        let hidden = behind.is_some().then(|| self.head.norm(backend, cfg, h));
        let out = match which {
            // Wait for the chunk's work before its last layer's records are released.
            None => backend.rows(hidden.as_ref().unwrap_or(h), 0, 1),
            Some(Logits::Last) => {
                let y = match &hidden {
                    Some(y) => backend.rows(y, tokens - 1, 1),
                    None => self
                        .head
                        .norm(backend, cfg, &backend.rows(h, tokens - 1, 1)),
                };
                self.head.logits(backend, &y, &self.embed)
            }
            Some(Logits::All) => {
                let normed;
                let y = match &hidden {
                    Some(y) => y,
                    None => {
                        normed = self.head.norm(backend, cfg, h);
                        &normed
                    }
                };
                self.head.logits(backend, y, &self.embed)
            }
        };
        if let (Some(behind), Some(y)) = (behind, hidden) {
            behind.push(y);
        }
        // The read-back waits for all recorded work and releases the step's records.
        let (values, routed_layers) = hold.read_back(&out)?;
        let mut values = values.into_iter();
        let logits = values.next().unwrap_or_default();
        for (layer, routing) in routed_layers.into_iter().zip(values) {
            let routing = Routing::from_device(&routing, cfg.num_experts_per_tok, cfg.num_experts)?;
            experts.count_lookups(layer, &routing.distinct());
        }
        Ok(if which.is_some() { logits } else { Vec::new() })
    }

    /// Lookahead: the route source guesses the experts layer `target` will route to (the
    /// layer's router on the current hidden state, or a synthetic model's forecast), and
    /// the source starts reading them. Guesses change only what is read ahead, never what
    /// is computed.
    fn lookahead<E: ExpertSource>(
        &self,
        backend: &B,
        target: usize,
        h: &B::Tensor,
        experts: &E,
        routes: &mut StepSource,
    ) -> Result<()> {
        let Some(Layer {
            residual,
            mlp: Mlp::Moe(w),
            ..
        }) = self.layers.get(target)
        else {
            return Ok(());
        };
        let cfg = &self.config;
        let guess = routes.guess(target, || {
            let (x, _) = residual.input(backend, cfg, Block::Mlp, h);
            let logits = w.gates.first(backend, &x);
            let guess = backend.router_top_k(&logits, cfg.num_experts_per_tok, false)?;
            Ok(guess.distinct())
        })?;
        experts.prefetch(target, &guess);
        Ok(())
    }
}

/// Refuses a checkpoint with layers beyond the config's: a config that lists fewer layers
/// than the checkpoint holds would silently drop the rest (mlx-lm's strict load refuses
/// this too).
fn check_layer_count(ckpt: &Checkpoint) -> Result<()> {
    let cfg = &ckpt.config;
    let layers_prefix = cfg.name("model.layers.");
    match ckpt.tensors().find(|t| {
        t.name
            .strip_prefix(layers_prefix.as_str())
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|n| n >= cfg.num_hidden_layers)
    }) {
        Some(t) => Err(Error::bad_tensor(
            &t.name,
            format!(
                "belongs to a layer beyond num_hidden_layers = {} in config.json",
                cfg.num_hidden_layers
            ),
        )),
        None => Ok(()),
    }
}

/// The synthetic routing model of the checkpoint directory, if it has one (and the model
/// has MoE layers).
fn open_routing(ckpt: &Checkpoint) -> Result<Option<RoutingModel>> {
    let cfg = &ckpt.config;
    let routing = if cfg.moe_layers().is_empty() {
        None
    } else {
        RoutingModel::open(
            &ckpt.dir,
            cfg.num_hidden_layers,
            cfg.num_experts,
            cfg.num_experts_per_tok,
        )?
    };
    if let Some(r) = &routing {
        tracing::info!(
            file = %ckpt.dir.join(ROUTING_FILE).display(),
            active_experts = r.active_experts(),
            forecast_accuracy = r.params.forecast_accuracy,
            "synthetic routing active: routed expert ids come from the routing model, not the router"
        );
    }
    Ok(routing)
}
