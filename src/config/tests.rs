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
