//! `slotstream score`, `plan`, `pack` and `bench` end to end on every fixture family
//! (Qwen3-Next, Qwen3.5-MoE, Qwen3.8-Flash-Next): scores and logits against the oracle's,
//! the plan's resident weights against the checkpoint's tensors, a pack the engine then
//! reads from, and bench's counts (n-gram rows for Flash-Next).

mod common;

use std::fs;
use std::process::{Command, Output};

use common::*;
use slotstream::checkpoint::Checkpoint;

fn slotstream(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .args(args)
        .env("RUST_LOG", "slotstream=info")
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> (String, String) {
    let out = slotstream(args);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{args:?}: {stderr}");
    (stdout, stderr)
}

fn ids_arg(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn score_cli_matches_mlx_lm_mapped_and_pooled() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let r = reference(name);
        let dir = fixture_dir(name);
        let ids = ids_arg(&r.scored_ids);
        let npy = tmp.path().join(format!("{name}.npy"));
        for pool in [None, Some("24")] {
            let mut args = vec![
                "score",
                "--model",
                dir.to_str().unwrap(),
                "--ids",
                &ids,
                "--device",
                "cpu",
            ];
            args.extend(["--logits-out", npy.to_str().unwrap()]);
            if let Some(slots) = pool {
                args.extend(["--pool-slots", slots]);
            }
            let (stdout, _) = ok(&args);
            let ppl: f64 = stdout
                .lines()
                .find_map(|l| l.strip_prefix("perplexity: "))
                .unwrap_or_else(|| panic!("{name}: no perplexity in {stdout}"))
                .trim()
                .parse()
                .unwrap();
            let rel = (ppl - r.perplexity).abs() / r.perplexity;
            assert!(
                rel < 5e-5,
                "{name} pool {pool:?}: perplexity {ppl} vs mlx-lm {}",
                r.perplexity
            );
            let logits: Vec<f32> = npyz::NpyFile::new(fs::File::open(&npy).unwrap())
                .unwrap()
                .into_vec()
                .unwrap();
            assert_eq!(logits.len(), r.logits.len());
            for t in 0..r.scored_ids.len() {
                let row = t * r.vocab..(t + 1) * r.vocab;
                let e = rel_err(&logits[row.clone()], &r.logits[row]);
                assert!(
                    e <= 1e-3,
                    "{name} pool {pool:?}: position {t}: relative logit error {e}"
                );
            }
        }
    }
}

#[test]
fn plan_cli_counts_the_text_models_weights() {
    for name in FIXTURES {
        let dir = fixture_dir(name);
        let (stdout, _) = ok(&[
            "plan",
            "--model",
            dir.to_str().unwrap(),
            "--memory-budget",
            "64MiB",
            "--json",
        ]);
        let plan: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        // Every tensor of the fixture but the routed experts and Flash-Next's n-gram
        // table (both stay on the SSD), as the backends hold it: unquantized bf16 widened
        // to f32.
        let ckpt = Checkpoint::open(&dir).unwrap();
        let want: u64 = ckpt
            .tensors()
            .filter(|t| !t.name.contains(".switch_mlp.") && !t.name.contains(".ngram_embedding."))
            .map(|t| {
                let scales = t
                    .name
                    .strip_suffix(".weight")
                    .map(|m| format!("{m}.scales"));
                let quantized = scales.is_some_and(|s| ckpt.contains(&s));
                if t.dtype == safetensors::Dtype::BF16 && !quantized {
                    t.len * 2
                } else {
                    t.len
                }
            })
            .sum();
        assert!(want > 0);
        assert_eq!(
            plan["resident_weights"].as_u64(),
            Some(want),
            "{name}: {plan}"
        );
        let cfg = &ckpt.config;
        assert_eq!(
            plan["records"].as_u64(),
            Some((cfg.moe_layers().len() * cfg.num_experts) as u64),
            "{name}"
        );
        assert!(
            plan["slots"].as_u64().unwrap() >= plan["floor"].as_u64().unwrap(),
            "{name}: {plan}"
        );
    }
}

#[test]
fn pack_cli_then_generate_reads_the_pack() {
    for name in FIXTURES {
        let r = reference(name);
        let want: Vec<u32> = r
            .greedy_ids
            .iter()
            .copied()
            .take_while(|t| ![509, 511].contains(t))
            .collect();
        let tmp = copy_fixture(name);
        let dir = tmp.path().to_str().unwrap();
        let (stdout, _) = ok(&["pack", "--model", dir]);
        assert!(stdout.contains("packed 64 records"), "{name}: {stdout}");
        let prompt = ids_arg(&r.prompt_ids);
        let n = r.greedy_ids.len().to_string();
        let (stdout, stderr) = ok(&[
            "generate",
            "--model",
            dir,
            "--prompt-ids",
            &prompt,
            "--max-tokens",
            &n,
            "--json",
            "--device",
            "cpu",
            "--pool-slots",
            "24",
        ]);
        assert!(
            stderr.contains("using packed expert records"),
            "{name}: {stderr}"
        );
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let ids: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
        assert_eq!(ids, want, "{name}: generated through the pack");
        assert_eq!(v["pool"]["pack_fallbacks"].as_u64(), Some(0), "{name}");
    }
}

/// `bench` runs on every fixture family, and reports the n-gram table's rows for the one
/// that has it (Flash-Next) and none for the others.
#[test]
fn bench_cli_runs_on_every_family() {
    for name in FIXTURES {
        let dir = fixture_dir(name);
        let (stdout, _) = ok(&[
            "bench",
            "--model",
            dir.to_str().unwrap(),
            "--device",
            "cpu",
            "--budgets",
            "50%",
            "--lookahead",
            "on",
            "--tokens",
            "6",
            "--warmup",
            "2",
            "--prompt-len",
            "8",
            "--json",
        ]);
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let row = &v["rows"][0];
        assert_eq!(row["decode_tokens"], 3, "{name}: {row}");
        assert!(row["decode_tps"].as_f64().unwrap() > 0.0, "{name}");
        assert_eq!(
            row["hits"].as_u64().unwrap() + row["misses"].as_u64().unwrap(),
            row["lookups"].as_u64().unwrap(),
            "{name}"
        );
        let heads = Checkpoint::open(&dir)
            .unwrap()
            .config
            .flash_next
            .and_then(|f| f.ple)
            .map(|p| p.heads() as u64);
        match heads {
            Some(heads) => {
                let n = &row["ngram"];
                assert_eq!(
                    n["row_hits"].as_u64().unwrap() + n["row_misses"].as_u64().unwrap(),
                    3 * heads,
                    "{name}: {n}"
                );
            }
            None => assert!(row["ngram"].is_null(), "{name}: {row}"),
        }
    }
}
