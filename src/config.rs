//! `config.json` of a checkpoint: the model's geometry and its MLX quantization block.
//!
//! Field names follow the Hugging Face / mlx-lm configs (mlx-lm 0.32.2
//! `mlx_lm/models/qwen3_next.py` `ModelArgs`, `qwen3_5.py` `TextModelArgs`). Newer
//! multimodal checkpoints nest the text model's fields under `text_config`.
//!
//! Qwen3.5-MoE (`qwen3_5_moe`) is read as mlx-lm reads it, which differs from
//! ../shared/spec/models.md (§1.2, §2.10) in places the spec leaves open:
//! - with a `text_config`, the text model's fields come from it alone (mlx-lm's
//!   `ModelArgs.from_dict`); the top level supplies only `quantization` (and
//!   `eos_token_id` when `text_config` has none);
//! - RoPE comes from `rope_parameters` (theta default 1e5, partial factor default 0.25);
//!   a top-level `rope_theta` / `partial_rotary_factor` counts only when `rope_parameters`
//!   is `null`. `mrope_section` / `mrope_interleaved` are ignored: mlx-lm builds a plain
//!   `nn.RoPE` for rope type `default`, which is what M-RoPE reduces to for text positions;
//! - the layer pattern follows `full_attention_interval` (mlx-lm ignores `layer_types`);
//! - every layer is MoE when `num_experts > 0` (`mlp_only_layers` and
//!   `decoder_sparse_step` are ignored), and `norm_topk_prob` defaults to true.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Model families this build implements, by `model_type`.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["qwen3_next", "qwen3_5_moe", "qwen4_exp"];

/// A model family: what differs between the supported `model_type`s is data (tensor
/// names, the gated DeltaNet's projection layout, config defaults); the forward pass is one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `qwen3_next` (mlx-lm `qwen3_next.py`): keys `model.*` and `lm_head.*`.
    Qwen3Next,
    /// `qwen3_5_moe` (mlx-lm `qwen3_5_moe.py` over `qwen3_5.py`): keys
    /// `language_model.model.*` and `language_model.lm_head.*`.
    Qwen35Moe,
    /// `qwen4_exp`, Qwen3.8-Flash-Next (transformers 5.24 `models/qwen4_exp`): keys as
    /// Qwen3.5-MoE, plus hyper-connections, QSA attention and the PLE n-gram table
    /// ([`FlashNext`]).
    Qwen4Exp,
}

impl Family {
    fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "qwen3_next" => Some(Family::Qwen3Next),
            "qwen3_5_moe" => Some(Family::Qwen35Moe),
            "qwen4_exp" | "qwen4_exp_text" => Some(Family::Qwen4Exp),
            _ => None,
        }
    }

    /// Prefix of every text-model tensor name (mlx-lm's module path of the text model).
    pub fn prefix(self) -> &'static str {
        match self {
            Family::Qwen3Next => "",
            Family::Qwen35Moe | Family::Qwen4Exp => "language_model.",
        }
    }

    /// How the gated DeltaNet's input projections are stored.
    pub fn delta_net_projections(self) -> DeltaNetProjections {
        match self {
            Family::Qwen3Next => DeltaNetProjections::Fused,
            Family::Qwen35Moe | Family::Qwen4Exp => DeltaNetProjections::Split,
        }
    }
}

/// The activation of the gated DeltaNet's output gate (`output_gate_type`):
/// `o = act(z) * w * rms_norm(y)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateActivation {
    /// Qwen3-Next and Qwen3.5: `silu(z)`.
    Silu,
    /// Qwen3.8-Flash-Next: `sigmoid(z)` (reference-system.md A.4).
    Sigmoid,
}

/// What Qwen3.8-Flash-Next (`qwen4_exp`) adds to the Qwen3.5 blocks (transformers 5.24
/// `modular_qwen4_exp.py`; ../shared/spec/models.md §5, reference-system.md A.2-A.6).
#[derive(Clone, Debug, PartialEq)]
pub struct FlashNext {
    /// Residual streams of the hyper-connections (`hc_count`); the hidden state is
    /// `[T, hc_count * hidden_size]`.
    pub hc_count: usize,
    /// Rank of the hyper-connection input mixer (`hc_lowrank`).
    pub hc_lowrank: usize,
    /// The PLE (hashed n-gram embedding) layers, if any.
    pub ple: Option<PleConfig>,
    /// The QSA indexer of the attention layers, if any (none: dense causal attention).
    pub indexer: Option<IndexerConfig>,
}

/// The PLE layer's geometry (`ple_*`, `ngram_*`, `heads_per_ngram`, `split_ngram_parts`).
#[derive(Clone, Debug, PartialEq)]
pub struct PleConfig {
    /// Zero-based indices of the layers that start with a PLE block (`ple_layer_ids` are
    /// one-based).
    pub layers: Vec<usize>,
    /// Width of a token's concatenated n-gram rows (`ple_embed_dim`).
    pub embed_dim: usize,
    /// Kernel of the dilated causal conv (`ple_conv_kernel_size`); the dilation is `ngram_size`.
    pub conv_kernel: usize,
    /// Largest n-gram (`ngram_size`): orders 2..=ngram_size are hashed.
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    /// Shards of each layer's table (`split_ngram_parts`).
    pub split_parts: usize,
}

impl PleConfig {
    /// Hashed heads per token: `(ngram_size - 1) * heads_per_ngram`.
    pub fn heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }

    /// Width of one head's row: `embed_dim / heads`.
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.heads()
    }

    /// Rows of state the dilated conv keeps: `(conv_kernel - 1) * ngram_size`.
    pub fn conv_state_rows(&self) -> usize {
        (self.conv_kernel - 1) * self.ngram_size
    }
}

/// The QSA indexer (`indexer_*`): once more keys are visible than `budget`, each query
/// attends only to the `budget / compress_ratio` best blocks of `compress_ratio` keys
/// and to its own partial block.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerConfig {
    /// Query heads of the indexer (`indexer_n_heads`); it has one key head.
    pub heads: usize,
    pub head_dim: usize,
    pub budget: usize,
    pub compress_ratio: usize,
}

impl IndexerConfig {
    /// Blocks kept per query: `budget / compress_ratio`.
    pub fn block_top_k(&self) -> usize {
        self.budget / self.compress_ratio
    }
}

/// The gated DeltaNet's input projections as a checkpoint stores them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaNetProjections {
    /// Qwen3-Next: `in_proj_qkvz` `[2*key_dim + 2*value_dim, hidden]` and `in_proj_ba`
    /// `[2*value_heads, hidden]`, each interleaved per key-head group
    /// (`[q | k | v | z]` and `[b | a]` per group; ../shared/spec/models.md §2.4).
    Fused,
    /// Qwen3.5: `in_proj_qkv` `[2*key_dim + value_dim, hidden]` whose output is the conv
    /// input `[q | k | v]` as is, `in_proj_z` `[value_dim, hidden]`, `in_proj_b` and
    /// `in_proj_a` `[value_heads, hidden]` (§2.10).
    Split,
}

/// Kind of token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention with a recurrent state).
    LinearAttention,
    /// Gated full attention over a KV cache.
    FullAttention,
}

/// MLX affine quantization parameters of one module: `w = scale * q + bias` per group
/// of `group_size` consecutive input elements (mlx `affine_dequantize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    /// Bits per weight: 4 or 8.
    pub bits: u32,
    /// Input elements sharing one scale and bias: 32, 64 or 128.
    pub group_size: usize,
}

impl QuantSpec {
    /// Builds a spec, rejecting bit widths and group sizes the kernels do not implement.
    pub fn new(bits: usize, group_size: usize, path: &Path, field: &str) -> Result<Self> {
        if !matches!(bits, 4 | 8) {
            return Err(Error::Config {
                path: path.to_path_buf(),
                field: field.to_string(),
                message: format!("{bits}-bit quantization is not supported (supported: 4, 8)"),
            });
        }
        if !matches!(group_size, 32 | 64 | 128) {
            return Err(Error::Config {
                path: path.to_path_buf(),
                field: field.to_string(),
                message: format!(
                    "group size {group_size} is not supported (supported: 32, 64, 128)"
                ),
            });
        }
        Ok(QuantSpec {
            bits: bits as u32,
            group_size,
        })
    }

    /// Quantized values per packed `u32` word.
    pub fn per_word(&self) -> usize {
        32 / self.bits as usize
    }

    /// The supported spec that explains a quantized weight's stored widths for an input
    /// of `inp` elements: `packed` words per row (`.weight` is `[out, inp * bits / 32]`
    /// u32) and `groups` per row (`.scales` is `[out, inp / group_size]`). `preferred`
    /// (the config's global spec) wins when it fits; otherwise the one supported pair
    /// that does. `None` when none fits.
    ///
    /// With `inp` known the pair is unique (`bits = 32 * packed / inp`, `group_size =
    /// inp / groups`); from the two widths alone it is not: 4-bit group 64 and 8-bit
    /// group 32 (or 4-bit group 128 and 8-bit group 64) store the same widths.
    pub fn explaining(
        inp: usize,
        packed: usize,
        groups: usize,
        preferred: Option<QuantSpec>,
    ) -> Option<QuantSpec> {
        let fits =
            |s: &QuantSpec| inp > 0 && inp == packed * s.per_word() && inp == groups * s.group_size;
        if let Some(p) = preferred.filter(fits) {
            return Some(p);
        }
        let mut fitting = [4, 8]
            .into_iter()
            .flat_map(|bits| [32, 64, 128].map(|group_size| QuantSpec { bits, group_size }))
            .filter(fits);
        match (fitting.next(), fitting.next()) {
            (Some(s), None) => Some(s),
            _ => None,
        }
    }
}

/// How a module is stored, according to the config's `quantization` block.
#[derive(Clone, Debug, Default)]
pub struct Quantization {
    /// Global parameters (`group_size`, `bits`); `None` for an unquantized checkpoint.
    pub default: Option<QuantSpec>,
    /// Per-module overrides keyed by module path (`model.layers.0.mlp.gate`);
    /// `None` means the module is explicitly left unquantized.
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl Quantization {
    /// The config entry of module `path` exactly as keyed: `Some(Some(spec))` quantized,
    /// `Some(None)` left unquantized, `None` no entry (see
    /// [`ModelConfig::quant_override`], which also tries the name without the prefix).
    pub fn for_module(&self, path: &str) -> Option<Option<QuantSpec>> {
        self.overrides.get(path).copied()
    }
}

/// Geometry of a Qwen3-Next-family model (all fields in elements, not bytes).
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// Directory-relative path of the file this was read from, for error messages.
    pub path: PathBuf,
    pub model_type: String,
    pub family: Family,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    // Full attention.
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Leading dimensions of each head that RoPE rotates (`head_dim * partial_rotary_factor`).
    pub rotary_dim: usize,
    pub rope_theta: f64,
    // Gated DeltaNet.
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    // Mixture of experts.
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
    /// Width of the dense MLP of layers that are not MoE (`mlp_only_layers`).
    pub intermediate_size: usize,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    /// Mixer of each layer, derived from `layer_types` or `full_attention_interval`.
    pub layer_kinds: Vec<LayerKind>,
    /// End-of-sequence ids from `eos_token_id` (an integer or a list).
    pub eos_token_ids: Vec<u32>,
    /// Positions the model was trained for (`max_position_embeddings`); `None` when the
    /// config does not say. Bounds the context ([`crate::context::limit`]).
    pub max_position_embeddings: Option<usize>,
    pub quantization: Quantization,
    /// Activation of the gated DeltaNet's output gate.
    pub gate_activation: GateActivation,
    /// Qwen3.8-Flash-Next's extra blocks; `None` for the other families.
    pub flash_next: Option<FlashNext>,
}

struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn err(&self, field: &str, message: impl Into<String>) -> Error {
        Error::Config {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            message: message.into(),
        }
    }

    fn get(&self, field: &str) -> Option<&Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn usize(&self, field: &str) -> Result<usize> {
        self.usize_or(field, None)
    }

    fn usize_or(&self, field: &str, default: Option<usize>) -> Result<usize> {
        match self.get(field) {
            Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| {
                self.err(field, format!("expected a non-negative integer, found {v}"))
            }),
            None => default.ok_or_else(|| self.err(field, "missing")),
        }
    }

    fn f64_or(&self, field: &str, default: Option<f64>) -> Result<f64> {
        match self.get(field) {
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(field, format!("expected a number, found {v}"))),
            None => default.ok_or_else(|| self.err(field, "missing")),
        }
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.get(field) {
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(field, format!("expected true or false, found {v}"))),
            None => Ok(default),
        }
    }

    fn usize_list(&self, field: &str) -> Result<Vec<usize>> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| self.err(field, format!("expected integers, found {v}")))
                })
                .collect(),
            Some(Value::Number(n)) if n.is_u64() => {
                Ok(vec![n.as_u64().unwrap_or_default() as usize])
            }
            Some(v) => Err(self.err(field, format!("expected an integer or a list, found {v}"))),
        }
    }
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    ///
    /// Errors: a missing or malformed file, an unsupported `model_type` (the error lists
    /// the supported ones), a missing or mistyped field, unsupported quantization
    /// (bits other than 4 and 8, group sizes other than 32/64/128, a mode other than affine).
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let root: Value = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Self::from_json(&root, &path)
    }

    /// Parses an already-read config; `path` is used in error messages.
    pub fn from_json(root: &Value, path: &Path) -> Result<Self> {
        let Some(top) = root.as_object() else {
            return Err(Error::Json {
                path: path.to_path_buf(),
                message: "expected a JSON object".into(),
            });
        };
        let top_f = Fields { obj: top, path };
        let model_type = top_f
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| top_f.err("model_type", "missing"))?
            .to_string();
        let Some(family) = Family::from_model_type(&model_type) else {
            return Err(Error::UnsupportedModel {
                path: path.to_path_buf(),
                model_type,
                supported: SUPPORTED_MODEL_TYPES.join(", "),
            });
        };
        let text_config = match top.get("text_config") {
            Some(Value::Object(text)) => Some(text),
            _ => None,
        };
        // The text model's fields.
        let merged = match (family, text_config) {
            // mlx-lm qwen3_5_moe `ModelArgs.from_dict`: `text_config` alone; the top level
            // keeps the quantization block (read by `load_model`) and, here, the EOS ids.
            (Family::Qwen35Moe | Family::Qwen4Exp, Some(text)) => {
                let mut m = text.clone();
                m.remove("quantization");
                if let Some(eos) = top
                    .get("eos_token_id")
                    .filter(|_| !text.contains_key("eos_token_id"))
                {
                    m.insert("eos_token_id".into(), eos.clone());
                }
                m
            }
            // `text_config` overriding the top level.
            _ => {
                let mut m = top.clone();
                for (k, v) in text_config.into_iter().flatten() {
                    if k != "model_type" {
                        m.insert(k.clone(), v.clone());
                    }
                }
                m
            }
        };
        let f = Fields { obj: &merged, path };
        let (rope_theta, partial) = match family {
            Family::Qwen3Next => {
                if f.get("rope_scaling").is_some() {
                    return Err(f.err("rope_scaling", "RoPE scaling is not supported"));
                }
                // `rope_parameters` (newer HF configs) carries theta and the partial factor.
                let rope = f.get("rope_parameters").and_then(Value::as_object);
                let rope_f = rope.map(|obj| Fields { obj, path });
                let rope_theta = match &rope_f {
                    Some(r) if r.get("rope_theta").is_some() => r.f64_or("rope_theta", None)?,
                    _ => f.f64_or("rope_theta", Some(10_000.0))?,
                };
                let partial = match &rope_f {
                    Some(r) if r.get("partial_rotary_factor").is_some() => {
                        r.f64_or("partial_rotary_factor", None)?
                    }
                    _ => f.f64_or("partial_rotary_factor", Some(1.0))?,
                };
                (rope_theta, partial)
            }
            Family::Qwen35Moe | Family::Qwen4Exp => qwen35_rope(&f, &merged)?,
        };

        let hidden_size = f.usize("hidden_size")?;
        let num_attention_heads = f.usize("num_attention_heads")?;
        let head_dim = f.usize_or("head_dim", Some(hidden_size / num_attention_heads.max(1)))?;
        let rotary_dim = (head_dim as f64 * partial) as usize;
        if !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(f.err(
                "partial_rotary_factor",
                format!("gives {rotary_dim} rotary dims of {head_dim}"),
            ));
        }
        let num_hidden_layers = f.usize("num_hidden_layers")?;
        let interval_kinds = |f: &Fields<'_>| -> Result<Vec<LayerKind>> {
            let interval = f.usize_or("full_attention_interval", Some(4))?;
            if interval == 0 {
                return Err(f.err("full_attention_interval", "must be at least 1"));
            }
            Ok((0..num_hidden_layers)
                .map(|i| {
                    if (i + 1) % interval == 0 {
                        LayerKind::FullAttention
                    } else {
                        LayerKind::LinearAttention
                    }
                })
                .collect())
        };
        let layer_types = match f.get("layer_types") {
            Some(Value::Array(types)) => {
                if types.len() != num_hidden_layers {
                    return Err(f.err(
                        "layer_types",
                        format!("has {} entries for {num_hidden_layers} layers", types.len()),
                    ));
                }
                Some(
                    types
                        .iter()
                        .map(|t| match (family, t.as_str()) {
                            (_, Some("linear_attention")) => Ok(LayerKind::LinearAttention),
                            (_, Some("full_attention")) => Ok(LayerKind::FullAttention),
                            // The names Flash-Next configs give their QSA attention layers
                            // (../shared/spec/models.md §5.1).
                            (
                                Family::Qwen4Exp,
                                Some(
                                    "indexed_attention"
                                    | "deepseek_sparse_attention"
                                    | "hybrid_indexed"
                                    | "qwen_sparse_attention",
                                ),
                            ) => Ok(LayerKind::FullAttention),
                            _ => Err(f.err("layer_types", format!("unknown layer type {t}"))),
                        })
                        .collect::<Result<Vec<_>>>()?,
                )
            }
            _ => None,
        };
        let layer_kinds = match (family, layer_types) {
            // transformers' qwen4_exp follows `layer_types` when it is given.
            (Family::Qwen3Next | Family::Qwen4Exp, Some(kinds)) => kinds,
            (Family::Qwen35Moe, Some(kinds)) => {
                // mlx-lm qwen3_5 `DecoderLayer` follows the interval only.
                let by_interval = interval_kinds(&f)?;
                if kinds != by_interval {
                    tracing::warn!(
                        config = %path.display(),
                        "layer_types disagrees with full_attention_interval; following the interval as mlx-lm does"
                    );
                }
                by_interval
            }
            (_, None) => interval_kinds(&f)?,
        };
        // mlx-lm qwen3_5: MoE in every layer when num_experts > 0; the router renormalizes
        // by default.
        let (norm_topk_default, kv_heads_default, mlp_only_layers, decoder_sparse_step) =
            match family {
                Family::Qwen3Next => (
                    false,
                    num_attention_heads,
                    f.usize_list("mlp_only_layers")?,
                    match f.usize_or("decoder_sparse_step", Some(1))? {
                        0 => return Err(f.err("decoder_sparse_step", "must be at least 1")),
                        step => step,
                    },
                ),
                Family::Qwen35Moe => (true, 8, Vec::new(), 1),
                Family::Qwen4Exp => (true, 2, Vec::new(), 1),
            };
        let quantization = match family {
            Family::Qwen3Next => parse_quantization(&f)?,
            Family::Qwen35Moe | Family::Qwen4Exp => parse_quantization(&top_f)?,
        };
        let gate_activation = match f
            .get("output_gate_type")
            .or_else(|| f.get("hidden_act"))
            .and_then(Value::as_str)
        {
            Some("sigmoid") if family == Family::Qwen4Exp => GateActivation::Sigmoid,
            None | Some("silu") => GateActivation::Silu,
            Some(other) => {
                return Err(f.err(
                    "output_gate_type",
                    format!("{other:?} is not supported (supported: silu, sigmoid)"),
                ))
            }
        };
        let flash_next = match family {
            Family::Qwen4Exp => Some(flash_next(&f, num_hidden_layers, hidden_size)?),
            _ => None,
        };

        let cfg = ModelConfig {
            path: path.to_path_buf(),
            model_type,
            family,
            hidden_size,
            num_hidden_layers,
            vocab_size: f.usize("vocab_size")?,
            rms_norm_eps: f.f64_or("rms_norm_eps", Some(1e-6))? as f32,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", Some(kv_heads_default))?,
            head_dim,
            rotary_dim,
            rope_theta,
            linear_num_key_heads: f.usize("linear_num_key_heads")?,
            linear_num_value_heads: f.usize("linear_num_value_heads")?,
            linear_key_head_dim: f.usize("linear_key_head_dim")?,
            linear_value_head_dim: f.usize("linear_value_head_dim")?,
            linear_conv_kernel_dim: f.usize_or("linear_conv_kernel_dim", Some(4))?,
            num_experts: f.usize("num_experts")?,
            num_experts_per_tok: f.usize("num_experts_per_tok")?,
            moe_intermediate_size: f.usize("moe_intermediate_size")?,
            shared_expert_intermediate_size: f.usize("shared_expert_intermediate_size")?,
            norm_topk_prob: f.bool_or("norm_topk_prob", norm_topk_default)?,
            intermediate_size: f.usize_or("intermediate_size", Some(0))?,
            decoder_sparse_step,
            mlp_only_layers,
            layer_kinds,
            eos_token_ids: f
                .usize_list("eos_token_id")?
                .into_iter()
                .map(|v| {
                    u32::try_from(v)
                        .map_err(|_| f.err("eos_token_id", format!("{v} is not a token id")))
                })
                .collect::<Result<_>>()?,
            max_position_embeddings: match f.get("max_position_embeddings") {
                None => None,
                Some(_) => match f.usize("max_position_embeddings")? {
                    0 => return Err(f.err("max_position_embeddings", "must be at least 1")),
                    n => Some(n),
                },
            },
            quantization,
            gate_activation,
            flash_next,
        };
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<()> {
        let err = |field: &str, message: String| Error::Config {
            path: self.path.clone(),
            field: field.into(),
            message,
        };
        for (field, v) in [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("vocab_size", self.vocab_size),
            ("num_attention_heads", self.num_attention_heads),
            ("head_dim", self.head_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("num_experts", self.num_experts),
            ("moe_intermediate_size", self.moe_intermediate_size),
            (
                "shared_expert_intermediate_size",
                self.shared_expert_intermediate_size,
            ),
        ] {
            if v == 0 {
                return Err(err(field, "must be at least 1".into()));
            }
        }
        if self.linear_key_head_dim > 256 {
            return Err(err(
                "linear_key_head_dim",
                format!(
                    "{} is above the 256 the kernels support",
                    self.linear_key_head_dim
                ),
            ));
        }
        if let Some(bad) = self
            .eos_token_ids
            .iter()
            .find(|&&id| id as usize >= self.vocab_size)
        {
            return Err(err(
                "eos_token_id",
                format!("{bad} is outside the vocabulary of {}", self.vocab_size),
            ));
        }
        if self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return Err(err(
                "num_key_value_heads",
                format!(
                    "{} does not divide {} query heads",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.linear_num_key_heads == 0
            || !self
                .linear_num_value_heads
                .is_multiple_of(self.linear_num_key_heads)
        {
            return Err(err(
                "linear_num_value_heads",
                format!(
                    "{} is not a multiple of linear_num_key_heads {}",
                    self.linear_num_value_heads, self.linear_num_key_heads
                ),
            ));
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return Err(err(
                "num_experts_per_tok",
                format!(
                    "{} with {} experts",
                    self.num_experts_per_tok, self.num_experts
                ),
            ));
        }
        if self.linear_conv_kernel_dim == 0 {
            return Err(err("linear_conv_kernel_dim", "must be at least 1".into()));
        }
        if let Some(ple) = self.flash_next.as_ref().and_then(|x| x.ple.as_ref()) {
            if let Some(&bad) = ple
                .layers
                .iter()
                .find(|&&l| self.layer_kinds[l] != LayerKind::LinearAttention)
            {
                return Err(err(
                    "ple_layer_ids",
                    format!(
                        "layer {} (one-based) is not a linear_attention layer",
                        bad + 1
                    ),
                ));
            }
            if self.eos_token_ids.is_empty() {
                return Err(err(
                    "eos_token_id",
                    "is needed by the PLE n-gram hash (segment reset)".into(),
                ));
            }
        }
        if let Some(idx) = self.flash_next.as_ref().and_then(|x| x.indexer.as_ref()) {
            if self.rotary_dim > idx.head_dim {
                return Err(err(
                    "indexer_head_dim",
                    format!(
                        "{} is narrower than the {} rotary dims",
                        idx.head_dim, self.rotary_dim
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Prefix of the text model's tensor names: `""` (Qwen3-Next) or `language_model.`
    /// (Qwen3.5-MoE).
    pub fn prefix(&self) -> &'static str {
        self.family.prefix()
    }

    /// The full name of a text-model module or tensor: `name("model.norm.weight")` is
    /// `language_model.model.norm.weight` for Qwen3.5-MoE. Quantization overrides are
    /// keyed by these names too (mlx-lm's module paths).
    pub fn name(&self, rest: &str) -> String {
        format!("{}{rest}", self.prefix())
    }

    /// `name("model.layers.{layer}.{rest}")`.
    pub fn layer_name(&self, layer: usize, rest: &str) -> String {
        format!("{}model.layers.{layer}.{rest}", self.prefix())
    }

    /// The quantization override of module `module` (its full name, as [`Self::name`]
    /// gives it), found under the full name or under the name without the family's
    /// prefix: mlx-lm keys Qwen3.5-MoE overrides by the full module path
    /// (`language_model.model.layers.0.mlp.gate`), while the released Qwen3.8-Flash-Next
    /// conversion keys its n-gram shards without it
    /// (`model.layers.1.ple.ple_embedding.ngram_embedding.shard_N`, reference-system.md
    /// A.8). The full name wins when both are present. `None`: no entry under either name
    /// (the caller then looks at the stored tensors).
    pub fn quant_override(&self, module: &str) -> Option<Option<QuantSpec>> {
        let q = &self.quantization;
        q.for_module(module).or_else(|| {
            let rest = module
                .strip_prefix(self.prefix())
                .filter(|_| !self.prefix().is_empty())?;
            q.for_module(rest)
        })
    }

    /// Whether tensor `name` belongs to the text model the engine runs: under `model.` or
    /// `lm_head.` after the family's prefix, not an MTP head (vision towers and MTP
    /// weights are ignored, as mlx-lm's `sanitize` drops them).
    pub fn is_text_tensor(&self, name: &str) -> bool {
        let Some(rest) = name.strip_prefix(self.prefix()) else {
            return false;
        };
        (rest.starts_with("model.") || rest.starts_with("lm_head.")) && !rest.contains("mtp.")
    }

    /// The name mlx-lm's `sanitize` gives a stored tensor. Qwen3.5-MoE (`qwen3_5_moe.py`):
    /// `model.language_model.*` becomes `language_model.model.*`, `language_model.*` stays,
    /// vision tensors (`vision_tower*`, `model.visual*`) keep their names (and are unused),
    /// anything else gets `language_model.` in front. Qwen3-Next names are kept.
    pub fn canonical_name<'a>(&self, stored: &'a str) -> Cow<'a, str> {
        match self.family {
            Family::Qwen3Next => Cow::Borrowed(stored),
            Family::Qwen35Moe | Family::Qwen4Exp => {
                if stored.starts_with("vision_tower") || stored.starts_with("model.visual") {
                    Cow::Borrowed(stored)
                } else if let Some(rest) = stored.strip_prefix("model.language_model") {
                    Cow::Owned(format!("language_model.model{rest}"))
                } else if stored.starts_with("language_model.") {
                    Cow::Borrowed(stored)
                } else {
                    Cow::Owned(format!("language_model.{stored}"))
                }
            }
        }
    }

    /// Whether layer `i` has a routed-expert MoE block (else a dense MLP),
    /// as mlx-lm's `Qwen3NextDecoderLayer` decides it.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i)
            && self.num_experts > 0
            && (i + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// Indices of the layers that have routed experts, ascending.
    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.num_hidden_layers)
            .filter(|&i| self.is_moe_layer(i))
            .collect()
    }

    /// Gated DeltaNet key dimension (`linear_num_key_heads * linear_key_head_dim`).
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    /// Gated DeltaNet value dimension (`linear_num_value_heads * linear_value_head_dim`).
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Channels of the causal conv: q, k and v concatenated.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }

    /// Width of the residual stream: `hidden_size`, times `hc_count` with hyper-connections.
    pub fn residual_width(&self) -> usize {
        self.hidden_size * self.flash_next.as_ref().map_or(1, |x| x.hc_count)
    }
}

/// Reads Flash-Next's fields (transformers `Qwen4ExpTextConfig`, whose defaults apply
/// where a field is absent) and checks them as its `validate_architecture` does.
fn flash_next(f: &Fields<'_>, layers: usize, hidden: usize) -> Result<FlashNext> {
    let hc_count = f.usize_or("hc_count", Some(4))?;
    if hc_count < 2 {
        return Err(f.err(
            "hc_count",
            format!("{hc_count} streams; at least 2 are needed"),
        ));
    }
    let hc_lowrank = f.usize_or("hc_lowrank", Some(320))?;
    let ple_ids = f.usize_list("ple_layer_ids")?;
    let ple = if ple_ids.is_empty() {
        None
    } else {
        let mut layers_ = Vec::new();
        for id in ple_ids {
            if id == 0 || id > layers {
                return Err(f.err(
                    "ple_layer_ids",
                    format!("{id} is not a one-based layer id in 1..={layers}"),
                ));
            }
            layers_.push(id - 1);
        }
        layers_.sort_unstable();
        layers_.dedup();
        let ple = PleConfig {
            layers: layers_,
            embed_dim: f.usize_or("ple_embed_dim", Some(hidden))?,
            conv_kernel: f.usize_or("ple_conv_kernel_size", Some(4))?,
            ngram_size: f.usize_or("ngram_size", Some(3))?,
            heads_per_ngram: f.usize_or("heads_per_ngram", Some(8))?,
            split_parts: f.usize_or("split_ngram_parts", Some(512))?,
        };
        if ple.ngram_size < 2
            || ple.heads_per_ngram == 0
            || !ple.embed_dim.is_multiple_of(ple.heads())
            || ple.embed_dim == 0
        {
            return Err(f.err(
                "ple_embed_dim",
                format!(
                    "{} is not a positive multiple of the {} n-gram heads",
                    ple.embed_dim,
                    ple.heads()
                ),
            ));
        }
        if ple.conv_kernel == 0 || ple.split_parts == 0 {
            return Err(f.err(
                "ple_conv_kernel_size",
                "ple_conv_kernel_size and split_ngram_parts must be at least 1",
            ));
        }
        Some(ple)
    };
    let fields = [
        "indexer_n_heads",
        "indexer_kv_heads",
        "indexer_head_dim",
        "indexer_budget",
        "indexer_compress_ratio",
    ];
    let indexer = if fields.iter().all(|k| f.get(k).is_none()) {
        None
    } else {
        let v = fields
            .iter()
            .map(|k| f.usize(k))
            .collect::<Result<Vec<_>>>()?;
        if let Some(i) = v.iter().position(|&x| x == 0) {
            return Err(f.err(fields[i], "must be at least 1"));
        }
        if v[1] != 1 {
            return Err(f.err(
                "indexer_kv_heads",
                format!("{}; QSA has exactly one indexer key head", v[1]),
            ));
        }
        if v[3] % v[4] != 0 {
            return Err(f.err(
                "indexer_budget",
                format!(
                    "{} is not a multiple of indexer_compress_ratio {}",
                    v[3], v[4]
                ),
            ));
        }
        Some(IndexerConfig {
            heads: v[0],
            head_dim: v[2],
            budget: v[3],
            compress_ratio: v[4],
        })
    };
    Ok(FlashNext {
        hc_count,
        hc_lowrank,
        ple,
        indexer,
    })
}

/// RoPE `(theta, partial_rotary_factor)` as mlx-lm qwen3_5 `TextModelArgs.__post_init__`
/// derives them: from `rope_parameters` when it is a non-empty object (defaults 1e5 and
/// 0.25), else from the top-level fields (same defaults); `rope_parameters` also becomes
/// the scaling config, of which only type `default` (plain RoPE; `mrope_section` unused)
/// is supported.
fn qwen35_rope(f: &Fields<'_>, obj: &Map<String, Value>) -> Result<(f64, f64)> {
    const THETA: f64 = 100_000.0;
    const PARTIAL: f64 = 0.25;
    match obj.get("rope_parameters") {
        // The dataclass default: {type: default, rope_theta: 1e5, partial_rotary_factor: 0.25}.
        None => Ok((THETA, PARTIAL)),
        Some(Value::Object(rope)) if !rope.is_empty() => {
            let r = Fields {
                obj: rope,
                path: f.path,
            };
            match r.get("type").or_else(|| r.get("rope_type")) {
                None => {}
                Some(Value::String(kind)) if kind == "default" => {}
                Some(kind) => {
                    return Err(f.err(
                        "rope_parameters",
                        format!("rope type {kind} is not supported (supported: \"default\")"),
                    ))
                }
            }
            Ok((
                r.f64_or("rope_theta", Some(THETA))?,
                r.f64_or("partial_rotary_factor", Some(PARTIAL))?,
            ))
        }
        Some(Value::Null) | Some(Value::Object(_)) => {
            if f.get("rope_scaling").is_some() {
                return Err(f.err("rope_scaling", "RoPE scaling is not supported"));
            }
            Ok((
                f.f64_or("rope_theta", Some(THETA))?,
                f.f64_or("partial_rotary_factor", Some(PARTIAL))?,
            ))
        }
        Some(v) => Err(f.err("rope_parameters", format!("expected an object, found {v}"))),
    }
}

fn parse_quantization(f: &Fields<'_>) -> Result<Quantization> {
    let Some(q) = f.get("quantization") else {
        return Ok(Quantization::default());
    };
    let Some(obj) = q.as_object() else {
        return Err(f.err("quantization", format!("expected an object, found {q}")));
    };
    let qf = Fields { obj, path: f.path };
    if let Some(mode) = qf.get("mode") {
        if mode.as_str() != Some("affine") {
            return Err(f.err(
                "quantization.mode",
                format!("{mode} is not supported (supported: \"affine\")"),
            ));
        }
    }
    let bits = qf
        .usize("bits")
        .map_err(|_| f.err("quantization.bits", "missing or not an integer"))?;
    let group = qf
        .usize("group_size")
        .map_err(|_| f.err("quantization.group_size", "missing or not an integer"))?;
    let default = QuantSpec::new(bits, group, f.path, "quantization")?;
    let mut overrides = BTreeMap::new();
    for (key, value) in obj {
        let field = format!("quantization.{key}");
        match value {
            Value::Object(m) => {
                let mf = Fields {
                    obj: m,
                    path: f.path,
                };
                let bits = mf
                    .usize_or("bits", Some(default.bits as usize))
                    .map_err(|_| f.err(&field, "bad bits"))?;
                let group = mf
                    .usize_or("group_size", Some(default.group_size))
                    .map_err(|_| f.err(&field, "bad group_size"))?;
                overrides.insert(
                    key.clone(),
                    Some(QuantSpec::new(bits, group, f.path, &field)?),
                );
            }
            Value::Bool(false) => {
                overrides.insert(key.clone(), None);
            }
            _ => {}
        }
    }
    Ok(Quantization {
        default: Some(default),
        overrides,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4,
            "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "partial_rotary_factor": 0.25, "rope_theta": 1e6, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "eos_token_id": [5, 6],
            "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                              "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}
        })
    }

    #[test]
    fn parses_layer_pattern_and_overrides() {
        let cfg = ModelConfig::from_json(&base(), Path::new("config.json")).unwrap();
        assert_eq!(cfg.layer_kinds[3], LayerKind::FullAttention);
        assert_eq!(cfg.layer_kinds[2], LayerKind::LinearAttention);
        assert_eq!(cfg.rotary_dim, 4);
        assert_eq!(cfg.eos_token_ids, vec![5, 6]);
        assert_eq!(
            cfg.quantization.for_module("model.layers.0.mlp.gate"),
            Some(Some(QuantSpec {
                bits: 8,
                group_size: 64
            }))
        );
    }

    /// Overrides are found under the full module name or the name without the family's
    /// prefix (the released Flash-Next layout); the full name wins.
    #[test]
    fn overrides_are_found_with_or_without_the_prefix() {
        let spec = |bits, group_size| Some(Some(QuantSpec { bits, group_size }));
        let mut v = qwen35();
        let q = v["quantization"].as_object_mut().unwrap();
        q.insert(
            "model.layers.1.ple.ple_embedding.ngram_embedding.shard_3".into(),
            json!({"group_size": 32, "bits": 4}),
        );
        q.insert(
            "model.layers.0.mlp.gate".into(),
            json!({"group_size": 32, "bits": 4}),
        );
        q.insert("model.layers.2.mlp.gate".into(), json!(false));
        let cfg = ModelConfig::from_json(&v, Path::new("config.json")).unwrap();
        let shard = "language_model.model.layers.1.ple.ple_embedding.ngram_embedding.shard_3";
        assert_eq!(cfg.quant_override(shard), spec(4, 32));
        assert_eq!(
            cfg.quant_override("language_model.model.layers.0.mlp.gate"),
            spec(8, 64)
        );
        assert_eq!(
            cfg.quant_override("language_model.model.layers.2.mlp.gate"),
            Some(None)
        );
        assert_eq!(
            cfg.quant_override("language_model.model.layers.3.mlp.gate"),
            None
        );
        // Qwen3-Next has no prefix: only the name as given.
        let cfg = ModelConfig::from_json(&base(), Path::new("config.json")).unwrap();
        assert_eq!(cfg.quant_override("model.layers.0.mlp.gate"), spec(8, 64));
        assert_eq!(
            cfg.quant_override("language_model.model.layers.0.mlp.gate"),
            None
        );
    }

    /// Every supported pair is recovered from the widths it stores, for random input
    /// widths, whatever pair is preferred; widths no supported pair explains give `None`.
    #[test]
    fn quantization_is_inferred_from_the_stored_widths() {
        use rand::Rng;
        let mut rng = rand::rng();
        let all: Vec<QuantSpec> = [4, 8]
            .into_iter()
            .flat_map(|bits| [32, 64, 128].map(|group_size| QuantSpec { bits, group_size }))
            .collect();
        for _ in 0..200 {
            let inp = 128 * rng.random_range(1..64usize);
            let want = all[rng.random_range(0..all.len())];
            let (packed, groups) = (inp / want.per_word(), inp / want.group_size);
            let preferred = Some(all[rng.random_range(0..all.len())]);
            assert_eq!(
                QuantSpec::explaining(inp, packed, groups, preferred),
                Some(want)
            );
            assert_eq!(QuantSpec::explaining(inp, packed, groups, None), Some(want));
            // The same widths for twice the input: half the bits and twice the group,
            // where those are supported.
            let twice = (want.bits == 8 && want.group_size <= 64).then_some(QuantSpec {
                bits: 4,
                group_size: want.group_size * 2,
            });
            assert_eq!(
                QuantSpec::explaining(inp * 2, packed, groups, preferred),
                twice
            );
        }
        // 4-bit group 64 and 8-bit group 32 store the same widths for different inputs.
        let (g64, g32) = (
            QuantSpec {
                bits: 4,
                group_size: 64,
            },
            QuantSpec {
                bits: 8,
                group_size: 32,
            },
        );
        assert_eq!(QuantSpec::explaining(512, 64, 8, None), Some(g64));
        assert_eq!(QuantSpec::explaining(256, 64, 8, None), Some(g32));
        // Group size 16 and 2 bits are not supported; neither is an empty input.
        assert_eq!(QuantSpec::explaining(512, 64, 32, None), None);
        assert_eq!(QuantSpec::explaining(512, 32, 8, None), None);
        assert_eq!(QuantSpec::explaining(0, 0, 0, None), None);
    }

    #[test]
    fn text_config_is_merged() {
        let mut nested = json!({"model_type": "qwen3_next", "text_config": base()});
        nested["text_config"]["hidden_size"] = json!(128);
        let cfg = ModelConfig::from_json(&nested, Path::new("config.json")).unwrap();
        assert_eq!(cfg.hidden_size, 128);
    }

    /// A Qwen3.5-MoE config as released: the text model under `text_config`, the
    /// quantization block at the top.
    fn qwen35() -> Value {
        let mut text = base();
        let obj = text.as_object_mut().unwrap();
        for k in ["quantization", "rope_theta", "partial_rotary_factor"] {
            obj.remove(k);
        }
        obj.insert("model_type".into(), json!("qwen3_5_moe_text"));
        obj.insert(
            "rope_parameters".into(),
            json!({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
                   "mrope_section": [1, 1, 2], "mrope_interleaved": true}),
        );
        json!({
            "model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": true,
            "rope_theta": 5.0, "hidden_size": 4096,
            "quantization": {"group_size": 64, "bits": 4,
                             "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}
        })
    }

    #[test]
    fn qwen35_moe_reads_text_config_as_mlx_lm_does() {
        let cfg = ModelConfig::from_json(&qwen35(), Path::new("config.json")).unwrap();
        assert_eq!(cfg.family, Family::Qwen35Moe);
        assert_eq!(
            cfg.family.delta_net_projections(),
            DeltaNetProjections::Split
        );
        // Top-level model fields are not the text model's.
        assert_eq!(cfg.hidden_size, 64);
        assert!(!cfg.tie_word_embeddings);
        assert_eq!((cfg.rope_theta, cfg.rotary_dim), (1e7, 8));
        assert!(cfg.norm_topk_prob, "mlx-lm's qwen3_5 default");
        assert_eq!(cfg.layer_kinds[3], LayerKind::FullAttention);
        assert_eq!(
            cfg.quantization
                .for_module("language_model.model.layers.0.mlp.gate"),
            Some(Some(QuantSpec {
                bits: 8,
                group_size: 64
            }))
        );
        assert_eq!(
            cfg.layer_name(2, "mlp.gate"),
            "language_model.model.layers.2.mlp.gate"
        );
        assert_eq!(cfg.name("lm_head"), "language_model.lm_head");
        // Every layer is MoE in mlx-lm's qwen3_5, whatever mlp_only_layers says.
        let mut v = qwen35();
        v["text_config"]["mlp_only_layers"] = json!([1]);
        v["text_config"]["decoder_sparse_step"] = json!(2);
        v["text_config"]["norm_topk_prob"] = json!(false);
        let cfg = ModelConfig::from_json(&v, Path::new("config.json")).unwrap();
        assert_eq!(cfg.moe_layers(), vec![0, 1, 2, 3]);
        assert!(!cfg.norm_topk_prob);
        // Without text_config the top level is the text model.
        let mut flat = qwen35()["text_config"].clone();
        flat["model_type"] = json!("qwen3_5_moe");
        let cfg = ModelConfig::from_json(&flat, Path::new("config.json")).unwrap();
        assert_eq!((cfg.hidden_size, cfg.rope_theta), (64, 1e7));
    }

    #[test]
    fn qwen35_moe_rope_defaults_and_unsupported_scaling() {
        let path = Path::new("config.json");
        let mut v = qwen35();
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("rope_parameters");
        v["text_config"]["rope_theta"] = json!(3.0);
        let cfg = ModelConfig::from_json(&v, path).unwrap();
        // The dataclass default rope_parameters wins over a bare rope_theta.
        assert_eq!((cfg.rope_theta, cfg.rotary_dim), (1e5, 4));
        v["text_config"]["rope_parameters"] = Value::Null;
        let cfg = ModelConfig::from_json(&v, path).unwrap();
        assert_eq!((cfg.rope_theta, cfg.rotary_dim), (3.0, 4));
        let mut v = qwen35();
        v["text_config"]["rope_parameters"]["rope_type"] = json!("yarn");
        let e = ModelConfig::from_json(&v, path).unwrap_err().to_string();
        assert!(e.contains("rope_parameters") && e.contains("yarn"), "{e}");
        // The interval decides the layer pattern; layer_types only warns.
        let mut v = qwen35();
        v["text_config"]["full_attention_interval"] = json!(2);
        v["text_config"]["layer_types"] = json!([
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention"
        ]);
        let cfg = ModelConfig::from_json(&v, path).unwrap();
        assert_eq!(cfg.layer_kinds[1], LayerKind::FullAttention);
    }

    #[test]
    fn qwen35_moe_tensor_names_follow_mlx_lm_sanitize() {
        let q = ModelConfig::from_json(&qwen35(), Path::new("config.json")).unwrap();
        for (stored, canonical) in [
            (
                "language_model.model.norm.weight",
                "language_model.model.norm.weight",
            ),
            (
                "model.language_model.layers.0.mlp.gate.weight",
                "language_model.model.layers.0.mlp.gate.weight",
            ),
            (
                "model.layers.0.mlp.gate.weight",
                "language_model.model.layers.0.mlp.gate.weight",
            ),
            ("lm_head.weight", "language_model.lm_head.weight"),
            (
                "vision_tower.blocks.0.attn.qkv.weight",
                "vision_tower.blocks.0.attn.qkv.weight",
            ),
            ("model.visual.merger.weight", "model.visual.merger.weight"),
        ] {
            assert_eq!(q.canonical_name(stored), canonical);
        }
        assert!(q.is_text_tensor("language_model.lm_head.weight"));
        assert!(!q.is_text_tensor("language_model.mtp.fc.weight"));
        assert!(!q.is_text_tensor("vision_tower.blocks.0.attn.qkv.weight"));
        let n = ModelConfig::from_json(&base(), Path::new("config.json")).unwrap();
        assert_eq!(n.canonical_name("lm_head.weight"), "lm_head.weight");
        assert!(n.is_text_tensor("model.norm.weight") && !n.is_text_tensor("mtp.fc.weight"));
    }

    #[test]
    fn qwen4_exp_reads_flash_next_fields_and_checks_them() {
        let mut v = qwen35();
        v["model_type"] = json!("qwen4_exp");
        let t = v["text_config"].as_object_mut().unwrap();
        for (k, x) in [
            ("model_type", json!("qwen4_exp_text")),
            ("output_gate_type", json!("sigmoid")),
            ("hc_lowrank", json!(32)),
            ("ple_layer_ids", json!([2])),
            ("ngram_size", json!(3)),
            ("heads_per_ngram", json!(8)),
            ("split_ngram_parts", json!(4)),
            ("indexer_n_heads", json!(4)),
            ("indexer_kv_heads", json!(1)),
            ("indexer_head_dim", json!(32)),
            ("indexer_budget", json!(16)),
            ("indexer_compress_ratio", json!(4)),
            (
                "layer_types",
                json!([
                    "linear_attention",
                    "linear_attention",
                    "linear_attention",
                    "full_attention"
                ]),
            ),
        ] {
            t.insert(k.into(), x);
        }
        let path = Path::new("config.json");
        let cfg = ModelConfig::from_json(&v, path).unwrap();
        assert_eq!(cfg.family, Family::Qwen4Exp);
        assert_eq!(cfg.gate_activation, GateActivation::Sigmoid);
        let x = cfg.flash_next.as_ref().unwrap();
        assert_eq!((x.hc_count, x.hc_lowrank), (4, 32));
        let ple = x.ple.as_ref().unwrap();
        assert_eq!(
            (
                ple.layers.clone(),
                ple.heads(),
                ple.head_dim(),
                ple.conv_state_rows()
            ),
            (vec![1], 16, 4, 9)
        );
        assert_eq!(x.indexer.as_ref().unwrap().block_top_k(), 4);
        assert_eq!(cfg.residual_width(), 4 * 64);
        assert_eq!(cfg.name("lm_head"), "language_model.lm_head");
        // PLE on an attention layer, two indexer key heads, a bad gate: named errors.
        for (field, value, needle) in [
            ("ple_layer_ids", json!([4]), "ple_layer_ids"),
            ("indexer_kv_heads", json!(2), "indexer_kv_heads"),
            ("output_gate_type", json!("gelu"), "output_gate_type"),
            ("indexer_budget", json!(18), "indexer_budget"),
        ] {
            let mut bad = v.clone();
            bad["text_config"][field] = value;
            let e = ModelConfig::from_json(&bad, path).unwrap_err().to_string();
            assert!(e.contains(needle), "{field}: {e}");
        }
    }

    #[test]
    fn rejects_unknown_model_and_bits() {
        let mut v = base();
        v["model_type"] = json!("llama");
        let e = ModelConfig::from_json(&v, Path::new("config.json"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("llama") && e.contains("qwen3_next") && e.contains("qwen3_5_moe"),
            "{e}"
        );
        let mut v = base();
        v["quantization"]["bits"] = json!(3);
        let e = ModelConfig::from_json(&v, Path::new("config.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("3-bit"), "{e}");
    }
}
