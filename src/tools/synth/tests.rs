use serde_json::json;

use super::tensors::TensorSpec;
use super::tokenizer::{filler, tokenizer_files};
use super::*;
use crate::config::{Family, LayerKind, ModelConfig};

fn shapes(tensors: &[TensorSpec]) -> Vec<(String, &'static str, Vec<usize>)> {
    tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
        .collect()
}

/// The released n-gram table (reference-system.md A.6, models.md §5.2): primes after
/// 20,000,000, 128 shards of 2,500,012 rows, 32,000,153,600 bytes.
#[test]
fn flash_next_ngram_table_has_the_released_geometry() {
    let g = QWEN38_FLASH_NEXT.ngram_geometry().unwrap();
    assert_eq!(g.sizes.len(), 16);
    assert_eq!((g.sizes[0], g.sizes[15]), (20_000_003, 20_000_171));
    assert_eq!((g.offsets[1], g.offsets[15]), (20_000_003, 300_001_275));
    assert_eq!(g.sizes.iter().sum::<i64>(), 320_001_446);
    assert_eq!(g.rows_per_shard, 2_500_012);
    // Odd, and small enough that no token id times one overflows.
    let limit = i64::MAX / 248_320;
    assert!(g.multipliers.iter().all(|&m| m % 2 == 1 && m < limit));
    let table: u64 = QWEN38_FLASH_NEXT
        .layer_tensors(1)
        .iter()
        .filter(|t| t.name.contains(".ngram_embedding.shard_"))
        .map(TensorSpec::bytes)
        .sum();
    assert_eq!(table, 32_000_153_600);
}

/// The released byte budget (A.7, A.8): 24,576 records of 2,764,800 bytes, 4-bit
/// embeddings and head of 357,580,800 bytes each.
#[test]
fn flash_next_sizes_match_the_release() {
    let p = QWEN38_FLASH_NEXT;
    let experts: u64 = (0..48)
        .flat_map(|l| p.layer_tensors(l))
        .filter(|t| t.name.contains(".switch_mlp."))
        .map(|t| t.bytes())
        .sum();
    assert_eq!(experts, 24_576 * 2_764_800);
    for t in p.head_tensors().chunks(3).take(2) {
        assert_eq!(t.iter().map(TensorSpec::bytes).sum::<u64>(), 357_580_800);
    }
    // The text model's 102,871,883,800 bytes and the vision tower's 897,862,112 (bf16).
    assert_eq!(
        p.vision_tensors()
            .iter()
            .map(TensorSpec::bytes)
            .sum::<u64>(),
        897_862_112
    );
    assert_eq!(p.checkpoint_bytes(48), 103_769_745_912);
}

/// An attention layer (l % 4 == 3) holds QSA attention with its bf16 indexer and
/// no gated DeltaNet (reference-system.md A.5).
#[test]
fn flash_next_attention_layer_has_the_released_tensors() {
    let p = "language_model.model.layers.3.self_attn";
    let q = |m: &str, out: usize, inp: usize| {
        [
            (format!("{p}.{m}.weight"), "U32", vec![out, inp / 8]),
            (format!("{p}.{m}.scales"), "BF16", vec![out, inp / 64]),
            (format!("{p}.{m}.biases"), "BF16", vec![out, inp / 64]),
        ]
    };
    let mut want: Vec<(String, &str, Vec<usize>)> = [
        q("q_proj", 12_288, 2560),
        q("k_proj", 512, 2560),
        q("v_proj", 512, 2560),
        q("o_proj", 2560, 6144),
    ]
    .concat();
    for (m, shape) in [
        ("q_norm", vec![256]),
        ("k_norm", vec![256]),
        ("indexer.index_qk_proj", vec![640, 2560]),
        ("indexer.q_layernorm", vec![128]),
        ("indexer.k_layernorm", vec![128]),
    ] {
        want.push((format!("{p}.{m}.weight"), "BF16", shape));
    }
    let got: Vec<_> = shapes(&QWEN38_FLASH_NEXT.layer_tensors(3))
        .into_iter()
        .filter(|(n, _, _)| n.contains(".self_attn.") || n.contains(".linear_attn."))
        .collect();
    assert_eq!(got, want);
}

/// The config parses as the released model: 48 layers of `[lin, lin, lin, full]`, the
/// Flash-Next fields, and 128 group-32 overrides; with `--layers 2`, two linear layers.
#[test]
fn flash_next_config_reads_back_as_the_release() {
    let path = std::path::Path::new("config.json");
    let v = QWEN38_FLASH_NEXT.config(48);
    let cfg = ModelConfig::from_json(&v, path).unwrap();
    assert_eq!(cfg.family, Family::Qwen4Exp);
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.vocab_size,
            cfg.num_experts,
            cfg.rotary_dim
        ),
        (2560, 248_320, 512, 64)
    );
    assert_eq!(cfg.layer_kinds.len(), 48);
    assert!(cfg
        .layer_kinds
        .iter()
        .enumerate()
        .all(|(l, &k)| (k == LayerKind::FullAttention) == (l % 4 == 3)));
    let x = cfg.flash_next.clone().unwrap();
    assert_eq!(x.ple.unwrap().split_parts, 128);
    assert_eq!(x.indexer.unwrap().budget, 2048);
    let quant = v["quantization"].as_object().unwrap();
    assert_eq!(quant.len(), 3 + 128);
    // Keyed as released, without the tensors' `language_model.` prefix, and found.
    let shard = "model.layers.1.ple.ple_embedding.ngram_embedding.shard_127";
    assert_eq!(quant[shard], json!({"group_size": 32, "bits": 4}));
    assert!(quant.keys().all(|k| !k.starts_with("language_model.")));
    assert_eq!(
        cfg.quant_override(&format!("language_model.{shard}")),
        Some(Some(crate::config::QuantSpec {
            bits: 4,
            group_size: 32
        }))
    );
    assert_eq!(
        v["text_config"]["rope_parameters"]["mrope_section"],
        json!([11, 11, 10])
    );
    assert!(v["text_config"].get("seed").is_none());
    let two = ModelConfig::from_json(&QWEN38_FLASH_NEXT.config(2), path).unwrap();
    assert_eq!(two.layer_kinds, [LayerKind::LinearAttention; 2]);
}

/// Every preset's tokenizer.json gives `<|endoftext|>`, `<|im_start|>` and
/// `<|im_end|>` the ids config.json and generation_config.json use (BOS and EOS),
/// loaded by the `tokenizers` crate as the engine loads it (which renumbers added
/// tokens that do not follow the model's vocabulary); text still encodes byte by byte.
#[test]
fn special_token_ids_agree_with_the_configs() {
    for p in PRESETS {
        let config = p.config(p.min_layers());
        let text = config.get("text_config").unwrap_or(&config);
        let [tok_json, _, generation] = tokenizer_files(p.special_tokens());
        let tok: tokenizers::Tokenizer = tok_json.1.to_string().parse().unwrap();
        let id = |t: &str| tok.token_to_id(t).map(|i| i as u64);
        let (eot, end) = (id("<|endoftext|>"), id("<|im_end|>"));
        assert_eq!(id("<|im_start|>"), eot.map(|e| e + 1), "{}", p.name);
        assert_eq!(text["bos_token_id"].as_u64(), eot, "{}: BOS", p.name);
        let eos = text["eos_token_id"].as_u64();
        assert!(eos == end || eos == eot, "{}: EOS {eos:?}", p.name);
        assert_eq!(
            generation.1["eos_token_id"],
            json!([end, eot]),
            "{}",
            p.name
        );
        assert_eq!(
            tok.get_vocab_size(true) as u64,
            end.unwrap() + 1,
            "{}",
            p.name
        );
        assert!(end.unwrap() < p.vocab as u64, "{}", p.name);
        let enc = tok.encode("hi <|im_end|>", false).unwrap();
        assert_eq!(
            enc.get_ids(),
            [b'h' as u32, b'i' as u32, b' ' as u32, end.unwrap() as u32]
        );
    }
    assert_eq!(
        [filler(0), filler(25), filler(26), filler(675), filler(676)],
        ["aa", "az", "ba", "zz", "aaa"]
    );
}

/// `--ngram-rows` shrinks the table and its hashing buffers follow; bad values, presets
/// without a table and too few layers are refused with named errors.
#[test]
fn ngram_rows_and_layers_are_checked() {
    let small = QWEN38_FLASH_NEXT.with_ngram_rows(1).unwrap();
    let g = small.ngram_geometry().unwrap();
    // The first 16 primes (sum 381), padded to 384 rows over 128 shards.
    assert_eq!((g.sizes[0], g.sizes[15], g.rows_per_shard), (2, 53, 3));
    assert!(small.check(2).is_ok());
    for (result, needle) in [
        (
            QWEN38_FLASH_NEXT.with_ngram_rows(0).map(|_| ()),
            "between 1",
        ),
        (
            QWEN38_FLASH_NEXT.with_ngram_rows(20_000_001).map(|_| ()),
            "20000000",
        ),
        (DEMO.with_ngram_rows(10).map(|_| ()), "no n-gram table"),
        (QWEN38_FLASH_NEXT.check(1), "at least 2 layers"),
        (
            Preset {
                flash_next: None,
                ..QWEN38_FLASH_NEXT
            }
            .check(2),
            "qwen4_exp",
        ),
    ] {
        let e = result.unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
    assert_eq!((QWEN38_FLASH_NEXT.min_layers(), DEMO.min_layers()), (2, 1));
}
