//! `config.json` of a checkpoint: the model's geometry and its MLX quantization block.
//!
//! Field names follow the Hugging Face / mlx-lm configs (mlx-lm 0.32.2
//! `mlx_lm/models/qwen3_next.py`, `ModelArgs`). Newer multimodal checkpoints nest the
//! text model's fields under `text_config`; those fields take precedence over the top level.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Model families this build implements, by `model_type`.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["qwen3_next"];

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
                message: format!("group size {group_size} is not supported (supported: 32, 64, 128)"),
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
    /// The spec of module `path` if its config entry says it is quantized.
    /// `None` means the config has no per-module entry: the caller decides from the
    /// presence of `.scales` (mlx-lm `load_model` does the same).
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
    pub quantization: Quantization,
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
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| self.err(field, format!("expected a non-negative integer, found {v}"))),
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
            Some(Value::Number(n)) if n.is_u64() => Ok(vec![n.as_u64().unwrap_or_default() as usize]),
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
        // The text model's fields, with `text_config` overriding the top level.
        let mut merged = top.clone();
        if let Some(Value::Object(text)) = top.get("text_config") {
            for (k, v) in text {
                if k != "model_type" {
                    merged.insert(k.clone(), v.clone());
                }
            }
        }
        let f = Fields { obj: &merged, path };
        let model_type = f
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| f.err("model_type", "missing"))?
            .to_string();
        if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
            return Err(Error::UnsupportedModel {
                path: path.to_path_buf(),
                model_type,
                supported: SUPPORTED_MODEL_TYPES.join(", "),
            });
        }
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
            Some(r) if r.get("partial_rotary_factor").is_some() => r.f64_or("partial_rotary_factor", None)?,
            _ => f.f64_or("partial_rotary_factor", Some(1.0))?,
        };

        let hidden_size = f.usize("hidden_size")?;
        let num_attention_heads = f.usize("num_attention_heads")?;
        let head_dim = f.usize_or("head_dim", Some(hidden_size / num_attention_heads.max(1)))?;
        let rotary_dim = (head_dim as f64 * partial) as usize;
        if rotary_dim % 2 != 0 || rotary_dim > head_dim {
            return Err(f.err("partial_rotary_factor", format!("gives {rotary_dim} rotary dims of {head_dim}")));
        }
        let num_hidden_layers = f.usize("num_hidden_layers")?;
        let layer_kinds = match f.get("layer_types") {
            Some(Value::Array(types)) => {
                if types.len() != num_hidden_layers {
                    return Err(f.err(
                        "layer_types",
                        format!("has {} entries for {num_hidden_layers} layers", types.len()),
                    ));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("linear_attention") => Ok(LayerKind::LinearAttention),
                        Some("full_attention") => Ok(LayerKind::FullAttention),
                        _ => Err(f.err("layer_types", format!("unknown layer type {t}"))),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            _ => {
                let interval = f.usize_or("full_attention_interval", Some(4))?.max(1);
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerKind::FullAttention
                        } else {
                            LayerKind::LinearAttention
                        }
                    })
                    .collect()
            }
        };

        let cfg = ModelConfig {
            path: path.to_path_buf(),
            model_type,
            hidden_size,
            num_hidden_layers,
            vocab_size: f.usize("vocab_size")?,
            rms_norm_eps: f.f64_or("rms_norm_eps", Some(1e-6))? as f32,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", Some(num_attention_heads))?,
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
            norm_topk_prob: f.bool_or("norm_topk_prob", false)?,
            intermediate_size: f.usize_or("intermediate_size", Some(0))?,
            decoder_sparse_step: f.usize_or("decoder_sparse_step", Some(1))?.max(1),
            mlp_only_layers: f.usize_list("mlp_only_layers")?,
            layer_kinds,
            eos_token_ids: f
                .usize_list("eos_token_id")?
                .into_iter()
                .map(|v| u32::try_from(v).map_err(|_| f.err("eos_token_id", format!("{v} is not a token id"))))
                .collect::<Result<_>>()?,
            quantization: parse_quantization(&f)?,
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
            ("shared_expert_intermediate_size", self.shared_expert_intermediate_size),
        ] {
            if v == 0 {
                return Err(err(field, "must be at least 1".into()));
            }
        }
        if self.linear_key_head_dim > 256 {
            return Err(err(
                "linear_key_head_dim",
                format!("{} is above the 256 the kernels support", self.linear_key_head_dim),
            ));
        }
        if let Some(bad) = self.eos_token_ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(err("eos_token_id", format!("{bad} is outside the vocabulary of {}", self.vocab_size)));
        }
        if self.num_key_value_heads == 0 || self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(err(
                "num_key_value_heads",
                format!("{} does not divide {} query heads", self.num_key_value_heads, self.num_attention_heads),
            ));
        }
        if self.linear_num_key_heads == 0 || self.linear_num_value_heads % self.linear_num_key_heads != 0 {
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
                format!("{} with {} experts", self.num_experts_per_tok, self.num_experts),
            ));
        }
        if self.linear_conv_kernel_dim == 0 {
            return Err(err("linear_conv_kernel_dim", "must be at least 1".into()));
        }
        Ok(())
    }

    /// Whether layer `i` has a routed-expert MoE block (else a dense MLP),
    /// as mlx-lm's `Qwen3NextDecoderLayer` decides it.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i) && self.num_experts > 0 && (i + 1) % self.decoder_sparse_step == 0
    }

    /// Indices of the layers that have routed experts, ascending.
    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.num_hidden_layers).filter(|&i| self.is_moe_layer(i)).collect()
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
            return Err(f.err("quantization.mode", format!("{mode} is not supported (supported: \"affine\")")));
        }
    }
    let bits = qf.usize("bits").map_err(|_| f.err("quantization.bits", "missing or not an integer"))?;
    let group = qf
        .usize("group_size")
        .map_err(|_| f.err("quantization.group_size", "missing or not an integer"))?;
    let default = QuantSpec::new(bits, group, f.path, "quantization")?;
    let mut overrides = BTreeMap::new();
    for (key, value) in obj {
        let field = format!("quantization.{key}");
        match value {
            Value::Object(m) => {
                let mf = Fields { obj: m, path: f.path };
                let bits = mf.usize_or("bits", Some(default.bits as usize)).map_err(|_| f.err(&field, "bad bits"))?;
                let group = mf
                    .usize_or("group_size", Some(default.group_size))
                    .map_err(|_| f.err(&field, "bad group_size"))?;
                overrides.insert(key.clone(), Some(QuantSpec::new(bits, group, f.path, &field)?));
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
            Some(Some(QuantSpec { bits: 8, group_size: 64 }))
        );
    }

    #[test]
    fn text_config_is_merged() {
        let mut nested = json!({"model_type": "qwen3_next", "text_config": base()});
        nested["text_config"]["hidden_size"] = json!(128);
        let cfg = ModelConfig::from_json(&nested, Path::new("config.json")).unwrap();
        assert_eq!(cfg.hidden_size, 128);
    }

    #[test]
    fn rejects_unknown_model_and_bits() {
        let mut v = base();
        v["model_type"] = json!("llama");
        let e = ModelConfig::from_json(&v, Path::new("config.json")).unwrap_err().to_string();
        assert!(e.contains("llama") && e.contains("qwen3_next"), "{e}");
        let mut v = base();
        v["quantization"]["bits"] = json!(3);
        let e = ModelConfig::from_json(&v, Path::new("config.json")).unwrap_err().to_string();
        assert!(e.contains("3-bit"), "{e}");
    }
}
