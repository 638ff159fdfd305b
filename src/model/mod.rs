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
//!
//! Qwen3.8-Flash-Next (`qwen4_exp`) follows transformers 5.24 `modular_qwen4_exp.py`
//! (its reference; mlx-lm 0.32.2 lacks it): the residual is `hc_count` streams joined by
//! hyper-connections instead of pre-norms ([`Residual::Hyper`]), a hyper-connection mixer
//! replaces the final norm ([`Head::Mixer`]), attention layers restrict their keys with the
//! QSA indexer ([`Indexer`]), and layer 1 starts with the PLE block over hashed n-gram rows
//! read from the SSD ([`Ple`], [`NgramTable`]). Its zero-centered norms are applied as
//! `1 + w`; a checkpoint may store them centered (the Hugging Face release) or with the
//! `+1` folded in (MLX conversions): [`NormConvention`] tells them apart.

mod snapshot;

use std::sync::{Arc, Mutex};

use snapshot::{lock_kv, SharedKv, Writer};
pub use snapshot::{ImageTensor, Snapshot, StateImage};

use crate::backend::cpu::{dot, CpuBackend, CpuTensor};
use crate::backend::{
    distinct_ids, rope_table, rotate_half, AttnDims, Backend, DeltaDims, KeyMask, Routing,
    SharedExpert,
};
use crate::checkpoint::{Checkpoint, ExpertIndex, LinearWeight};
use crate::config::{DeltaNetProjections, IndexerConfig, LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::ngram::NgramTable;
use crate::records::{ExpertRecord, ExpertSource, HeldRecord, LayerRecords};
use crate::routing_model::{RoutingModel, RoutingState, StepRoutes, ROUTING_FILE};

/// Projections of one input, stacked into one weight at load when they are quantized
/// alike ([`LinearWeight::stack_losslessly`]), so that a step runs one matmul whose output
/// the backend splits ([`Backend::matmul_parts`]); otherwise (dense, or quantized
/// differently) kept apart as stored.
struct Projections<B: Backend, const N: usize> {
    /// The stacked weight, or one weight per projection.
    weights: Vec<B::Weight>,
    /// Each projection's output width.
    widths: [usize; N],
}

impl<B: Backend, const N: usize> Projections<B, N> {
    /// `parts` as (module name, weight); `upload` puts a weight on the backend, naming
    /// the module in its errors (the first part's for the stacked weight).
    fn new(
        parts: [(String, LinearWeight); N],
        upload: impl Fn(&str, LinearWeight) -> Result<B::Weight>,
    ) -> Result<Self> {
        let widths = parts.each_ref().map(|(_, w)| w.shape().0);
        let refs: Vec<&LinearWeight> = parts.iter().map(|(_, w)| w).collect();
        // Dense parts stay apart: only quantized weights have the one-dispatch path.
        let quantized = refs.iter().all(|w| matches!(w, LinearWeight::Quantized(_)));
        let weights = if N > 1 && quantized && LinearWeight::stack_losslessly(&refs) {
            let name = parts[0].0.clone();
            let stacked = LinearWeight::stack_rows(&name, parts.map(|(_, w)| w).into())?;
            vec![upload(&name, stacked)?]
        } else {
            parts
                .into_iter()
                .map(|(name, w)| upload(&name, w))
                .collect::<Result<_>>()?
        };
        Ok(Projections { weights, widths })
    }

    /// The first projection of `x` alone (with the others, which cost nothing more, when
    /// they are stacked).
    fn first(&self, backend: &B, x: &B::Tensor) -> B::Tensor {
        match self.weights.as_slice() {
            [w] if N > 1 => backend.matmul_parts(x, w, &self.widths).swap_remove(0),
            ws => backend.matmul(x, &ws[0]),
        }
    }

    /// Each projection of `x`, in order.
    fn apply(&self, backend: &B, x: &B::Tensor) -> [B::Tensor; N] {
        let out = match self.weights.as_slice() {
            [w] if N > 1 => backend.matmul_parts(x, w, &self.widths),
            ws => ws.iter().map(|w| backend.matmul(x, w)).collect(),
        };
        out.try_into()
            .unwrap_or_else(|v: Vec<_>| panic!("{} outputs for {N} projections", v.len()))
    }
}

/// A gated DeltaNet layer. Its input projections are regrouped at load: Qwen3-Next's
/// `in_proj_qkvz` and `in_proj_ba` interleave q, k, v, z (and b, a) per key-head group, and
/// Qwen3.5 / Flash-Next have separate `in_proj_b` and `in_proj_a`; here every family has
/// the same three, stacked where they can be, and a step gathers no columns.
struct DeltaNet<B: Backend> {
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

struct Attention<B: Backend> {
    /// The queries' rows of `q_proj` (`[H hd, hidden]`; the checkpoint interleaves each
    /// head's queries with its output gates), the output gates' rows of `q_proj`
    /// (`[H hd, hidden]`), `k_proj` and `v_proj`.
    qkv: Projections<B, 4>,
    o_proj: B::Weight,
    q_norm: B::Tensor,
    k_norm: B::Tensor,
    /// Flash-Next's QSA indexer.
    indexer: Option<Indexer<B>>,
}

/// The QSA indexer of one attention layer (transformers `Qwen4ExpTextQSAIndexer`).
struct Indexer<B: Backend> {
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

/// Flash-Next's hyper-connection (transformers `Qwen4ExpTextGatedResidual`).
struct HyperConnection<B: Backend> {
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
enum Residual<B: Backend> {
    /// Qwen3-Next / Qwen3.5: `h += block(rms_norm(h))` for the mixer and the MLP.
    PreNorm { input: B::Tensor, post: B::Tensor },
    /// Flash-Next: each block reads its hyper-connection's mix of the streams and is
    /// added back to every stream with a learned weight.
    Hyper {
        attn: HyperConnection<B>,
        mlp: HyperConnection<B>,
    },
}

/// Flash-Next's PLE block (transformers `Qwen4ExpTextPLELayer`).
struct Ple<B: Backend> {
    table: Arc<NgramTable>,
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

/// What comes before the LM head.
enum Head<B: Backend> {
    /// `model.norm`.
    Norm(B::Tensor),
    /// Flash-Next's `hyper_connection_mixer`.
    Mixer(HyperConnection<B>),
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

enum Mixer<B: Backend> {
    DeltaNet(DeltaNet<B>),
    Attention(Attention<B>),
}

/// A SwiGLU MLP (the shared expert, or a dense layer's MLP).
struct DenseMlp<B: Backend> {
    gate_up: GateUp<B>,
    down: B::Weight,
}

/// A SwiGLU MLP's gate and up projections.
enum GateUp<B: Backend> {
    /// Stacked at load, `[2 I, hidden]`, for [`Backend::matmul_swiglu`]'s one pass.
    Stacked(B::Weight),
    /// Quantized differently (a mixed-precision conversion): two matmuls, kept as stored
    /// rather than widened to f32 to be stacked.
    Separate { gate: B::Weight, up: B::Weight },
}

struct Moe<B: Backend> {
    /// The router (`mlp.gate`, `[E, hidden]`) and the shared expert's gate
    /// (`[1, hidden]`).
    gates: Projections<B, 2>,
    shared: DenseMlp<B>,
}

enum Mlp<B: Backend> {
    Moe(Moe<B>),
    Dense(DenseMlp<B>),
}

struct Layer<B: Backend> {
    residual: Residual<B>,
    /// Flash-Next's PLE block, run on the residual before this layer's mixer.
    ple: Option<Ple<B>>,
    mixer: Mixer<B>,
    mlp: Mlp<B>,
}

/// A loaded model: resident weights on backend `B` and the index of its expert records.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub experts: ExpertIndex,
    /// The synthetic routing model of the checkpoint directory ([`ROUTING_FILE`]), if it
    /// has one: it then picks the routed expert ids (the router's mixing weights stay).
    pub routing: Option<RoutingModel>,
    /// How the checkpoint stores its `1 + w` norms (Flash-Next only).
    pub norms: Option<NormConvention>,
    embed: B::Weight,
    lm_head: Option<B::Weight>,
    head: Head<B>,
    layers: Vec<Layer<B>>,
    /// Flash-Next: the columns that copy the embedding into its `hc_count` residual
    /// streams side by side.
    tile: Option<B::Index>,
    /// The most tokens one sequence may hold ([`Model::context`]).
    context: usize,
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

/// The QSA indexer's cache: one raw key per token (`[tokens, head_dim]`), and the pooled,
/// normalized and rotated keys of the complete blocks (`[blocks, head_dim]`).
struct IndexKeys<B: Backend> {
    /// Keys of the calls whose selection needed none yet; read back when one does.
    pending: Vec<B::Tensor>,
    raw: Vec<f32>,
    pooled: Vec<f32>,
    /// Each call's key selection, once [`SequenceState::keep_qsa_selections`] asked for it.
    selections: Option<Vec<KeyMask>>,
}

/// Everything one sequence carries between forward calls: per-layer conv and recurrent
/// states, KV caches, and the tokens consumed so far. [`SequenceState::snapshot`] keeps a
/// copy to continue from later.
pub struct SequenceState<B: Backend> {
    layers: Vec<LayerState<B>>,
    /// Tokens already processed, in order.
    pub tokens: Vec<u32>,
    /// The synthetic routing model's state, when the model has one.
    routing: Option<RoutingState>,
    /// Set while a forward call runs: a call that failed part-way leaves some layers
    /// advanced and others not, so the state must not be used again.
    broken: bool,
    /// This sequence appends to its KV caches, which snapshots may share.
    writer: Writer,
}

impl<B: Backend> SequenceState<B> {
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

/// Passes of at least this many tokens get their experts through
/// [`ExpertSource::fetch_prefill`] (read outside the pool) rather than the pool, unless
/// the pool holds every record (then every pass routes on the backend, see
/// [`Model::moe`], and counts its lookups as hits).
pub const SWEEP_MIN_TOKENS: usize = 32;

/// What a forward step holds until its final read-back has waited for the device.
struct StepHold<'e, B: Backend, E: ExpertSource + 'e> {
    /// The previous MoE layer's records (see [`Model::moe`]).
    in_use: Vec<E::Record<'e>>,
    /// Whole layers of records routed on the device ([`ExpertSource::resident_layer`]):
    /// nothing waits for the device until the step ends, so they stay held until then.
    layers: Vec<Box<dyn LayerRecords + 'e>>,
    /// Routings that stayed on the device, by MoE layer: their ids are read back with the
    /// logits and counted as lookups then.
    routings: Vec<(usize, B::Tensor)>,
}

/// The two blocks of a decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Block {
    /// The token mixer (gated DeltaNet or attention).
    Mixer,
    /// The MoE block (or dense MLP).
    Mlp,
}

/// Which positions' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// `[T, vocab]`, for scoring.
    All,
    /// `[1, vocab]` for the last position, for generation.
    Last,
}

/// Qwen3-Next's fused DeltaNet projections regrouped (../shared/spec/models.md §2.4
/// step 1): the rows of `in_proj_qkvz` that give `[q_all | k_all | v_all]` and `z_all`,
/// and those of `in_proj_ba` that give `[b_all | a_all]`.
struct FusedRows {
    qkv: Vec<usize>,
    z: Vec<usize>,
    ba: Vec<usize>,
}

impl FusedRows {
    fn new(cfg: &ModelConfig) -> Self {
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

impl<B: Backend> Model<B> {
    /// Loads every non-expert weight onto `backend` and indexes the expert records.
    /// Errors: any missing or mis-shaped tensor, named.
    ///
    /// Flash-Next's `1 + w` norms are taken as centered or folded by
    /// [`NormConvention::detect`], unless `SLOTSTREAM_NORMS` says which.
    pub fn load(ckpt: &Checkpoint, backend: &B) -> Result<Self> {
        let cfg = ckpt.config.clone();
        let d = cfg.hidden_size;
        let vector = |name: &str, len: usize| -> Result<B::Tensor> {
            Ok(backend.upload(&ckpt.floats(name, &[len])?, 1, len))
        };
        // A weight the backend cannot hold (past a GPU's binding limit) is named.
        let upload = |name: &str, w: LinearWeight| -> Result<B::Weight> {
            backend.upload_weight(w).map_err(|e| match e {
                Error::Gpu(m) => Error::Gpu(format!("`{name}`: {m}")),
                other => other,
            })
        };
        let linear = |name: &str, out: usize, inp: usize| -> Result<B::Weight> {
            upload(name, ckpt.linear(name, out, inp)?)
        };
        let norms = match &cfg.flash_next {
            Some(_) => Some(norm_convention(ckpt)?),
            None => None,
        };
        // A `1 + w` norm, as a plain multiplier.
        let centered = |name: &str, len: usize| -> Result<Vec<f32>> {
            let mut w = ckpt.floats(name, &[len])?;
            if norms == Some(NormConvention::Centered) {
                w.iter_mut().for_each(|v| *v += 1.0);
            }
            Ok(w)
        };
        let centered_vector = |name: &str, len: usize| -> Result<B::Tensor> {
            Ok(backend.upload(&centered(name, len)?, 1, len))
        };
        let width = cfg.residual_width();
        let hyper = |prefix: &str, inject: bool| -> Result<HyperConnection<B>> {
            let (streams, rank) = cfg
                .flash_next
                .as_ref()
                .map_or((1, 1), |x| (x.hc_count, x.hc_lowrank));
            Ok(HyperConnection {
                norm: centered_vector(&format!("{prefix}.hc_norm.weight"), width)?,
                down: linear(&format!("{prefix}.input_mix_weight_down"), rank, width)?,
                up: linear(&format!("{prefix}.input_mix_weight_up"), width, rank)?,
                inject: if inject {
                    Some(linear(
                        &format!("{prefix}.block_inject_weight"),
                        streams,
                        width,
                    )?)
                } else {
                    None
                },
            })
        };
        let embed = linear(&cfg.name("model.embed_tokens"), cfg.vocab_size, d)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(linear(&cfg.name("lm_head"), cfg.vocab_size, d)?)
        };
        let head = match &cfg.flash_next {
            Some(_) => Head::Mixer(hyper(&cfg.name("model.hyper_connection_mixer"), false)?),
            None => Head::Norm(vector(&cfg.name("model.norm.weight"), d)?),
        };
        let ple_cfg = cfg.flash_next.as_ref().and_then(|x| x.ple.as_ref());
        let indexer_cfg = cfg.flash_next.as_ref().and_then(|x| x.indexer.as_ref());
        // The same regrouping serves every DeltaNet layer.
        let fused_rows = FusedRows::new(&cfg);
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
                    let name = |m: &str| format!("{p}.linear_attn.{m}");
                    // The regrouped weights, and the modules they come from (for errors).
                    let (qkv, z, ba, [qkv_name, z_name, ba_name]) =
                        match cfg.family.delta_net_projections() {
                            DeltaNetProjections::Fused => {
                                let qkvz =
                                    ckpt.linear(&name("in_proj_qkvz"), 2 * kd + 2 * vd, d)?;
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
                    Mixer::DeltaNet(DeltaNet {
                        in_proj: Projections::new(
                            [
                                (name(qkv_name), qkv),
                                (name(z_name), z),
                                (name(ba_name), ba),
                            ],
                            upload,
                        )?,
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
                    let indexer = match indexer_cfg {
                        Some(ix) => {
                            let module = format!("{p}.self_attn.indexer.index_qk_proj");
                            let qk = ckpt.linear(&module, (ix.heads + 1) * ix.head_dim, d)?;
                            let queries = ix.heads * ix.head_dim;
                            let rows = |from: usize, n: usize| (from..from + n).collect::<Vec<_>>();
                            Some(Indexer {
                                q: upload(&module, qk.select_rows(&rows(0, queries)))?,
                                k: upload(&module, qk.select_rows(&rows(queries, ix.head_dim)))?,
                                q_norm: centered_vector(
                                    &format!("{p}.self_attn.indexer.q_layernorm.weight"),
                                    ix.head_dim,
                                )?,
                                k_norm: CpuBackend.upload(
                                    &centered(
                                        &format!("{p}.self_attn.indexer.k_layernorm.weight"),
                                        ix.head_dim,
                                    )?,
                                    1,
                                    ix.head_dim,
                                ),
                            })
                        }
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
                    Mixer::Attention(Attention {
                        qkv: Projections::new(
                            [
                                (q_name.clone(), q_proj.select_rows(&half(0))),
                                (q_name.clone(), q_proj.select_rows(&half(hd))),
                                (k_name.clone(), ckpt.linear(&k_name, kvh * hd, d)?),
                                (v_name.clone(), ckpt.linear(&v_name, kvh * hd, d)?),
                            ],
                            upload,
                        )?,
                        o_proj: linear(&format!("{p}.self_attn.o_proj"), d, h * hd)?,
                        q_norm: centered_vector(&format!("{p}.self_attn.q_norm.weight"), hd)?,
                        k_norm: centered_vector(&format!("{p}.self_attn.k_norm.weight"), hd)?,
                        indexer,
                    })
                }
            };
            let dense = |prefix: &str, width: usize| -> Result<DenseMlp<B>> {
                let gate = ckpt.linear(&format!("{prefix}.gate_proj"), width, d)?;
                let up = ckpt.linear(&format!("{prefix}.up_proj"), width, d)?;
                let gate_up = if LinearWeight::stack_losslessly(&[&gate, &up]) {
                    let stacked =
                        LinearWeight::stack_rows(&format!("{prefix}.up_proj"), vec![gate, up])?;
                    GateUp::Stacked(upload(&format!("{prefix}.gate_proj"), stacked)?)
                } else {
                    GateUp::Separate {
                        gate: upload(&format!("{prefix}.gate_proj"), gate)?,
                        up: upload(&format!("{prefix}.up_proj"), up)?,
                    }
                };
                Ok(DenseMlp {
                    gate_up,
                    down: linear(&format!("{prefix}.down_proj"), d, width)?,
                })
            };
            let mlp = if cfg.is_moe_layer(i) {
                let (router, gate) = (
                    format!("{p}.mlp.gate"),
                    format!("{p}.mlp.shared_expert_gate"),
                );
                Mlp::Moe(Moe {
                    gates: Projections::new(
                        [
                            (router.clone(), ckpt.linear(&router, cfg.num_experts, d)?),
                            (gate.clone(), ckpt.linear(&gate, 1, d)?),
                        ],
                        upload,
                    )?,
                    shared: dense(
                        &format!("{p}.mlp.shared_expert"),
                        cfg.shared_expert_intermediate_size,
                    )?,
                })
            } else {
                Mlp::Dense(dense(&format!("{p}.mlp"), cfg.intermediate_size)?)
            };
            let residual = match &cfg.flash_next {
                Some(_) => Residual::Hyper {
                    attn: hyper(&format!("{p}.attn_hyper_connection"), true)?,
                    mlp: hyper(&format!("{p}.mlp_hyper_connection"), true)?,
                },
                None => Residual::PreNorm {
                    input: vector(&format!("{p}.input_layernorm.weight"), d)?,
                    post: vector(&format!("{p}.post_attention_layernorm.weight"), d)?,
                },
            };
            let ple = match ple_cfg.filter(|c| c.layers.contains(&i)) {
                Some(c) => {
                    let (e, k) = (c.embed_dim, c.conv_kernel);
                    let conv = ckpt.floats(&format!("{p}.ple.conv1d.weight"), &[width, k, 1])?;
                    Some(Ple {
                        table: Arc::new(NgramTable::open(ckpt, i, c)?),
                        key: linear(&format!("{p}.ple.key_proj"), width, e)?,
                        value: linear(&format!("{p}.ple.value_proj"), d, e)?,
                        norm_key: centered_vector(&format!("{p}.ple.norm_key.weight"), width)?,
                        norm_query: centered_vector(&format!("{p}.ple.norm_query.weight"), width)?,
                        norm_conv: centered_vector(&format!("{p}.ple.norm_conv.weight"), width)?,
                        conv: backend.upload(&conv, width, k),
                    })
                }
                None => None,
            };
            layers.push(Layer {
                residual,
                ple,
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
        let tile = cfg.flash_next.as_ref().map(|x| {
            let idx: Vec<u32> = (0..x.hc_count)
                .flat_map(|_| 0..cfg.hidden_size as u32)
                .collect();
            backend.upload_index(&idx)
        });
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
            context: cfg.max_position_embeddings.unwrap_or(usize::MAX),
            config: cfg,
            experts,
            routing,
            norms,
            embed,
            lm_head,
            head,
            layers,
            tile,
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
            routing: self.routing.as_ref().map(RoutingModel::new_state),
            broken: false,
            writer: Writer::new_line(),
        }
    }

    /// Runs `ids` through the model after the tokens already in `state`, updating it.
    /// Returns row-major logits, `[ids.len(), vocab]` or `[1, vocab]` (see [`Logits`]).
    /// Long inputs run in chunks of [`Model::prefill_chunk`] tokens, which bounds
    /// workspaces and per-dispatch sizes; the result is the same as one pass (the model
    /// is causal).
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
        let chunks: Vec<&[u32]> = ids.chunks(self.prefill_chunk(backend, which)).collect();
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

    /// Tokens per pass of a long input on `backend` ([`Backend::prefill_chunk`] for this
    /// model's widest activation row and top-k).
    pub fn prefill_chunk(&self, backend: &B, which: Logits) -> usize {
        crate::backend::prefill_chunk(backend, &self.config, which == Logits::All)
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
        let history = &state.tokens;
        let layer_states = &mut state.layers;
        let routing_state = state.routing.as_mut();
        let mut hold = StepHold::<B, E> {
            in_use: Vec::new(),
            layers: Vec::new(),
            routings: Vec::new(),
        };
        let h = std::thread::scope(|scope| -> Result<B::Tensor> {
            // The PLE layers' n-gram rows depend only on the token ids: they are read from
            // the SSD while the layers before them run.
            let mut rows: Vec<_> = self
                .layers
                .iter()
                .map(|l| {
                    l.ple
                        .as_ref()
                        .map(|ple| scope.spawn(|| ple.table.embed(history, ids, experts)))
                })
                .collect();
            // A long chunk reads its experts outside the pool: guesses would only churn it.
            let lookahead = experts.lookahead() && ids.len() < SWEEP_MIN_TOKENS;
            let mut routes = match (&self.routing, routing_state) {
                (Some(model), Some(st)) => Some(StepRoutes::spawn(
                    scope,
                    model,
                    st,
                    cfg.moe_layers(),
                    (start, ids),
                    lookahead,
                )),
                _ => None,
            };
            let embedded = backend.embed(&self.embed, ids)?;
            let mut h = match &self.tile {
                Some(tile) => backend.gather_columns(&embedded, tile),
                None => embedded,
            };
            // The next block's input when the residual add before it also normed it.
            let mut normed: Option<B::Tensor> = None;
            for (i, (layer, st)) in self.layers.iter().zip(layer_states.iter_mut()).enumerate() {
                if let (Some(ple), Some(job)) = (&layer.ple, rows[i].take()) {
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
                    h = self.ple(backend, ple, &h, &e, conv);
                }
                let (x, inject) = match normed.take() {
                    Some(x) => (x, None),
                    None => self.block_input(backend, &layer.residual, Block::Mixer, &h),
                };
                let r = match (&layer.mixer, &mut *st) {
                    (
                        Mixer::DeltaNet(w),
                        LayerState::DeltaNet {
                            conv, recurrent, ..
                        },
                    ) => self.delta_net(backend, w, &x, conv, recurrent),
                    (Mixer::Attention(w), LayerState::Attention { kv, index }) => {
                        self.attention(backend, w, &x, &mut lock_kv(kv), index.as_mut())?
                    }
                    _ => unreachable!("state layout follows the model's layer kinds"),
                };
                let post = pre_norm(&layer.residual, Block::Mlp);
                (h, normed) = self.residual_add(backend, &h, &r, inject.as_ref(), post);
                if lookahead {
                    self.lookahead(backend, i + 2, &h, experts, routes.as_mut())?;
                }
                let (x, inject) = match normed.take() {
                    Some(x) => (x, None),
                    None => self.block_input(backend, &layer.residual, Block::Mlp, &h),
                };
                let m = match &layer.mlp {
                    Mlp::Moe(w) => {
                        self.moe(backend, w, i, &x, routes.as_mut(), experts, &mut hold)?
                    }
                    Mlp::Dense(w) => Self::dense_mlp(backend, w, &x),
                };
                let next = self.layers.get(i + 1).filter(|l| l.ple.is_none());
                let input = next.and_then(|l| pre_norm(&l.residual, Block::Mixer));
                (h, normed) = self.residual_add(backend, &h, &m, inject.as_ref(), input);
            }
            Ok(h)
        })?;
        state.tokens.extend_from_slice(ids);
        let out = match which {
            // Wait for the chunk's work before its last layer's records are released.
            None => backend.rows(&h, 0, 1),
            Some(which) => {
                let h = match which {
                    Logits::Last => backend.rows(&h, ids.len() - 1, 1),
                    Logits::All => h,
                };
                let y = match &self.head {
                    Head::Norm(w) => {
                        backend.rms_norm(&h, Some(w), cfg.hidden_size, cfg.rms_norm_eps, 1.0)
                    }
                    Head::Mixer(hc) => self.hyper(backend, hc, &h).0,
                };
                backend.matmul(&y, self.lm_head.as_ref().unwrap_or(&self.embed))
            }
        };
        let mut read: Vec<&B::Tensor> = vec![&out];
        read.extend(hold.routings.iter().map(|(_, r)| r));
        let mut values = backend.download_many(&read)?.into_iter();
        let logits = values.next().unwrap_or_default();
        for ((layer, _), routing) in hold.routings.iter().zip(values) {
            let routing = Routing::from_device(&routing, cfg.num_experts_per_tok, cfg.num_experts)?;
            experts.count_lookups(*layer, &routing.distinct());
        }
        // The read-back waited for all recorded work: the records are free.
        drop(hold);
        Ok(if which.is_some() { logits } else { Vec::new() })
    }

    /// The input of a layer's mixer or MLP block read from the residual `h`, and the
    /// hyper-connection's inject logits `[T, streams]` when it has streams.
    fn block_input(
        &self,
        backend: &B,
        residual: &Residual<B>,
        block: Block,
        h: &B::Tensor,
    ) -> (B::Tensor, Option<B::Tensor>) {
        let cfg = &self.config;
        match (residual, block) {
            (Residual::PreNorm { .. }, _) => {
                let w = pre_norm(residual, block);
                let x = backend.rms_norm(h, w, cfg.hidden_size, cfg.rms_norm_eps, 1.0);
                (x, None)
            }
            (Residual::Hyper { attn: hc, .. }, Block::Mixer)
            | (Residual::Hyper { mlp: hc, .. }, Block::Mlp) => self.hyper(backend, hc, h),
        }
    }

    /// `h + y`, or with hyper-connections `h + y * 2 sigmoid(inject / S)` per stream; with
    /// `next`, the next block's pre-norm weight, also that block's input `rms_norm(h + y)`
    /// from the same pass.
    fn residual_add(
        &self,
        backend: &B,
        h: &B::Tensor,
        y: &B::Tensor,
        inject: Option<&B::Tensor>,
        next: Option<&B::Tensor>,
    ) -> (B::Tensor, Option<B::Tensor>) {
        match (inject, next) {
            (Some(inject), _) => (backend.hyper_inject(h, y, inject), None),
            (None, Some(w)) => {
                let (sum, normed) = backend.add_rms_norm(h, y, w, self.config.rms_norm_eps);
                (sum, Some(normed))
            }
            (None, None) => (backend.add(h, y), None),
        }
    }

    /// A hyper-connection (transformers `Qwen4ExpTextGatedResidual.forward`):
    /// `n = group_rms_norm(h)`, `x = mean_s sigmoid(up(silu(down(n) / S))) * n`, and the
    /// inject logits `inj(n)` when it has them.
    fn hyper(
        &self,
        backend: &B,
        hc: &HyperConnection<B>,
        h: &B::Tensor,
    ) -> (B::Tensor, Option<B::Tensor>) {
        let cfg = &self.config;
        let streams = cfg.flash_next.as_ref().map_or(1, |x| x.hc_count);
        let n = backend.rms_norm(h, Some(&hc.norm), cfg.hidden_size, cfg.rms_norm_eps, 1.0);
        let low = backend.silu(&backend.matmul(&n, &hc.down), 1.0 / streams as f32);
        let mix = backend.matmul(&low, &hc.up);
        let x = backend.hyper_mix(&n, &mix, streams);
        let inject = hc.inject.as_ref().map(|w| backend.matmul(&n, w));
        (x, inject)
    }

    /// The PLE block on the residual `h` given the chunk's n-gram rows `e`
    /// `[T, ple_embed_dim]` (transformers `Qwen4ExpTextPLELayer.forward`): returns
    /// `h + gated + silu(conv(norm(gated)))`.
    fn ple(
        &self,
        backend: &B,
        w: &Ple<B>,
        h: &B::Tensor,
        e: &[f32],
        conv_state: &mut B::Tensor,
    ) -> B::Tensor {
        let cfg = &self.config;
        let (hd, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let (t, _) = backend.shape(h);
        let e = backend.upload(e, t, e.len() / t.max(1));
        let key = backend.rms_norm(&backend.matmul(&e, &w.key), Some(&w.norm_key), hd, eps, 1.0);
        let value = backend.matmul(&e, &w.value);
        let query = backend.rms_norm(h, Some(&w.norm_query), hd, eps, 1.0);
        let gated = backend.ple_gate(&key, &query, &value);
        let normed = backend.rms_norm(&gated, Some(&w.norm_conv), hd, eps, 1.0);
        let dilation = w.table.ngram_size;
        let conv = backend.causal_conv1d_silu(&normed, &w.conv, conv_state, dilation);
        backend.add(h, &backend.add(&gated, &conv))
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
        let [qkv, z, ba] = w.in_proj.apply(backend, x);
        let conv = backend.causal_conv1d_silu(&qkv, &w.conv, conv_state, 1);
        let dims = DeltaDims {
            key_heads: cfg.linear_num_key_heads,
            value_heads: cfg.linear_num_value_heads,
            key_dim: cfg.linear_key_head_dim,
            value_dim: cfg.linear_value_head_dim,
        };
        let y = backend.gated_delta(&conv, &ba, &w.a_log, &w.dt_bias, recurrent, dims);
        let o = backend.rms_norm_gated(
            &y,
            &z,
            &w.norm,
            cfg.linear_value_head_dim,
            cfg.rms_norm_eps,
            cfg.gate_activation,
        );
        backend.matmul(&o, &w.out_proj)
    }

    fn attention(
        &self,
        backend: &B,
        w: &Attention<B>,
        x: &B::Tensor,
        kv: &mut B::KvCache,
        index: Option<&mut IndexKeys<B>>,
    ) -> Result<B::Tensor> {
        let cfg = &self.config;
        let hd = cfg.head_dim;
        let [q, gate, k, v] = w.qkv.apply(backend, x);
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
        let mask = match (
            &w.indexer,
            index,
            cfg.flash_next.as_ref().and_then(|f| f.indexer.as_ref()),
        ) {
            (Some(ix), Some(keys), Some(icfg)) => {
                let mask = self.qsa_mask(backend, ix, icfg, x, keys, pos)?;
                if let Some(kept) = keys.selections.as_mut() {
                    let (t, _) = backend.shape(x);
                    kept.push(mask.clone().unwrap_or_else(|| KeyMask::causal(t, pos + t)));
                }
                mask
            }
            _ => None,
        };
        let o = backend.attention(&q, &k, &v, kv, dims, mask.as_ref());
        Ok(backend.matmul(&backend.mul_sigmoid(&o, &gate), &w.o_proj))
    }

    /// The QSA indexer's key selection for the `T` queries of `x` at positions
    /// `past .. past + T` (transformers `Qwen4ExpTextQSAIndexer.forward`; reference-system.md
    /// A.5): the keys of the blocks of `compress_ratio` tokens entirely in a query's past
    /// are mean-pooled, normalized and rotated to the block's first position; a block
    /// scores `sum_h relu(q_h . k_block) / sqrt(head_dim)` and a query keeps its best
    /// `budget / compress_ratio` blocks plus its own partial block. `None` while every
    /// query keeps every key (no more complete blocks than that), which also spares the
    /// read-back of the indexer's keys and queries.
    fn qsa_mask(
        &self,
        backend: &B,
        ix: &Indexer<B>,
        icfg: &IndexerConfig,
        x: &B::Tensor,
        keys: &mut IndexKeys<B>,
        past: usize,
    ) -> Result<Option<KeyMask>> {
        let cfg = &self.config;
        let (d, ratio, top_k) = (icfg.head_dim, icfg.compress_ratio, icfg.block_top_k());
        keys.pending.push(backend.matmul(x, &ix.k));
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
                Some(&ix.k_norm),
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
            &backend.matmul(x, &ix.q),
            Some(&ix.q_norm),
            d,
            cfg.rms_norm_eps,
            1.0,
        );
        let q = backend.download(&backend.rope(&q, d, cfg.rotary_dim, cfg.rope_theta, past))?;
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

    fn dense_mlp(backend: &B, w: &DenseMlp<B>, x: &B::Tensor) -> B::Tensor {
        let h = match &w.gate_up {
            GateUp::Stacked(gate_up) => backend.matmul_swiglu(x, gate_up),
            GateUp::Separate { gate, up } => {
                backend.swiglu(&backend.matmul(x, gate), &backend.matmul(x, up))
            }
        };
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
        routes: Option<&mut StepRoutes>,
    ) -> Result<()> {
        let Some(Layer {
            residual,
            mlp: Mlp::Moe(w),
            ..
        }) = self.layers.get(target)
        else {
            return Ok(());
        };
        if let Some(routes) = routes {
            experts.prefetch(target, &routes.forecast(target)?);
            return Ok(());
        }
        let cfg = &self.config;
        let (x, _) = self.block_input(backend, residual, Block::Mlp, h);
        let logits = w.gates.first(backend, &x);
        let guess = backend.router_top_k(&logits, cfg.num_experts_per_tok, false)?;
        experts.prefetch(target, &guess.distinct());
        Ok(())
    }

    /// The MoE block of `layer`. `hold.in_use` holds the previous MoE layer's records: a
    /// backend may still be reading them (GPU work runs after it is recorded), so they stay
    /// pinned until this layer's routing read-back has waited for that work.
    ///
    /// When the source holds every record of the layer (a pool of every record), the input
    /// is routed on the backend instead, a prompt's chunk as well as a decode step: the
    /// router's top-k stays on the device and the backend picks the records from the whole
    /// layer (a GPU groups a chunk's routes by record itself), so nothing is read back
    /// until the step ends; the layer's records stay held until then.
    #[allow(clippy::too_many_arguments)]
    fn moe<'e, E: ExpertSource>(
        &self,
        backend: &B,
        w: &Moe<B>,
        layer: usize,
        x: &B::Tensor,
        routes: Option<&mut StepRoutes>,
        experts: &'e E,
        hold: &mut StepHold<'e, B, E>,
    ) -> Result<B::Tensor> {
        let cfg = &self.config;
        let [logits, shared_gate] = w.gates.apply(backend, x);
        let resident = experts.resident_layer(layer);
        let k = cfg.num_experts_per_tok;
        // The synthetic routing model's ids `[T, k]`, when the model has one.
        let model_ids = routes.map(|r| r.ids(layer)).transpose()?;
        if let Some(resident) = resident {
            let routing = backend.router_top_k_device(&logits, k, cfg.norm_topk_prob)?;
            // Nothing waits here (the routing stays on the device), so the shared expert can
            // come first.
            let shared = Self::dense_mlp(backend, &w.shared, x);
            let out = backend.moe_experts_resident(
                x,
                &routing,
                k,
                model_ids.as_deref(),
                &resident.records(),
                &self.experts.layout,
                Some(SharedExpert {
                    y: &shared,
                    gate: &shared_gate,
                }),
            )?;
            match model_ids {
                Some(ids) => experts.count_lookups(layer, &distinct_ids(ids)),
                None => hold.routings.push((layer, routing)),
            }
            hold.layers.push(resident);
            return Ok(out);
        }
        let mut routing = backend.router_top_k(&logits, k, cfg.norm_topk_prob)?;
        if let Some(ids) = model_ids {
            // The router's weights stay, rank by rank; the routing model picks the ids.
            routing.ids = ids;
        }
        hold.in_use.clear();
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
        // After the routing read-back, so that the shared expert's work is not waited for.
        let shared = Self::dense_mlp(backend, &w.shared, x);
        let shared = SharedExpert {
            y: &shared,
            gate: &shared_gate,
        };
        let out = backend.moe_experts(x, &routing, &records, &self.experts.layout, Some(shared));
        hold.in_use = held;
        Ok(out)
    }
}

/// The norm weight of `block`'s input when the layer is pre-norm (`None` with
/// hyper-connections).
fn pre_norm<B: Backend>(residual: &Residual<B>, block: Block) -> Option<&B::Tensor> {
    match (residual, block) {
        (Residual::PreNorm { input, .. }, Block::Mixer) => Some(input),
        (Residual::PreNorm { post, .. }, Block::Mlp) => Some(post),
        (Residual::Hyper { .. }, _) => None,
    }
}

/// The checkpoint's convention for Flash-Next's `1 + w` norms: `SLOTSTREAM_NORMS` if set,
/// else [`NormConvention::detect`] over every such norm weight.
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
            let mut values = Vec::new();
            for t in ckpt
                .tensors()
                .filter(|t| NormConvention::applies_to(&t.name))
            {
                values.extend(ckpt.floats(&t.name, &t.shape)?);
            }
            let detected = NormConvention::detect(&values);
            tracing::info!(convention = ?detected, weights = values.len(), "zero-centered norms: convention detected (override with {})", NormConvention::OVERRIDE);
            return Ok(detected);
        }
    };
    tracing::info!(convention = ?convention, "zero-centered norms: convention set by {}", NormConvention::OVERRIDE);
    Ok(convention)
}
