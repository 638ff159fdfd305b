//! config.json of a synthetic checkpoint, as mlx-lm or the released conversion writes it.

use serde_json::json;

use crate::config::Family;

use super::presets::{FlashNextShape, Preset};

impl Preset {
    /// config.json for `layers` layers, as mlx-lm's `save_config` writes it; for
    /// Qwen3.8-Flash-Next, as the released conversion has it (reference-system.md A.1, A.8:
    /// `text_config` with `layer_types` for the layers kept, the n-gram shards' overrides).
    pub fn config(&self, layers: usize) -> serde_json::Value {
        if let Some(x) = &self.flash_next {
            return self.flash_next_config(x, layers);
        }
        let prefix = self.family.prefix();
        let mut quant = serde_json::Map::new();
        quant.insert("group_size".into(), json!(self.group_size));
        quant.insert("bits".into(), json!(4));
        quant.insert("mode".into(), json!("affine"));
        for l in 0..layers {
            for m in ["mlp.gate", "mlp.shared_expert_gate"] {
                quant.insert(
                    format!("{prefix}model.layers.{l}.{m}"),
                    json!({"group_size": 64, "bits": 8}),
                );
            }
        }
        let mut text = json!({
            "hidden_size": self.hidden, "num_hidden_layers": layers, "vocab_size": self.vocab,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_key_heads, "linear_num_value_heads": self.linear_value_heads,
            "linear_key_head_dim": self.linear_head_dim, "linear_value_head_dim": self.linear_head_dim,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
            "num_experts": self.experts, "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.intermediate, "shared_expert_intermediate_size": self.intermediate,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
            "max_position_embeddings": 262_144,
            "bos_token_id": self.vocab - 3, "eos_token_id": self.vocab - 1,
        });
        let fields = text.as_object_mut().expect("an object");
        match self.family {
            Family::Qwen3Next => {
                for (k, v) in [
                    ("model_type", json!("qwen3_next")),
                    ("architectures", json!(["Qwen3NextForCausalLM"])),
                    ("partial_rotary_factor", json!(0.25)),
                    ("rope_theta", json!(self.rope_theta)),
                    ("rope_scaling", json!(null)),
                    ("intermediate_size", json!(4 * self.hidden)),
                    ("decoder_sparse_step", json!(1)),
                    ("mlp_only_layers", json!([])),
                    ("norm_topk_prob", json!(true)),
                    ("quantization", json!(quant.clone())),
                    ("quantization_config", json!(quant)),
                ] {
                    fields.insert(k.into(), v);
                }
                text
            }
            Family::Qwen35Moe | Family::Qwen4Exp => {
                fields.insert("model_type".into(), json!("qwen3_5_moe_text"));
                fields.insert(
                    "rope_parameters".into(),
                    json!({"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": 0.25,
                           "mrope_section": mrope_section(self.head_dim), "mrope_interleaved": true}),
                );
                let mut top = json!({
                    "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                    "text_config": text, "tie_word_embeddings": false,
                    "quantization": quant.clone(), "quantization_config": quant,
                });
                self.add_vision_config(&mut top);
                top
            }
        }
    }

    /// config.json of a Qwen3.8-Flash-Next checkpoint of `layers` layers, as the released
    /// conversion has it (reference-system.md A.1, A.8): the text model under
    /// `text_config`, with `layer_types` for the layers kept and no `seed` (transformers'
    /// default 1234 gives the stored multipliers), and a quantization block of 4 bits,
    /// group 64, with a group-`ngram_group_size` override per n-gram shard and no other
    /// (the unquantized modules have no `.scales`), keyed as the release keys them:
    /// `model.layers.1.ple.ple_embedding.ngram_embedding.shard_N`, without the
    /// `language_model.` prefix its tensor names carry. With the preset's vision tower it
    /// has a `vision_config` and `language_model_only` false; without, true.
    fn flash_next_config(&self, x: &FlashNextShape, layers: usize) -> serde_json::Value {
        let mut quant = serde_json::Map::new();
        quant.insert("group_size".into(), json!(self.group_size));
        quant.insert("bits".into(), json!(4));
        quant.insert("mode".into(), json!("affine"));
        for s in 0..x.ngram_shards {
            quant.insert(
                format!(
                    "model.layers.{}.ple.ple_embedding.ngram_embedding.shard_{s}",
                    x.ple_layer
                ),
                json!({"group_size": x.ngram_group_size, "bits": 4}),
            );
        }
        let layer_types: Vec<&str> = (0..layers)
            .map(|l| {
                if self.is_full_attention(l) {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect();
        // The release writes the base as an integer.
        let theta = self.rope_theta as u64;
        let mut text = serde_json::Map::new();
        for (k, v) in [
            ("model_type", json!("qwen4_exp_text")),
            ("attention_bias", json!(false)),
            ("attention_dropout", json!(0.0)),
            ("bos_token_id", json!(x.eos)),
            ("eos_token_id", json!(x.eos)),
            ("pad_token_id", json!(null)),
            ("dtype", json!("bfloat16")),
            ("hidden_act", json!("silu")),
            ("hidden_size", json!(self.hidden)),
            ("initializer_range", json!(0.02)),
            ("num_hidden_layers", json!(layers)),
            ("layer_types", json!(layer_types)),
            ("full_attention_interval", json!(4)),
            ("vocab_size", json!(self.vocab)),
            ("max_position_embeddings", json!(262_144)),
            ("rms_norm_eps", json!(1e-6)),
            ("tie_word_embeddings", json!(false)),
            ("use_cache", json!(true)),
            ("num_attention_heads", json!(self.heads)),
            ("num_key_value_heads", json!(self.kv_heads)),
            ("head_dim", json!(self.head_dim)),
            (
                "rope_parameters",
                json!({"rope_type": "default", "rope_theta": theta,
                       "partial_rotary_factor": 0.25, "mrope_interleaved": true,
                       "mrope_section": mrope_section(self.head_dim)}),
            ),
            ("linear_num_key_heads", json!(self.linear_key_heads)),
            ("linear_num_value_heads", json!(self.linear_value_heads)),
            ("linear_key_head_dim", json!(self.linear_head_dim)),
            ("linear_value_head_dim", json!(self.linear_head_dim)),
            ("linear_conv_kernel_dim", json!(4)),
            ("mamba_ssm_dtype", json!("float32")),
            ("output_gate_type", json!("sigmoid")),
            ("num_experts", json!(self.experts)),
            ("num_experts_per_tok", json!(self.top_k)),
            ("moe_intermediate_size", json!(self.intermediate)),
            ("shared_expert_intermediate_size", json!(self.intermediate)),
            ("router_aux_loss_coef", json!(0.001)),
            ("output_router_logits", json!(false)),
            ("hc_count", json!(x.hc_count)),
            ("hc_lowrank", json!(x.hc_lowrank)),
            ("indexer_n_heads", json!(x.indexer_heads)),
            ("indexer_kv_heads", json!(1)),
            ("indexer_head_dim", json!(x.indexer_head_dim)),
            ("indexer_budget", json!(x.indexer_budget)),
            ("indexer_compress_ratio", json!(x.indexer_compress_ratio)),
            ("ple_layer_ids", json!([x.ple_layer + 1])),
            ("ple_embed_dim", json!(self.hidden)),
            ("ple_conv_kernel_size", json!(x.ple_conv_kernel)),
            ("ngram_size", json!(x.ngram_size)),
            ("heads_per_ngram", json!(x.heads_per_ngram)),
            ("ngram_vocab_size_base", json!(x.ngram_vocab_base)),
            (
                "make_ngram_vocab_size_divisible_by",
                json!(x.ngram_divisible_by),
            ),
            ("split_ngram_parts", json!(x.ngram_shards)),
            (
                "mtp",
                json!({"hybrid": true, "layer_types": ["full_attention"], "num_hidden_layers": 1,
                       "rope_theta": theta, "mtp_use_hidden_state_from_layer": null}),
            ),
            ("mtp_num_hidden_layers", json!(1)),
            ("mtp_use_dedicated_embeddings", json!(false)),
        ] {
            text.insert(k.into(), v);
        }
        // The released vision placeholders (A.1), with or without a tower.
        let mut top = json!({
            "architectures": ["Qwen4ExpForConditionalGeneration"],
            "model_type": "qwen4_exp",
            "transformers_version": "5.8.0.dev0",
            "tie_word_embeddings": false,
            "language_model_only": self.vision.is_none(),
            "image_token_id": 248_056, "video_token_id": 248_057,
            "vision_start_token_id": 248_053, "vision_end_token_id": 248_054,
            "text_config": text,
            "quantization": quant.clone(), "quantization_config": quant,
        });
        self.add_vision_config(&mut top);
        top
    }

    /// Adds the tower's `vision_config` (transformers' `Qwen3_5MoeVisionConfig` fields) and
    /// the released placeholder ids to a config's top level, where the preset has a tower.
    fn add_vision_config(&self, top: &mut serde_json::Value) {
        let Some(v) = &self.vision else {
            return;
        };
        for (k, value) in [
            (
                "vision_config",
                json!({
                    "model_type": "qwen3_5_moe_vision", "depth": v.depth, "hidden_size": v.hidden,
                    "intermediate_size": v.intermediate, "num_heads": v.heads, "in_channels": 3,
                    "patch_size": v.patch, "temporal_patch_size": v.temporal_patch,
                    "spatial_merge_size": v.merge, "out_hidden_size": self.hidden,
                    "num_position_embeddings": v.positions, "hidden_act": "gelu_pytorch_tanh",
                    "deepstack_visual_indexes": [],
                }),
            ),
            ("image_token_id", json!(248_056)),
            ("video_token_id", json!(248_057)),
            ("vision_start_token_id", json!(248_053)),
            ("vision_end_token_id", json!(248_054)),
        ] {
            top[k] = value;
        }
    }
}

/// M-RoPE sections of a head of `head_dim` with a partial rotary factor of 0.25: the
/// released `[11, 11, 10]` of 32 frequencies, scaled to `head_dim / 8` (they must sum to it).
fn mrope_section(head_dim: usize) -> [usize; 3] {
    let half = head_dim / 8;
    let section = (half * 11).div_ceil(32).min(half / 2);
    [section, section, half - 2 * section]
}
