//! The built-in demo runs end to end (the README's first command): it writes the
//! synthetic model, streams its experts through a pool that holds a third of them, prints
//! a short summary (JSON only with `--json`) counting every byte read from the disk, and
//! no control tokens. Synthetic checkpoints' special tokens agree with their configs, so
//! EOS and `<|endoftext|>` stop generation.

use std::process::{Command, Output};

use crate::common::*;
use serde_json::Value;
use slotstream::config::Family;
use slotstream::tools::synth::{write_checkpoint_with, Preset};

fn slotstream(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .args(args)
        .env("RUST_LOG", "slotstream=info")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {err}");
    out
}

#[test]
fn demo_runs_and_streams_through_the_pool() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let base = ["demo", "--max-tokens", "12", "--device", "cpu", "--dir"];
    let dir_arg = dir.to_str().unwrap();
    // --json: one object on stdout, with the pool's counters.
    let out = slotstream(&[&base[..], &[dir_arg, "--json"]].concat());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let pool = &v["pool"];
    let n = |k: &str| pool[k].as_u64().unwrap_or_else(|| panic!("{k}: {pool}"));
    assert!(n("misses") > 0 && n("hits") > 0, "{pool}");
    // Everything read: the prompt (62 tokens) runs outside the pool and its hottest
    // experts are admitted from its sweeps, besides the decode misses and the lookahead.
    assert!(n("sweep_bytes") > 0 && n("sweep_admitted") > 0, "{pool}");
    let parts = [
        "demand_bytes",
        "speculative_bytes",
        "sweep_bytes",
        "admitted_bytes",
        "range_bytes",
    ];
    assert_eq!(
        n("bytes_read"),
        parts.iter().map(|k| n(k)).sum::<u64>(),
        "{pool}"
    );
    let text = v["text"].as_str().unwrap();
    assert!(!text.contains("<|"), "a control token printed: {text:?}");

    // Without --json: the text on stdout and a summary in words, no JSON.
    let out = slotstream(&[&base[..], &[dir_arg]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains('{'), "JSON without --json: {err}");
    assert!(
        !err.contains("creating the demo model"),
        "made twice: {err}"
    );
    for needle in [
        "prefill",
        "tok/s",
        "decode",
        "hit rate",
        "read from disk",
        "prefill sweeps",
        "of decode time waiting on reads",
    ] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let human = slotstream::plan::human(n("bytes_read"));
    assert!(
        err.contains(&format!("{human} read from disk")),
        "{human}: {err}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("<|"));
    // The demo's tokenizer, config and generation config agree on the special ids.
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let config = read_json(&dir.join("config.json"));
    let generation = read_json(&dir.join("generation_config.json"));
    let id = |t: &str| tok.token_to_id(t).map(u64::from);
    assert_eq!(config["eos_token_id"].as_u64(), id("<|im_end|>"));
    assert_eq!(config["bos_token_id"].as_u64(), id("<|endoftext|>"));
    assert_eq!(
        generation["eos_token_id"],
        serde_json::json!([id("<|im_end|>"), id("<|endoftext|>")])
    );
}

/// A demo model made by an older build (its tokenizer numbering the special tokens 256 to
/// 258) gets its tokenizer files rewritten on the next run, weights kept.
#[test]
fn a_stale_demo_tokenizer_is_rewritten() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let args = [
        "demo",
        "--max-tokens",
        "1",
        "--device",
        "cpu",
        "--dir",
        dir.to_str().unwrap(),
    ];
    slotstream(&args);
    let path = dir.join("tokenizer.json");
    edit_json(&path, |v| {
        v["model"]["vocab"]
            .as_object_mut()
            .unwrap()
            .retain(|_, id| id.as_u64().unwrap() < 256);
    });
    let weights = std::fs::metadata(dir.join(INDEX))
        .unwrap()
        .modified()
        .unwrap();
    let err = String::from_utf8_lossy(&slotstream(&args).stderr).into_owned();
    assert!(err.contains("updated the tokenizer"), "{err}");
    let tok = tokenizers::Tokenizer::from_file(&path).unwrap();
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(511));
    assert_eq!(
        std::fs::metadata(dir.join(INDEX))
            .unwrap()
            .modified()
            .unwrap(),
        weights
    );
    let err = String::from_utf8_lossy(&slotstream(&args).stderr).into_owned();
    assert!(
        !err.contains("updated the tokenizer"),
        "rewritten twice: {err}"
    );
}

/// A small Qwen3-Next synth (vocabulary 512: `<|endoftext|>` 509, `<|im_start|>` 510,
/// `<|im_end|>` 511).
const TINY: Preset = Preset {
    name: "tiny",
    family: Family::Qwen3Next,
    hidden: 128,
    layers: 2,
    vocab: 512,
    heads: 2,
    kv_heads: 1,
    head_dim: 64,
    linear_key_heads: 2,
    linear_value_heads: 2,
    linear_head_dim: 32,
    experts: 8,
    top_k: 2,
    intermediate: 64,
    group_size: 64,
    rope_theta: 1e7,
    flash_next: None,
    vision: None,
    mtp: false,
};

/// On a synthetic checkpoint whose head leaves one token's logit finite (every other row
/// of lm_head's scales is NaN, so the sampler leaves those out): `<|im_end|>` and
/// `<|endoftext|>` end generation at once (finish reason `eos`); `<|im_start|>`, which
/// does not stop, is generated but prints nothing. The non-finite logits are reported in
/// one warning with their count.
#[test]
fn synthetic_special_tokens_stop_and_never_print() {
    let made = tempfile::tempdir().unwrap();
    write_checkpoint_with(made.path(), &TINY, TINY.layers, false, None).unwrap();
    for (token, id, stops) in [
        ("<|im_end|>", 511u32, true),
        ("<|endoftext|>", 509, true),
        ("<|im_start|>", 510, false),
    ] {
        let tmp = copy_dir(made.path());
        let tok = tokenizers::Tokenizer::from_file(tmp.path().join("tokenizer.json")).unwrap();
        assert_eq!(tok.token_to_id(token), Some(id));
        fill_rows(tmp.path(), "lm_head.scales", |r| {
            (r != id as usize).then_some(f32::NAN)
        });
        let out = slotstream(&[
            "generate",
            "--model",
            tmp.path().to_str().unwrap(),
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "4",
            "--json",
            "--device",
            "cpu",
        ]);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let ids: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
        let reason = v["stats"]["finish_reason"].as_str().unwrap();
        if stops {
            assert_eq!((ids.len(), reason), (0, "eos"), "{token}: {v}");
        } else {
            assert_eq!((ids, reason), (vec![id; 4], "length"), "{token}: {v}");
        }
        assert_eq!(v["text"], "", "{token}: {v}");
        let err = String::from_utf8_lossy(&out.stderr);
        let warnings: Vec<&str> = err
            .lines()
            .filter(|l| l.contains("non_finite_logits"))
            .collect();
        let steps = if stops { 1 } else { 4 };
        assert_eq!(warnings.len(), 1, "{token}: {err}");
        assert!(
            warnings[0].contains(&format!("non_finite_logits={}", 511 * steps))
                && warnings[0].contains(&format!("steps={steps}")),
            "{token}: {err}"
        );
    }
}
