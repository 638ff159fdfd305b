//! The Qwen3-Next / Qwen3.5-MoE forward pass, written once over [`Backend`].
//!
//! Follows mlx-lm 0.32.2 `mlx_lm/models/qwen3_next.py`, `qwen3_5.py` (which reuses
//! qwen3_next's attention, MLP, gated norm and MoE block) and `gated_delta.py`
//! (../shared/spec/models.md §2, §2.10). The families differ only in data chosen at load
//! time: tensor names ([`ModelConfig::name`]) and the gated DeltaNet's input projections
//! ([`DeltaNetProjections`]: fused and interleaved per key-head group, or split and
//! contiguous). Where the spec and mlx-lm differ, mlx-lm wins: q and k of the gated
//! DeltaNet are L2-normalized with eps 1e-6 added to `sum(x^2)` (`normalize_qk`), and norm
//! weights of an MLX checkpoint are used as stored.

use crate::backend::{AttnDims, Backend, DeltaDims};
use crate::checkpoint::{Checkpoint, ExpertIndex};
use crate::config::{DeltaNetProjections, LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::experts::{ExpertRecord, ExpertSource, HeldRecord};
use crate::routing_model::{RoutingModel, RoutingState, ROUTING_FILE};

/// The gated DeltaNet's input projections, as the checkpoint stores them.
enum InProj<B: Backend> {
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, interleaved per key-head group and
    /// taken apart by [`Columns`].
    Fused { qkvz: B::Weight, ba: B::Weight },
    /// Qwen3.5: `in_proj_qkv` gives the conv input `[q | k | v]` as is; z, b and a have
    /// projections of their own.
    Split {
        qkv: B::Weight,
        z: B::Weight,
        b: B::Weight,
        a: B::Weight,
    },
}

struct DeltaNet<B: Backend> {
    in_proj: InProj<B>,
    /// `[conv_dim, kernel]`.
    conv: B::Tensor,
    a_log: B::Tensor,
    dt_bias: B::Tensor,
    norm: B::Tensor,
    out_proj: B::Weight,
}

struct Attention<B: Backend> {
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    o_proj: B::Weight,
    q_norm: B::Tensor,
    k_norm: B::Tensor,
}

enum Mixer<B: Backend> {
    DeltaNet(DeltaNet<B>),
    Attention(Attention<B>),
}

struct DenseMlp<B: Backend> {
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
}

struct Moe<B: Backend> {
    router: B::Weight,
    shared: DenseMlp<B>,
    shared_gate: B::Weight,
}

enum Mlp<B: Backend> {
    Moe(Moe<B>),
    Dense(DenseMlp<B>),
}

struct Layer<B: Backend> {
    input_norm: B::Tensor,
    post_norm: B::Tensor,
    mixer: Mixer<B>,
    mlp: Mlp<B>,
}

/// Column selections that reorder fused projections (built once per model; the first
/// four serve [`InProj::Fused`] only).
struct Columns<B: Backend> {
    /// `in_proj_qkvz` output -> `[q_all | k_all | v_all]`, the conv input.
    mixed_qkv: B::Index,
    /// `in_proj_qkvz` output -> `z_all`.
    z: B::Index,
    /// `in_proj_ba` output -> `b_all` and `a_all`.
    b: B::Index,
    a: B::Index,
    /// Conv output -> q, k, v.
    conv_q: B::Index,
    conv_k: B::Index,
    conv_v: B::Index,
    /// `q_proj` output -> per-head queries and output gates.
    attn_q: B::Index,
    attn_gate: B::Index,
}

/// A loaded model: resident weights on backend `B` and the index of its expert records.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub experts: ExpertIndex,
    /// The synthetic routing model of the checkpoint directory ([`ROUTING_FILE`]), if it
    /// has one: it then picks the routed expert ids (the router's mixing weights stay).
    pub routing: Option<RoutingModel>,
    embed: B::Weight,
    lm_head: Option<B::Weight>,
    final_norm: B::Tensor,
    layers: Vec<Layer<B>>,
    columns: Columns<B>,
}

/// Recurrent and attention state of one layer for one sequence.
enum LayerState<B: Backend> {
    DeltaNet {
        conv: B::Tensor,
        recurrent: B::Tensor,
    },
    Attention {
        kv: B::KvCache,
    },
}

/// Everything one sequence carries between forward calls: per-layer conv and recurrent
/// states, KV caches, and the tokens consumed so far.
pub struct SequenceState<B: Backend> {
    layers: Vec<LayerState<B>>,
    /// Tokens already processed, in order.
    pub tokens: Vec<u32>,
    /// The synthetic routing model's state, when the model has one.
    routing: Option<RoutingState>,
    /// Set while a forward call runs: a call that failed part-way leaves some layers
    /// advanced and others not, so the state must not be used again.
    broken: bool,
}

/// Tokens per pass of a long input (see [`Model::forward`]).
pub const PREFILL_CHUNK: usize = 256;

/// Passes of at least this many tokens get their experts through
/// [`ExpertSource::fetch_prefill`] (read outside the pool) rather than the pool.
pub const SWEEP_MIN_TOKENS: usize = 32;

/// The tokens of a chunk as the MoE blocks see them: ids, where the chunk starts in its
/// sequence, and the sequence's synthetic routing state (when the model has a routing
/// model).
struct Tokens<'a> {
    ids: &'a [u32],
    start: u64,
    routing: Option<&'a mut RoutingState>,
}

/// Which positions' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// `[T, vocab]`, for scoring.
    All,
    /// `[1, vocab]` for the last position, for generation.
    Last,
}

fn range(start: usize, len: usize) -> impl Iterator<Item = u32> {
    (start as u32)..(start + len) as u32
}

impl<B: Backend> Model<B> {
    /// Loads every non-expert weight onto `backend` and indexes the expert records.
    /// Errors: any missing or mis-shaped tensor, named.
    pub fn load(ckpt: &Checkpoint, backend: &B) -> Result<Self> {
        let cfg = ckpt.config.clone();
        let d = cfg.hidden_size;
        let vector = |name: &str, len: usize| -> Result<B::Tensor> {
            Ok(backend.upload(&ckpt.floats(name, &[len])?, 1, len))
        };
        let linear = |name: &str, out: usize, inp: usize| -> Result<B::Weight> {
            backend.upload_weight(ckpt.linear(name, out, inp)?)
        };
        let embed = linear(&cfg.name("model.embed_tokens"), cfg.vocab_size, d)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(linear(&cfg.name("lm_head"), cfg.vocab_size, d)?)
        };
        let final_norm = vector(&cfg.name("model.norm.weight"), d)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, kind) in cfg.layer_kinds.iter().enumerate() {
            let p = cfg.name(&format!("model.layers.{i}"));
            let mixer = match kind {
                LayerKind::LinearAttention => {
                    let (kd, vd, nv) = (
                        cfg.linear_key_dim(),
                        cfg.linear_value_dim(),
                        cfg.linear_num_value_heads,
                    );
                    let (c, k) = (cfg.conv_dim(), cfg.linear_conv_kernel_dim);
                    let conv =
                        ckpt.floats(&format!("{p}.linear_attn.conv1d.weight"), &[c, k, 1])?;
                    let in_proj = match cfg.family.delta_net_projections() {
                        DeltaNetProjections::Fused => InProj::Fused {
                            qkvz: linear(
                                &format!("{p}.linear_attn.in_proj_qkvz"),
                                2 * kd + 2 * vd,
                                d,
                            )?,
                            ba: linear(&format!("{p}.linear_attn.in_proj_ba"), 2 * nv, d)?,
                        },
                        DeltaNetProjections::Split => InProj::Split {
                            qkv: linear(&format!("{p}.linear_attn.in_proj_qkv"), c, d)?,
                            z: linear(&format!("{p}.linear_attn.in_proj_z"), vd, d)?,
                            b: linear(&format!("{p}.linear_attn.in_proj_b"), nv, d)?,
                            a: linear(&format!("{p}.linear_attn.in_proj_a"), nv, d)?,
                        },
                    };
                    Mixer::DeltaNet(DeltaNet {
                        in_proj,
                        conv: backend.upload(&conv, c, k),
                        a_log: vector(&format!("{p}.linear_attn.A_log"), nv)?,
                        dt_bias: vector(&format!("{p}.linear_attn.dt_bias"), nv)?,
                        norm: vector(
                            &format!("{p}.linear_attn.norm.weight"),
                            cfg.linear_value_head_dim,
                        )?,
                        out_proj: linear(&format!("{p}.linear_attn.out_proj"), d, vd)?,
                    })
                }
                LayerKind::FullAttention => {
                    let (h, kvh, hd) = (
                        cfg.num_attention_heads,
                        cfg.num_key_value_heads,
                        cfg.head_dim,
                    );
                    Mixer::Attention(Attention {
                        q_proj: linear(&format!("{p}.self_attn.q_proj"), 2 * h * hd, d)?,
                        k_proj: linear(&format!("{p}.self_attn.k_proj"), kvh * hd, d)?,
                        v_proj: linear(&format!("{p}.self_attn.v_proj"), kvh * hd, d)?,
                        o_proj: linear(&format!("{p}.self_attn.o_proj"), d, h * hd)?,
                        q_norm: vector(&format!("{p}.self_attn.q_norm.weight"), hd)?,
                        k_norm: vector(&format!("{p}.self_attn.k_norm.weight"), hd)?,
                    })
                }
            };
            let dense = |prefix: &str, width: usize| -> Result<DenseMlp<B>> {
                Ok(DenseMlp {
                    gate: linear(&format!("{prefix}.gate_proj"), width, d)?,
                    up: linear(&format!("{prefix}.up_proj"), width, d)?,
                    down: linear(&format!("{prefix}.down_proj"), d, width)?,
                })
            };
            let mlp = if cfg.is_moe_layer(i) {
                Mlp::Moe(Moe {
                    router: linear(&format!("{p}.mlp.gate"), cfg.num_experts, d)?,
                    shared: dense(
                        &format!("{p}.mlp.shared_expert"),
                        cfg.shared_expert_intermediate_size,
                    )?,
                    shared_gate: linear(&format!("{p}.mlp.shared_expert_gate"), 1, d)?,
                })
            } else {
                Mlp::Dense(dense(&format!("{p}.mlp"), cfg.intermediate_size)?)
            };
            layers.push(Layer {
                input_norm: vector(&format!("{p}.input_layernorm.weight"), d)?,
                post_norm: vector(&format!("{p}.post_attention_layernorm.weight"), d)?,
                mixer,
                mlp,
            });
        }
        // A config that lists fewer layers than the checkpoint holds would silently drop
        // the rest (mlx-lm's strict load refuses this too).
        let layers_prefix = cfg.name("model.layers.");
        if let Some(t) = ckpt.tensors().find(|t| {
            t.name
                .strip_prefix(layers_prefix.as_str())
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse::<usize>().ok())
                .is_some_and(|n| n >= cfg.num_hidden_layers)
        }) {
            return Err(Error::bad_tensor(
                &t.name,
                format!(
                    "belongs to a layer beyond num_hidden_layers = {} in config.json",
                    cfg.num_hidden_layers
                ),
            ));
        }
        let experts = ExpertIndex::build(ckpt)?;
        let columns = Self::columns(&cfg, backend);
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
        Ok(Model {
            config: cfg,
            experts,
            routing,
            embed,
            lm_head,
            final_norm,
            layers,
            columns,
        })
    }

    /// The column selections of ../shared/spec/models.md §2.4 step 1 and §2.5.
    fn columns(cfg: &ModelConfig, backend: &B) -> Columns<B> {
        let (nk, dk, dv) = (
            cfg.linear_num_key_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        );
        let r = cfg.linear_num_value_heads / nk;
        // Each key-head group of in_proj_qkvz holds [q(dk) | k(dk) | v(r*dv) | z(r*dv)].
        let width = 2 * dk + 2 * r * dv;
        let per_group = |off: usize, len: usize| -> Vec<u32> {
            (0..nk).flat_map(|g| range(g * width + off, len)).collect()
        };
        let mut mixed = per_group(0, dk);
        mixed.extend(per_group(dk, dk));
        mixed.extend(per_group(2 * dk, r * dv));
        let z = per_group(2 * dk + r * dv, r * dv);
        // Each group of in_proj_ba holds [b(r) | a(r)].
        let b: Vec<u32> = (0..nk).flat_map(|g| range(g * 2 * r, r)).collect();
        let a: Vec<u32> = (0..nk).flat_map(|g| range(g * 2 * r + r, r)).collect();
        let kd = cfg.linear_key_dim();
        let (h, hd) = (cfg.num_attention_heads, cfg.head_dim);
        let attn_q: Vec<u32> = (0..h).flat_map(|i| range(i * 2 * hd, hd)).collect();
        let attn_gate: Vec<u32> = (0..h).flat_map(|i| range(i * 2 * hd + hd, hd)).collect();
        let conv_q: Vec<u32> = range(0, kd).collect();
        let conv_k: Vec<u32> = range(kd, kd).collect();
        let conv_v: Vec<u32> = range(2 * kd, cfg.linear_value_dim()).collect();
        Columns {
            mixed_qkv: backend.upload_index(&mixed),
            z: backend.upload_index(&z),
            b: backend.upload_index(&b),
            a: backend.upload_index(&a),
            conv_q: backend.upload_index(&conv_q),
            conv_k: backend.upload_index(&conv_k),
            conv_v: backend.upload_index(&conv_v),
            attn_q: backend.upload_index(&attn_q),
            attn_gate: backend.upload_index(&attn_gate),
        }
    }

    /// A fresh sequence: zero conv and recurrent states, empty KV caches.
    pub fn new_state(&self, backend: &B) -> SequenceState<B> {
        let cfg = &self.config;
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|kind| match kind {
                LayerKind::LinearAttention => LayerState::DeltaNet {
                    conv: backend.zeros(cfg.linear_conv_kernel_dim - 1, cfg.conv_dim()),
                    recurrent: backend.zeros(
                        cfg.linear_num_value_heads,
                        cfg.linear_value_head_dim * cfg.linear_key_head_dim,
                    ),
                },
                LayerKind::FullAttention => LayerState::Attention {
                    kv: backend.new_kv_cache(cfg.num_key_value_heads * cfg.head_dim),
                },
            })
            .collect();
        SequenceState {
            layers,
            tokens: Vec::new(),
            routing: self.routing.as_ref().map(RoutingModel::new_state),
            broken: false,
        }
    }

    /// Runs `ids` through the model after the tokens already in `state`, updating it.
    /// Returns row-major logits, `[ids.len(), vocab]` or `[1, vocab]` (see [`Logits`]).
    /// Long inputs run in chunks of [`PREFILL_CHUNK`] tokens, which bounds workspaces and
    /// per-dispatch sizes; the result is the same as one pass (the model is causal).
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
        let mut out = Vec::new();
        let chunks: Vec<&[u32]> = ids.chunks(PREFILL_CHUNK).collect();
        for (n, chunk) in chunks.iter().enumerate() {
            let last = n + 1 == chunks.len();
            let want = match which {
                Logits::All => Some(Logits::All),
                Logits::Last if last => Some(Logits::Last),
                Logits::Last => None,
            };
            out.extend(self.forward_chunk(backend, state, chunk, experts, want)?);
        }
        state.broken = false;
        Ok(out)
    }

    /// One chunk of [`Model::forward`]; `which: None` skips the head.
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
        let mut in_use = Vec::new();
        let mut h = backend.embed(&self.embed, ids)?;
        for (i, (layer, st)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            let x = backend.rms_norm(
                &h,
                Some(&layer.input_norm),
                cfg.hidden_size,
                cfg.rms_norm_eps,
                1.0,
            );
            let r = match (&layer.mixer, st) {
                (Mixer::DeltaNet(w), LayerState::DeltaNet { conv, recurrent }) => {
                    self.delta_net(backend, w, &x, conv, recurrent)
                }
                (Mixer::Attention(w), LayerState::Attention { kv }) => {
                    self.attention(backend, w, &x, kv)
                }
                _ => unreachable!("state layout follows the model's layer kinds"),
            };
            h = backend.add(&h, &r);
            // A long chunk reads its experts outside the pool: guesses would only churn it.
            if experts.lookahead() && ids.len() < SWEEP_MIN_TOKENS {
                let tokens = Tokens {
                    ids,
                    start,
                    routing: state.routing.as_mut(),
                };
                self.lookahead(backend, i + 2, &h, experts, tokens)?;
            }
            let x = backend.rms_norm(
                &h,
                Some(&layer.post_norm),
                cfg.hidden_size,
                cfg.rms_norm_eps,
                1.0,
            );
            let m = match &layer.mlp {
                Mlp::Moe(w) => {
                    let tokens = Tokens {
                        ids,
                        start,
                        routing: state.routing.as_mut(),
                    };
                    self.moe(backend, w, i, &x, tokens, experts, &mut in_use)?
                }
                Mlp::Dense(w) => Self::dense_mlp(backend, w, &x),
            };
            h = backend.add(&h, &m);
        }
        state.tokens.extend_from_slice(ids);
        let Some(which) = which else {
            // Wait for the chunk's work before its last layer's records are released.
            backend.download(&backend.rows(&h, 0, 1))?;
            return Ok(Vec::new());
        };
        if which == Logits::Last {
            h = backend.rows(&h, ids.len() - 1, 1);
        }
        let y = backend.rms_norm(
            &h,
            Some(&self.final_norm),
            cfg.hidden_size,
            cfg.rms_norm_eps,
            1.0,
        );
        let logits = backend.matmul(&y, self.lm_head.as_ref().unwrap_or(&self.embed));
        let logits = backend.download(&logits);
        // The read-back waited for all recorded work: the last layer's records are free.
        drop(in_use);
        logits
    }

    fn delta_net(
        &self,
        backend: &B,
        w: &DeltaNet<B>,
        x: &B::Tensor,
        conv_state: &mut B::Tensor,
        recurrent: &mut B::Tensor,
    ) -> B::Tensor {
        let cfg = &self.config;
        let c = &self.columns;
        let (mixed, z, b, a) = match &w.in_proj {
            InProj::Fused { qkvz, ba } => {
                let qkvz = backend.matmul(x, qkvz);
                let ba = backend.matmul(x, ba);
                (
                    backend.gather_columns(&qkvz, &c.mixed_qkv),
                    backend.gather_columns(&qkvz, &c.z),
                    backend.gather_columns(&ba, &c.b),
                    backend.gather_columns(&ba, &c.a),
                )
            }
            InProj::Split { qkv, z, b, a } => (
                backend.matmul(x, qkv),
                backend.matmul(x, z),
                backend.matmul(x, b),
                backend.matmul(x, a),
            ),
        };
        let conv = backend.causal_conv1d_silu(&mixed, &w.conv, conv_state);
        let dk = cfg.linear_key_head_dim;
        // mlx-lm normalize_qk: rms_norm with eps 1e-6/dk equals an L2 norm with eps 1e-6 on
        // sum(x^2); q is then scaled by 1/sqrt(dk) (so 1/dk on the rms-normalized value).
        let inv_scale = (dk as f64).powf(-0.5);
        let eps = (1e-6 * inv_scale * inv_scale) as f32;
        let q = backend.rms_norm(
            &backend.gather_columns(&conv, &c.conv_q),
            None,
            dk,
            eps,
            (inv_scale * inv_scale) as f32,
        );
        let k = backend.rms_norm(
            &backend.gather_columns(&conv, &c.conv_k),
            None,
            dk,
            eps,
            inv_scale as f32,
        );
        let v = backend.gather_columns(&conv, &c.conv_v);
        let dims = DeltaDims {
            key_heads: cfg.linear_num_key_heads,
            value_heads: cfg.linear_num_value_heads,
            key_dim: dk,
            value_dim: cfg.linear_value_head_dim,
        };
        let y = backend.gated_delta(&q, &k, &v, &a, &b, &w.a_log, &w.dt_bias, recurrent, dims);
        let o =
            backend.rms_norm_gated(&y, &z, &w.norm, cfg.linear_value_head_dim, cfg.rms_norm_eps);
        backend.matmul(&o, &w.out_proj)
    }

    fn attention(
        &self,
        backend: &B,
        w: &Attention<B>,
        x: &B::Tensor,
        kv: &mut B::KvCache,
    ) -> B::Tensor {
        let cfg = &self.config;
        let hd = cfg.head_dim;
        let qg = backend.matmul(x, &w.q_proj);
        let q = backend.gather_columns(&qg, &self.columns.attn_q);
        let gate = backend.gather_columns(&qg, &self.columns.attn_gate);
        let k = backend.matmul(x, &w.k_proj);
        let v = backend.matmul(x, &w.v_proj);
        let q = backend.rms_norm(&q, Some(&w.q_norm), hd, cfg.rms_norm_eps, 1.0);
        let k = backend.rms_norm(&k, Some(&w.k_norm), hd, cfg.rms_norm_eps, 1.0);
        let pos = backend.kv_len(kv);
        let q = backend.rope(&q, hd, cfg.rotary_dim, cfg.rope_theta, pos);
        let k = backend.rope(&k, hd, cfg.rotary_dim, cfg.rope_theta, pos);
        let dims = AttnDims {
            q_heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: hd,
            scale: (hd as f64).powf(-0.5) as f32,
        };
        let o = backend.attention(&q, &k, &v, kv, dims);
        backend.matmul(&backend.mul_sigmoid(&o, &gate), &w.o_proj)
    }

    fn dense_mlp(backend: &B, w: &DenseMlp<B>, x: &B::Tensor) -> B::Tensor {
        let h = backend.swiglu(&backend.matmul(x, &w.gate), &backend.matmul(x, &w.up));
        backend.matmul(&h, &w.down)
    }

    /// Lookahead: layer `target`'s router on the current hidden state guesses the experts
    /// that layer will route to, and the source starts reading them. With a synthetic
    /// routing model the guess is its forecast instead (the random router knows nothing of
    /// the ids the model will pick). Guesses change only what is read ahead, never what is
    /// computed.
    fn lookahead<E: ExpertSource>(
        &self,
        backend: &B,
        target: usize,
        h: &B::Tensor,
        experts: &E,
        tokens: Tokens<'_>,
    ) -> Result<()> {
        let Some(Layer {
            post_norm,
            mlp: Mlp::Moe(w),
            ..
        }) = self.layers.get(target)
        else {
            return Ok(());
        };
        if let (Some(model), Some(state)) = (&self.routing, tokens.routing) {
            experts.prefetch(
                target,
                &model.forecast(state, target, tokens.start, tokens.ids)?,
            );
            return Ok(());
        }
        let cfg = &self.config;
        let x = backend.rms_norm(h, Some(post_norm), cfg.hidden_size, cfg.rms_norm_eps, 1.0);
        let guess = backend.router_top_k(
            &backend.matmul(&x, &w.router),
            cfg.num_experts_per_tok,
            false,
        )?;
        experts.prefetch(target, &guess.distinct());
        Ok(())
    }

    /// The MoE block of `layer`. `in_use` holds the previous MoE layer's records: a
    /// backend may still be reading them (GPU work runs after it is recorded), so they stay
    /// pinned until this layer's routing read-back has waited for that work.
    #[allow(clippy::too_many_arguments)]
    fn moe<'e, E: ExpertSource>(
        &self,
        backend: &B,
        w: &Moe<B>,
        layer: usize,
        x: &B::Tensor,
        tokens: Tokens<'_>,
        experts: &'e E,
        in_use: &mut Vec<E::Record<'e>>,
    ) -> Result<B::Tensor> {
        let cfg = &self.config;
        let logits = backend.matmul(x, &w.router);
        let mut routing =
            backend.router_top_k(&logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)?;
        if let (Some(model), Some(state)) = (&self.routing, tokens.routing) {
            // The router's weights stay, rank by rank; the routing model picks the ids, one
            // position at a time in order (its state is per position).
            let k = routing.top_k;
            for ((t, &token), slot) in tokens.ids.iter().enumerate().zip(routing.ids.chunks_mut(k))
            {
                slot.copy_from_slice(&model.route(state, layer, tokens.start + t as u64, token)?);
            }
        }
        in_use.clear();
        let distinct = routing.distinct();
        let held = if routing.tokens() >= SWEEP_MIN_TOKENS {
            let mut uses = vec![0u32; distinct.len()];
            for id in &routing.ids {
                if let Ok(at) = distinct.binary_search(id) {
                    uses[at] += 1;
                }
            }
            experts.fetch_prefill(layer, &distinct, &uses)?
        } else {
            experts.fetch(layer, &distinct)?
        };
        let records: Vec<ExpertRecord<'_>> = routing
            .ids
            .iter()
            .map(|id| {
                let r = &held[distinct.binary_search(id).unwrap_or_default()];
                ExpertRecord {
                    bytes: r,
                    slot: r.slot(),
                }
            })
            .collect();
        let routed = backend.moe_experts(x, &routing, &records, &self.experts.layout);
        *in_use = held;
        let shared = Self::dense_mlp(backend, &w.shared, x);
        let shared = backend.mul_sigmoid(&shared, &backend.matmul(x, &w.shared_gate));
        Ok(backend.add(&routed, &shared))
    }
}
