//! `slotstream synth` at the real presets' shapes and `slotstream bench`'s report: every
//! field present, and the counts consistent with each other.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;
use slotstream::backend::cpu::CpuBackend;
use slotstream::checkpoint::{Checkpoint, ExpertIndex};
use slotstream::config::{Family, LayerKind, QuantSpec};
use slotstream::experts::{MappedExperts, SourceOptions};
use slotstream::model::{Logits, Model, NormConvention};
use slotstream::tools::bench::{active_bytes_per_token, run, BenchOptions, Budget};
use slotstream::tools::synth::{
    write_checkpoint, Preset, DEMO, QWEN35_35B, QWEN38_FLASH_NEXT, QWEN3_NEXT_80B,
};

/// A two-layer synth of each Qwen3-Next and Qwen3.5 preset validates, and keeps the
/// preset's per-layer shapes: expert records of the released size, router and projections
/// as configured. (Qwen3.8-Flash-Next has its own test below.)
#[test]
fn two_layer_synths_keep_the_presets_shapes() {
    // The text model: the vision tower's synth is tested in vision::.
    let qwen35 = Preset {
        vision: None,
        ..QWEN35_35B
    };
    for (preset, record_bytes) in [(QWEN3_NEXT_80B, 1_769_472), (qwen35, 1_769_472)] {
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(dir.path(), &preset, 2, false).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let cfg = &ckpt.config;
        assert_eq!(cfg.family, preset.family);
        assert_eq!(cfg.num_hidden_layers, 2);
        let e = preset.experts;
        assert_eq!(
            (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok),
            (preset.hidden, e, preset.top_k)
        );
        let index = ExpertIndex::build(&ckpt).unwrap();
        assert_eq!(index.layout.record_bytes, record_bytes, "{}", preset.name);
        assert_eq!(index.records(), 2 * e);
        let shape = |name: &str| ckpt.tensor(name).unwrap().shape.clone();
        for l in 0..2 {
            let p = cfg.layer_name(l, "mlp");
            let (h, i) = (preset.hidden, preset.intermediate);
            assert_eq!(
                shape(&format!("{p}.switch_mlp.gate_proj.weight")),
                [e, i, h / 8]
            );
            assert_eq!(
                shape(&format!("{p}.switch_mlp.down_proj.weight")),
                [e, h, i / 8]
            );
            assert_eq!(
                shape(&format!("{p}.switch_mlp.up_proj.scales")),
                [e, i, h / 64]
            );
            // The router at 8 bits: 4 values per u32.
            assert_eq!(shape(&format!("{p}.gate.weight")), [e, h / 4]);
            assert_eq!(
                shape(&format!("{p}.shared_expert.gate_proj.weight")),
                [i, h / 8]
            );
        }
        assert_eq!(
            shape(&cfg.name("model.embed_tokens.weight")),
            [preset.vocab, preset.hidden / 8]
        );
        if preset.family == slotstream::config::Family::Qwen35Moe {
            // The Qwen3.5-MoE layout loads: every name and shape the forward pass asks for
            // (the Qwen3-Next one is the demo's).
            slotstream::model::Model::load(&ckpt, &slotstream::backend::cpu::CpuBackend)
                .unwrap_or_else(|e| panic!("{}: {e}", preset.name));
        }
    }
}

/// n-gram rows per head of the Flash-Next test checkpoint (a 1.7 MB table instead of the
/// released 32 GB one; 132 rows per shard).
const NGRAM_ROWS: u64 = 1000;

/// The released shape of a Qwen3.8-Flash-Next tensor, by its name below
/// `language_model.model.layers.{L}.` or `language_model.` (reference-system.md A.3 hyper
/// connections, A.4 gated DeltaNet, A.6 PLE and n-gram table, A.7 MoE, A.8 embeddings);
/// n-gram shards have `shard_rows` rows (2,500,012 released).
fn released_shape(name: &str, shard_rows: usize) -> Vec<usize> {
    let rest = name.strip_prefix("language_model.").unwrap();
    let rest = match rest.strip_prefix("model.layers.") {
        Some(r) => r.split_once('.').unwrap().1,
        None => rest,
    };
    let (module, part) = rest.rsplit_once('.').unwrap();
    // A 4-bit group-64 linear `[out, in]`: U32 `[out, in / 8]`, bf16 `[out, in / 64]`.
    let q = |out: usize, inp: usize| match part {
        "weight" => vec![out, inp / 8],
        _ => vec![out, inp / 64],
    };
    let module = module
        .trim_start_matches("attn_hyper_connection.")
        .trim_start_matches("mlp_hyper_connection.")
        .trim_start_matches("model.hyper_connection_mixer.");
    if module.starts_with("ple.ple_embedding.ngram_embedding.shard_") {
        // 160-wide rows at 4 bits, group 32: 20 words, 5 scales.
        return match part {
            "weight" => vec![shard_rows, 20],
            _ => vec![shard_rows, 5],
        };
    }
    match module {
        "model.embed_tokens" | "lm_head" => q(248_320, 2560),
        "hc_norm" | "ple.norm_key" | "ple.norm_query" | "ple.norm_conv" => vec![10_240],
        "input_mix_weight_down" => q(320, 10_240),
        "input_mix_weight_up" => q(10_240, 320),
        "block_inject_weight" => vec![4, 10_240],
        "linear_attn.in_proj_qkv" | "ple.key_proj" => q(10_240, 2560),
        "linear_attn.in_proj_z" => q(6144, 2560),
        "linear_attn.in_proj_a" | "linear_attn.in_proj_b" => vec![48, 2560],
        "linear_attn.conv1d" | "ple.conv1d" => vec![10_240, 4, 1],
        // A_log and dt_bias.
        "linear_attn" => vec![48],
        "linear_attn.norm" => vec![128],
        "linear_attn.out_proj" => q(2560, 6144),
        "ple.value_proj" => q(2560, 2560),
        "ple.ple_embedding" => match part {
            "layer_multipliers" => vec![3],
            // Head sizes and offsets.
            _ => vec![16],
        },
        "mlp.gate" => vec![512, 2560],
        "mlp.shared_expert_gate" => vec![1, 2560],
        "mlp.shared_expert.gate_proj" | "mlp.shared_expert.up_proj" => q(640, 2560),
        "mlp.shared_expert.down_proj" => q(2560, 640),
        "mlp.switch_mlp.gate_proj" | "mlp.switch_mlp.up_proj" => [vec![512], q(640, 2560)].concat(),
        "mlp.switch_mlp.down_proj" => [vec![512], q(2560, 640)].concat(),
        other => panic!("{name}: no released shape for `{other}`"),
    }
}

/// A two-layer synth of qwen3.8-flash-next (with a small n-gram table) holds exactly the
/// tensors of the released MLX conversion's first two layers: the names and dtypes of the
/// transformers-made fixture (tools/make_qwen4_exp_fixture.py; its 4 n-gram shards are
/// 128 here), at the released shapes. It validates, has records of 2,764,800 bytes, loads
/// on the CPU backend (folded norms detected) and gives finite logits for tokens that
/// include an EOS (the n-gram hash's segment reset).
#[test]
fn two_layer_flash_next_synth_has_the_released_layout_and_runs() {
    // The text model (the fixture's tensors): the vision tower's synth is tested in vision::.
    let preset = Preset {
        vision: None,
        ..QWEN38_FLASH_NEXT.with_ngram_rows(NGRAM_ROWS).unwrap()
    };
    let shard_rows = preset.ngram_geometry().unwrap().rows_per_shard;
    assert_eq!(shard_rows, 132);
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &preset, 2, false).unwrap();
    let ckpt = Arc::new(Checkpoint::open(dir.path()).unwrap());
    let got: BTreeMap<String, (safetensors::Dtype, Vec<usize>)> = ckpt
        .tensors()
        .map(|t| (t.name.clone(), (t.dtype, t.shape.clone())))
        .collect();

    let fixture = Checkpoint::open(&crate::common::fixture_dir(crate::common::QWEN4_EXP)).unwrap();
    let ple = "language_model.model.layers.1.ple.ple_embedding.ngram_embedding.shard_";
    let mut want = BTreeMap::new();
    for t in fixture.tensors() {
        let layer = t
            .name
            .strip_prefix("language_model.model.layers.")
            .map(|r| r.split('.').next().unwrap().parse::<usize>().unwrap());
        if layer.is_some_and(|l| l >= 2) {
            continue;
        }
        let names = match t.name.strip_prefix(ple) {
            Some(r) => {
                let part = r.split_once('.').unwrap().1;
                (0..128).map(|s| format!("{ple}{s}.{part}")).collect()
            }
            None => vec![t.name.clone()],
        };
        for name in names {
            let shape = released_shape(&name, shard_rows);
            want.insert(name, (t.dtype, shape));
        }
    }
    // Embeddings, head and mixer 13; two gated-DeltaNet layers of 51; the PLE block's 13
    // and its 128 shards.
    assert_eq!(
        want.len(),
        13 + 2 * 51 + 13 + 3 * 128,
        "the fixture's tensors"
    );
    for (name, w) in &want {
        assert_eq!(got.get(name), Some(w), "{name}");
    }
    let extra: Vec<&String> = got.keys().filter(|n| !want.contains_key(*n)).collect();
    assert!(extra.is_empty(), "not in the release: {extra:?}");

    let cfg = &ckpt.config;
    assert_eq!(cfg.family, Family::Qwen4Exp);
    assert_eq!(cfg.layer_kinds, [LayerKind::LinearAttention; 2]);
    assert_eq!(cfg.eos_token_ids, [248_044]);
    let x = cfg.flash_next.as_ref().unwrap();
    assert_eq!((x.hc_count, x.hc_lowrank), (4, 320));
    let p = x.ple.as_ref().unwrap();
    assert_eq!(
        (p.layers.clone(), p.heads(), p.head_dim(), p.split_parts),
        (vec![1], 16, 160, 128)
    );
    assert_eq!(x.indexer.as_ref().unwrap().block_top_k(), 512);
    // Keyed as released, without the prefix, and found for the shard's full name.
    assert_eq!(cfg.quantization.for_module(&format!("{ple}127")), None);
    assert_eq!(
        cfg.quant_override(&format!("{ple}127")),
        Some(Some(QuantSpec {
            bits: 4,
            group_size: 32
        }))
    );
    // The hashing buffers are the preset's.
    let ngram = preset.ngram_geometry().unwrap();
    let ints = |name: &str| -> Vec<i64> {
        let t = ckpt
            .tensor(&format!(
                "language_model.model.layers.1.ple.ple_embedding.{name}"
            ))
            .unwrap();
        ckpt.bytes(t)
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    assert_eq!(ints("layer_multipliers"), ngram.multipliers);
    assert_eq!(ints("ngram_heads_vocab_sizes"), ngram.sizes);
    assert_eq!(ints("ngram_heads_offsets"), ngram.offsets);

    let index = ExpertIndex::build(&ckpt).unwrap();
    assert_eq!(index.layout.record_bytes, 2_764_800);
    assert_eq!(index.records(), 2 * 512);
    let model = Model::load(&ckpt, &CpuBackend).unwrap();
    assert_eq!(model.norms, Some(NormConvention::Folded));
    let experts = MappedExperts::new(ckpt.clone(), Arc::new(model.experts.clone()));
    let mut state = model.new_state(&CpuBackend);
    let ids = [9707, 11, 248_044, 1879, 42];
    let logits = model
        .forward(&CpuBackend, &mut state, &ids, &experts, Logits::All)
        .unwrap();
    assert_eq!(logits.len(), ids.len() * 248_320);
    assert!(logits.iter().all(|v| v.is_finite()));
    // One more token, decoded after the prefill.
    let next = model
        .forward(&CpuBackend, &mut state, &[100], &experts, Logits::Last)
        .unwrap();
    assert!(next.len() == 248_320 && next.iter().all(|v| v.is_finite()));
}

/// `synth` checks its flags before writing anything, each error naming its flag.
#[test]
fn synth_rejects_bad_flash_next_flags() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m");
    let flash = "qwen3.8-flash-next";
    for (args, needle) in [
        (
            &["--preset", flash, "--ngram-rows", "0"][..],
            "--ngram-rows 0",
        ),
        (
            &["--preset", flash, "--ngram-rows", "20000001"],
            "--ngram-rows",
        ),
        (
            &["--preset", flash, "--layers", "1"],
            "--layers must be at least 2",
        ),
        (
            &["--preset", "demo", "--ngram-rows", "10"],
            "no n-gram table",
        ),
    ] {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
            .arg("synth")
            .args(args)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(needle),
            "{args:?}: {err}"
        );
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    }
}

#[test]
fn bench_report_has_every_field_and_consistent_counts() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &DEMO, 2, false).unwrap();
    let ckpt = Arc::new(Checkpoint::open(dir.path()).unwrap());
    let backend = slotstream::backend::cpu::CpuBackend;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let options = BenchOptions {
        budgets: vec![Budget::Floor, Budget::Percent(75.0), Budget::All],
        lookahead: vec![true, false],
        prompt_len: 40,
        tokens: 12,
        warmup: 4,
        source: SourceOptions::default(),
        seed: rand::random(),
        reuse_tail: Some(10),
        replay: vec![],
        draft_tokens: vec![1],
        verify_cost: 0,
    };
    let report = run(&backend, &ckpt, &options, &runtime, |_| {}).unwrap();
    let index = ExpertIndex::build(&ckpt).unwrap();
    assert_eq!(report.rows.len(), 6);
    assert_eq!(report.records, 128);
    assert_eq!(
        report.active_bytes_per_token,
        active_bytes_per_token(&ckpt, &index)
    );
    assert!(
        report.copy_bytes_per_second > 0.0
            && report.memory_read_bytes_per_second > 0.0
            && report.raw_read_bytes_per_second > 0.0
    );
    for r in &report.rows {
        assert_eq!(r.hits + r.misses, r.lookups, "{r:?}");
        // Every decode step looks up top-k experts in each MoE layer (distinct per token).
        assert!(
            r.lookups <= (r.decode_tokens * 2 * DEMO.top_k) as u64,
            "{r:?}"
        );
        assert!(r.lookups >= (r.decode_tokens * 2) as u64, "{r:?}");
        assert_eq!(
            r.bytes_read,
            r.misses * report.record_bytes as u64 + r.speculative_bytes,
            "{r:?}"
        );
        assert_eq!(r.decode_tokens, 12 - 4 - 1);
        assert!(
            (r.mb_read_per_token - r.bytes_read as f64 / r.decode_tokens as f64 / 1e6).abs() < 1e-9
        );
        assert!((0.0..=1.0).contains(&r.hit_rate) && r.decode_tps > 0.0 && r.prefill_tps > 0.0);
        assert_eq!(r.prefill_tokens, 40);
        // Prompt reuse: the repeated prompt runs one token, the one with a new tail at most
        // the tail and the tokens after the last snapshot interval.
        let u = r.reuse.as_ref().unwrap();
        assert_eq!((u.prompt_tokens, u.tail_tokens, u.repeat_run), (40, 10, 1));
        assert!(u.shared_run <= 10 + u.every, "{u:?}");
        assert!(u.cold_seconds > 0.0 && u.shared_cold_seconds > 0.0, "{u:?}");
        if !r.lookahead {
            assert_eq!(
                (r.prefetches_used, r.prefetches_wasted, r.speculative_bytes),
                (0, 0, 0)
            );
        }
    }
    let all = &report.rows[4];
    assert_eq!(
        (all.budget.as_str(), all.slots, all.misses, all.limit_kind),
        ("all", 128, 0, "memory")
    );
    assert!(all.preload_seconds > 0.0);
    assert_eq!(report.rows[0].limit_kind, "read");

    // The CLI's JSON carries the same fields.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .args([
            "bench",
            "--device",
            "cpu",
            "--budgets",
            "floor",
            "--tokens",
            "6",
            "--warmup",
            "2",
            "--json",
            "--model",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    for field in [
        "active_bytes_per_token",
        "copy_bytes_per_second",
        "memory_read_bytes_per_second",
        "raw_read_bytes_per_second",
        "rows",
    ] {
        assert!(v.get(field).is_some(), "{field}");
    }
    let row = &v["rows"][0];
    for field in [
        "decode_tps",
        "prefill_tps",
        "hit_rate",
        "mb_read_per_token",
        "wait_share",
        "prefetches_used",
        "prefetches_wasted",
        "peak_rss",
        "limit_tps",
    ] {
        assert!(row.get(field).is_some(), "{field}: {row}");
    }
}

/// On a 1-layer synth, whose 64 records are fewer than the pool's floor (one layer's
/// experts plus the speculative reads), bench's default budgets run: `30%` is skipped
/// with a note, `floor` and `all` (at least the floor) run. With every budget below the
/// floor nothing runs, and the error gives each one's reason.
#[test]
fn a_budget_below_the_floor_is_skipped_and_all_always_runs() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &DEMO, 1, false).unwrap();
    let floor = slotstream::pool::floor_slots(64, slotstream::pool::DEFAULT_SPECULATIVE_CAP);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .args(["bench", "--device", "cpu", "--tokens", "6", "--warmup", "2"])
        .args([
            "--prompt-len",
            "8",
            "--lookahead",
            "on",
            "--json",
            "--model",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows: Vec<(&str, u64)> = v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["budget"].as_str().unwrap(), r["slots"].as_u64().unwrap()))
        .collect();
    assert_eq!(rows, [("floor", floor as u64), ("all", floor as u64)]);
    let skipped = v["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    let note = skipped[0].as_str().unwrap();
    assert!(
        note.starts_with("budget 30% skipped:") && note.contains("below the floor"),
        "{note}"
    );

    let ckpt = Arc::new(Checkpoint::open(dir.path()).unwrap());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let options = BenchOptions {
        budgets: vec![Budget::Percent(1.0), Budget::Bytes(1 << 20)],
        lookahead: vec![true],
        prompt_len: 8,
        tokens: 6,
        warmup: 2,
        source: SourceOptions::default(),
        seed: rand::random(),
        reuse_tail: None,
        replay: vec![],
        draft_tokens: vec![1],
        verify_cost: 0,
    };
    let mut steps = Vec::new();
    let err = run(
        &slotstream::backend::cpu::CpuBackend,
        &ckpt,
        &options,
        &runtime,
        |s| steps.push(s.to_string()),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("no budget can run")
            && err.contains("budget 1% skipped")
            && err.contains("budget 1.0 MiB skipped"),
        "{err}"
    );
    assert!(
        !steps.iter().any(|s| s.starts_with("budget")),
        "a row ran: {steps:?}"
    );
}

/// Writing a synthetic checkpoint again over an interrupted run removes the temporary file
/// that run left behind (and nothing else of the directory's).
#[test]
fn synth_again_removes_an_interrupted_runs_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &DEMO, 2, false).unwrap();
    let stale = dir
        .path()
        .join(format!("{}x7Qk2p", slotstream::atomic_file::TEMP_PREFIX));
    std::fs::write(&stale, vec![0u8; 4096]).unwrap();
    write_checkpoint(dir.path(), &DEMO, 2, false).unwrap();
    assert!(!stale.exists(), "the stale temporary file is still there");
    Checkpoint::open(dir.path()).unwrap();
}

/// `bench --replay` on a synthetic checkpoint with an MTP head: each drafted row sits
/// between two plain rows and is compared with their mean; a replay that is always right
/// (p = 1) has every draft accepted, one that is never right (p = 0) none, and the
/// drafted rows count their verify passes and time their parts; the verify-pass timing
/// follows the first plain row. Without a head, --replay is an error that says how to get
/// one.
#[test]
fn bench_replays_drafts_between_plain_rows() {
    let dir = tempfile::tempdir().unwrap();
    let preset = Preset { mtp: true, ..DEMO };
    slotstream::tools::synth::write_checkpoint_with(dir.path(), &preset, 2, false, None).unwrap();
    let ckpt = Arc::new(Checkpoint::open(dir.path()).unwrap());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mut options = BenchOptions {
        budgets: vec![Budget::All],
        lookahead: vec![true],
        prompt_len: 8,
        tokens: 12,
        warmup: 2,
        source: SourceOptions::default(),
        seed: rand::random(),
        reuse_tail: None,
        replay: vec![0.0, 1.0],
        draft_tokens: vec![2],
        verify_cost: 2,
    };
    let report = run(&CpuBackend, &ckpt, &options, &runtime, |_| {}).unwrap();
    let drafts: Vec<Option<f64>> = report.rows.iter().map(|r| r.replay_acceptance).collect();
    assert_eq!(drafts, [None, Some(0.0), None, Some(1.0), None]);
    for r in &report.rows {
        let what = format!("seed {}: {r:?}", options.seed);
        if r.replay_acceptance.is_none() {
            assert!(r.drafted == 0 && r.speedup.is_none(), "{what}");
            continue;
        }
        assert_eq!(r.draft_tokens, 2, "{what}");
        assert!(
            r.verify_passes > 0 && r.drafted >= r.verify_passes,
            "{what}"
        );
        let want = if r.replay_acceptance == Some(1.0) {
            r.drafted
        } else {
            0
        };
        assert_eq!(r.accepted, want, "{what}");
        assert!(r.speedup.is_some_and(|s| s > 0.0), "{what}");
        assert!(r.verify_ms.is_some_and(|v| v > 0.0), "{what}");
        assert!(r.draft_ms.is_some_and(|v| v > 0.0), "{what}");
    }
    assert!(report.table().contains("| speedup |"), "{}", report.table());
    // The verify-pass timing: after the first plain row only, 2 to 5 positions.
    let costs = &report.rows[0].verify_cost;
    let positions: Vec<usize> = costs.iter().map(|c| c.positions).collect();
    assert_eq!(positions, [2, 3, 4, 5]);
    for c in costs {
        assert!(c.verify_ms > 0.0 && c.step_ms > 0.0, "{c:?}");
        assert!((c.ratio - c.verify_ms / c.step_ms).abs() < 1e-9, "{c:?}");
    }
    assert!(report.rows[1..].iter().all(|r| r.verify_cost.is_empty()));
    assert!(report.table().contains("| steps per pass |"));

    let plain = tempfile::tempdir().unwrap();
    write_checkpoint(plain.path(), &DEMO, 2, false).unwrap();
    let ckpt = Arc::new(Checkpoint::open(plain.path()).unwrap());
    options.replay = vec![0.86];
    let err = run(&CpuBackend, &ckpt, &options, &runtime, |_| {}).unwrap_err();
    assert!(err.to_string().contains("synth --mtp-head"), "{err}");
}
