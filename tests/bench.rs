//! `slotstream synth` at the real presets' shapes and `slotstream bench`'s report: every
//! field present, and the counts consistent with each other.

use std::sync::Arc;

use serde_json::Value;
use slotstream::bench::{active_bytes_per_token, run, BenchOptions, Budget};
use slotstream::checkpoint::{Checkpoint, ExpertIndex};
use slotstream::experts::SourceOptions;
use slotstream::synth::{write_checkpoint, DEMO, FLASH_NEXT_EXPERTS, QWEN35_35B, QWEN3_NEXT_80B};

/// A two-layer synth of each full preset validates, and keeps the preset's per-layer
/// shapes: expert records of the released size, router and projections as configured.
#[test]
fn two_layer_synths_keep_the_presets_shapes() {
    for (preset, record_bytes) in [
        (QWEN3_NEXT_80B, 1_769_472),
        (QWEN35_35B, 1_769_472),
        (FLASH_NEXT_EXPERTS, 2_764_800),
    ] {
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
    };
    let report = run(&backend, &ckpt, &options, &runtime, |_| {}).unwrap();
    let index = ExpertIndex::build(&ckpt).unwrap();
    assert_eq!(report.rows.len(), 6);
    assert_eq!(report.records, 128);
    assert_eq!(
        report.active_bytes_per_token,
        active_bytes_per_token(&ckpt, &index)
    );
    assert!(report.copy_bytes_per_second > 0.0 && report.raw_read_bytes_per_second > 0.0);
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
        ("all", 128, 0, "copy")
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
