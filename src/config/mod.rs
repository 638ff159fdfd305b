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
//!   is `null`. `mrope_section` / `mrope_interleaved` become [`MRope`], used only by a
//!   sequence with images: for text positions M-RoPE reduces to the plain `nn.RoPE`
//!   mlx-lm builds for rope type `default`;
//! - the layer pattern follows `full_attention_interval` (mlx-lm ignores `layer_types`);
//! - every layer is MoE when `num_experts > 0` (`mlp_only_layers` and
//!   `decoder_sparse_step` are ignored), and `norm_topk_prob` defaults to true.
//!
//! The submodules: the quantization block ([`QuantSpec`], [`Quantization`]) in
//! `quantization.rs`, Qwen3.8-Flash-Next's fields ([`FlashNext`]) in `flash_next.rs`, and
//! the field readers that name the field in every error in `fields.rs`.

mod fields;
mod flash_next;
mod quantization;
mod vision;

#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

use fields::Fields;
use flash_next::parse_flash_next;
pub use flash_next::{FlashNext, IndexerConfig, PleConfig};
use quantization::parse_quantization;
pub use quantization::{QuantSpec, Quantization};
use vision::parse_vision;
pub use vision::{VisionConfig, VISION_PREFIXES};

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
    /// The multimodal rotary sections (`rope_parameters.mrope_section`), where the config
    /// has them: how the rotary frequencies split over an image token's (t, h, w)
    /// positions. Text-only sequences never use it.
    pub mrope: Option<MRope>,
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
    /// config does not say. Bounds the context (`context::limit`).
    pub max_position_embeddings: Option<usize>,
    pub quantization: Quantization,
    /// Activation of the gated DeltaNet's output gate.
    pub gate_activation: GateActivation,
    /// Qwen3.8-Flash-Next's extra blocks; `None` for the other families.
    pub flash_next: Option<FlashNext>,
    /// The vision tower (`vision_config` at the top level of a Qwen3.5-MoE or Flash-Next
    /// config); `None` for a text-only checkpoint and for Qwen3-Next.
    pub vision: Option<VisionConfig>,
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
        let mrope = parse_mrope(&f, &merged)?;

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
        if let Some(m) = &mrope {
            if m.section.iter().sum::<usize>() != rotary_dim / 2 {
                return Err(f.err(
                    "rope_parameters",
                    format!(
                        "mrope_section {:?} does not cover the {} rotary frequencies",
                        m.section,
                        rotary_dim / 2
                    ),
                ));
            }
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
            Family::Qwen4Exp => Some(parse_flash_next(&f, num_hidden_layers, hidden_size)?),
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
            mrope,
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
            vision: match family {
                Family::Qwen3Next => None,
                Family::Qwen35Moe | Family::Qwen4Exp => parse_vision(&top_f)?,
            },
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

    /// Whether tensor `name` belongs to a vision tower (under [`VISION_PREFIXES`]).
    pub fn is_vision_tensor(&self, name: &str) -> bool {
        is_vision_tensor(name)
    }

    /// The name mlx-lm's `sanitize` gives a stored tensor. Qwen3.5-MoE (`qwen3_5_moe.py`):
    /// `model.language_model.*` becomes `language_model.model.*`, `language_model.*` stays,
    /// vision tensors (`vision_tower*`, `model.visual*`) keep their names (and are unused),
    /// anything else gets `language_model.` in front. Qwen3-Next names are kept.
    pub fn canonical_name<'a>(&self, stored: &'a str) -> Cow<'a, str> {
        match self.family {
            Family::Qwen3Next => Cow::Borrowed(stored),
            Family::Qwen35Moe | Family::Qwen4Exp => {
                if is_vision_tensor(stored) {
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

fn is_vision_tensor(name: &str) -> bool {
    VISION_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Multimodal RoPE (M-RoPE) as transformers 5.24 `Qwen3_5MoeTextRotaryEmbedding` applies
/// it: each of the `rotary_dim / 2` frequencies rotates by one axis of a token's
/// (t, h, w) position; a text token has all three equal, so its rotation is plain RoPE's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MRope {
    /// Frequencies per axis (t, h, w), summing to `rotary_dim / 2` (`[11, 11, 10]`
    /// released).
    pub section: [usize; 3],
    /// Interleaved (`mrope_interleaved`: frequency `j` is h's when `j % 3 == 1` and
    /// `j < 3 * section[1]`, w's when `j % 3 == 2` and `j < 3 * section[2]`, else t's, as
    /// `recomposition_frequencies`), or in consecutive blocks t, h, w (Qwen2-VL's layout).
    pub interleaved: bool,
}

impl MRope {
    /// The axis (0 = t, 1 = h, 2 = w) whose position rotates frequency `j`.
    pub fn axis(&self, j: usize) -> usize {
        let s = self.section;
        if self.interleaved {
            match j % 3 {
                1 if j < 3 * s[1] => 1,
                2 if j < 3 * s[2] => 2,
                _ => 0,
            }
        } else if j < s[0] {
            0
        } else if j < s[0] + s[1] {
            1
        } else {
            2
        }
    }
}

/// `rope_parameters.mrope_section` (three counts) and `mrope_interleaved` (default
/// false), when the config has a section. Errors: a section that is not three counts.
fn parse_mrope(f: &Fields<'_>, obj: &Map<String, Value>) -> Result<Option<MRope>> {
    let Some(Value::Object(rope)) = obj.get("rope_parameters") else {
        return Ok(None);
    };
    let section = match rope.get("mrope_section") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(v)) if v.len() == 3 && v.iter().all(|n| n.as_u64().is_some()) => {
            [0, 1, 2].map(|i| v[i].as_u64().unwrap_or(0) as usize)
        }
        Some(v) => {
            return Err(f.err(
                "rope_parameters",
                format!("mrope_section must be three counts, found {v}"),
            ))
        }
    };
    let interleaved = match rope.get("mrope_interleaved") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(f.err(
                "rope_parameters",
                format!("mrope_interleaved must be a boolean, found {v}"),
            ))
        }
    };
    Ok(Some(MRope {
        section,
        interleaved,
    }))
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
