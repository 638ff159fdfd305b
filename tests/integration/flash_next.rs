//! Qwen3.8-Flash-Next specifics against transformers 5.24 (the fixture's oracle): the
//! n-gram hash on sequences with EOS (the fixture's and one at the released geometry), the
//! QSA key selections, the n-gram rows read through the pool and counted, the two
//! conventions for zero-centered norms giving the same model, and synthetic Flash-Next
//! checkpoints (`slotstream synth`): their hashing buffers and a run through every block.

use std::collections::HashMap;

use crate::common::*;
use slotstream::backend::cpu::CpuBackend;
use slotstream::checkpoint::Checkpoint;
use slotstream::config::{Family, LayerKind};
use slotstream::experts::MappedExperts;
use slotstream::model::{Logits, Model, NormConvention};
use slotstream::ngram::ngram_row_ids;
use slotstream::tools::synth::{
    write_checkpoint_with, FlashNextShape, Preset, FLASH_NEXT_SHAPE, QWEN38_FLASH_NEXT,
};

fn reference_json() -> serde_json::Value {
    let path = fixture_dir(QWEN4_EXP).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ints<T: TryFrom<i64>>(v: &serde_json::Value) -> Vec<T>
where
    T::Error: std::fmt::Debug,
{
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| T::try_from(x.as_i64().unwrap()).unwrap())
        .collect()
}

#[test]
fn ngram_row_ids_equal_transformers_hashing() {
    let r = reference_json();
    // The fixture: its scored sequence holds an EOS between two documents.
    let ids: Vec<u32> = ints(&r["scored_ids"]);
    let eos = r["eos_token_id"].as_u64().unwrap() as u32;
    assert!(
        ids.contains(&eos),
        "the fixture's sequence must contain EOS"
    );
    let (m, sizes, offsets): (Vec<i64>, Vec<i64>, Vec<i64>) = (
        ints(&r["ngram_layer_multipliers"]),
        ints(&r["ngram_heads_vocab_sizes"]),
        ints(&r["ngram_heads_offsets"]),
    );
    let want: Vec<u64> = r["ngram_ids"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(ints::<u64>)
        .collect();
    assert_eq!(
        ngram_row_ids(&[], &ids, eos, 3, 8, &m, &sizes, &offsets),
        want
    );
    // In pieces (prefill, then one token at a time): the history carries the context.
    for split in [1, 29, 30, 31, 57] {
        let mut got = ngram_row_ids(&[], &ids[..split], eos, 3, 8, &m, &sizes, &offsets);
        for t in split..ids.len() {
            got.extend(ngram_row_ids(
                &ids[..t],
                &ids[t..t + 1],
                eos,
                3,
                8,
                &m,
                &sizes,
                &offsets,
            ));
        }
        assert_eq!(got, want, "split at {split}");
    }
    // The released geometry: 16 heads over primes after 20,000,000, EOS 248044 twice.
    let real = &r["ngram_real"];
    let ids: Vec<u32> = ints(&real["input_ids"]);
    let want: Vec<u64> = real["ngram_ids"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(ints::<u64>)
        .collect();
    let got = ngram_row_ids(
        &[],
        &ids,
        248_044,
        3,
        8,
        &ints::<i64>(&real["layer_multipliers"]),
        &ints::<i64>(&real["ngram_heads_vocab_sizes"]),
        &ints::<i64>(&real["ngram_heads_offsets"]),
    );
    assert_eq!(got, want);
}

/// A copy of the Flash-Next fixture (whose `1 + w` norms are stored folded) with those
/// norms stored as the Hugging Face release stores them (`w = stored - 1`, exact in bf16
/// for the fixture's weights) when `centered`; with `mtp`, an MTP head whose norms are in
/// the other convention and outnumber the text model's (each norm again, twice, under
/// `mtp.layers.{0,1}.` in place of `language_model.model.`).
fn with_norms(centered: bool, mtp: bool) -> tempfile::TempDir {
    let src = fixture_dir(QWEN4_EXP);
    let dir = copy_fixture(QWEN4_EXP);
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut data: HashMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> = HashMap::new();
    let mut rewritten = 0;
    for (name, view) in st.tensors() {
        let raw = view.data().to_vec();
        if NormConvention::applies_to(&name) {
            assert_eq!(view.dtype(), safetensors::Dtype::BF16, "{name}");
            let mut shifted = raw.clone();
            for b in shifted.chunks_exact_mut(2) {
                let v = half::bf16::from_le_bytes([b[0], b[1]]).to_f32() - 1.0;
                let c = half::bf16::from_f32(v);
                assert_eq!(c.to_f32(), v, "{name}: not exact in bf16");
                b.copy_from_slice(&c.to_le_bytes());
            }
            rewritten += 1;
            let (own, other) = match centered {
                true => (shifted, raw),
                false => (raw, shifted),
            };
            if mtp {
                for i in 0..2 {
                    data.insert(
                        name.replacen("language_model.model.", &format!("mtp.layers.{i}."), 1),
                        (view.dtype(), view.shape().to_vec(), other.clone()),
                    );
                }
            }
            data.insert(name, (view.dtype(), view.shape().to_vec(), own));
        } else {
            data.insert(name, (view.dtype(), view.shape().to_vec(), raw));
        }
    }
    assert_eq!(rewritten, 16, "every zero-centered norm of the fixture");
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

#[test]
fn centered_and_folded_norms_give_the_same_logits() {
    let dir = with_norms(true, false);
    let r = reference(QWEN4_EXP);
    let folded = load_cpu(QWEN4_EXP);
    assert_eq!(folded.model.norms, Some(NormConvention::Folded));
    let ckpt = std::sync::Arc::new(Checkpoint::open(dir.path()).unwrap());
    let model = Model::load(&ckpt, &CpuBackend).unwrap();
    assert_eq!(model.norms, Some(NormConvention::Centered));
    let experts = MappedExperts::new(ckpt.clone(), std::sync::Arc::new(model.experts.clone()));
    let mut a = folded.model.new_state(&CpuBackend);
    let mut b = model.new_state(&CpuBackend);
    let want = folded
        .model
        .forward(
            &CpuBackend,
            &mut a,
            &r.scored_ids,
            &folded.experts,
            Logits::All,
        )
        .unwrap();
    let got = model
        .forward(&CpuBackend, &mut b, &r.scored_ids, &experts, Logits::All)
        .unwrap();
    let e = rel_err(&got, &want);
    assert!(e <= 1e-6, "centered vs folded: relative error {e}");
}

/// An MTP head's norms in the other convention, outnumbering the text model's, leave the
/// text model's convention as its own norms say (they used to decide it).
#[test]
fn an_mtp_heads_norms_leave_the_models_convention_alone() {
    for (centered, want) in [
        (false, NormConvention::Folded),
        (true, NormConvention::Centered),
    ] {
        let dir = with_norms(centered, true);
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let mtp = ckpt.tensors().filter(|t| t.name.contains("mtp.")).count();
        assert_eq!(mtp, 32);
        let model = Model::load(&ckpt, &CpuBackend).unwrap();
        assert_eq!(model.norms, Some(want), "centered: {centered}");
    }
}

/// The released Qwen3.8-Flash-Next conversion keys its n-gram shards' overrides without
/// the `language_model.` prefix its tensors carry (reference-system.md A.8); mlx-lm-made
/// checkpoints key them with it; a checkpoint may have none (group 32 then comes from the
/// shards' shapes, against the global group 64). Each loads and matches transformers'
/// teacher-forced logits within 1e-3 at every position.
#[test]
fn overrides_keyed_either_way_or_absent_load_and_match_transformers() {
    let r = reference(QWEN4_EXP);
    type Keying = (&'static str, fn(&str) -> Option<String>);
    let keyed: [Keying; 3] = [
        ("prefixed", |k| Some(k.to_string())),
        ("released, unprefixed", |k| {
            Some(k.strip_prefix("language_model.").unwrap_or(k).to_string())
        }),
        ("absent", |_| None),
    ];
    for (what, rekey) in keyed {
        let tmp = copy_fixture(QWEN4_EXP);
        let mut shards = 0;
        edit_json(&tmp.path().join("config.json"), |v| {
            for field in ["quantization", "quantization_config"] {
                let Some(q) = v.get_mut(field).and_then(|q| q.as_object_mut()) else {
                    continue;
                };
                let old = std::mem::take(q);
                for (k, entry) in old {
                    if !entry.is_object() {
                        q.insert(k, entry);
                    } else if let Some(k) = rekey(&k) {
                        assert!(k.contains(".ngram_embedding.shard_"), "{k}");
                        shards += 1;
                        q.insert(k, entry);
                    }
                }
            }
        });
        let ckpt = std::sync::Arc::new(Checkpoint::open(tmp.path()).unwrap());
        let parts = ckpt
            .config
            .flash_next
            .as_ref()
            .unwrap()
            .ple
            .as_ref()
            .unwrap()
            .split_parts;
        // One entry per shard in `quantization` and in `quantization_config`.
        let want = if what == "absent" { 0 } else { 2 * parts };
        assert_eq!(shards, want, "{what}");
        let model = Model::load(&ckpt, &CpuBackend).unwrap_or_else(|e| panic!("{what}: {e}"));
        let experts = MappedExperts::new(ckpt.clone(), std::sync::Arc::new(model.experts.clone()));
        let s = slotstream::score::score(&model, &CpuBackend, &experts, &r.scored_ids).unwrap();
        worst_logit_error(what, &s.logits, &r);
    }
}

/// The n-gram rows go through the pool's bounded reader and are counted: a pass over the
/// scored sequence looks up `heads` rows per token and reads each distinct row once (three
/// reads: packed words, scales, biases); a second pass reads nothing. The logits equal
/// those of the mapped checkpoint, whose rows are read one after another.
#[test]
fn ngram_rows_are_read_through_the_pool_and_counted() {
    use slotstream::pool::{PoolExperts, SlotPool, StreamOptions};
    use std::sync::Arc;
    let r = reference_json();
    let ids: Vec<u32> = ints(&r["scored_ids"]);
    let ckpt = Arc::new(Checkpoint::open(&fixture_dir(QWEN4_EXP)).unwrap());
    let mapped_model = Model::load(&ckpt, &CpuBackend).unwrap();
    let mapped = MappedExperts::new(ckpt.clone(), Arc::new(mapped_model.experts.clone()));
    let mut state = mapped_model.new_state(&CpuBackend);
    let want = mapped_model
        .forward(&CpuBackend, &mut state, &ids, &mapped, Logits::All)
        .unwrap();

    let model = Model::load(&ckpt, &CpuBackend).unwrap();
    let tables = model.ngram_tables();
    assert_eq!(tables.len(), 1, "one PLE layer");
    let table = &tables[0];
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let index = Arc::new(model.experts.clone());
    let pool = SlotPool::open(
        &ckpt,
        index.clone(),
        StreamOptions::with_slots(index.records() / 2),
        runtime.handle().clone(),
    )
    .unwrap();
    let pooled = PoolExperts::new(pool.clone());
    let lookups = (ids.len() * table.heads()) as u64;
    let distinct = {
        let mut rows = table.row_ids(&[], &ids);
        rows.sort_unstable();
        rows.dedup();
        rows.len() as u64
    };
    assert!(distinct < lookups, "the sequence repeats some rows");
    let row_bytes = (table.head_dim / 8 * 4 + 2 * (table.head_dim / 32) * 2) as u64;
    for pass in 0..2u64 {
        let mut state = model.new_state(&CpuBackend);
        let got = model
            .forward(&CpuBackend, &mut state, &ids, &pooled, Logits::All)
            .unwrap();
        assert!(
            got == want,
            "pass {pass}: logits differ from the mapped checkpoint's"
        );
        let n = slotstream::ngram::total(&tables).unwrap();
        assert_eq!(
            n.row_hits + n.row_misses,
            (pass + 1) * lookups,
            "pass {pass}"
        );
        assert_eq!(n.row_misses, distinct, "pass {pass}: each row read once");
        assert_eq!(n.bytes_read, distinct * row_bytes, "pass {pass}");
        // The reads went through the pool's reader: three per row read.
        assert_eq!(pool.stats().range_reads, 3 * distinct, "pass {pass}");
    }
}

/// `bench` on a Flash-Next model reports the n-gram table's lookups while decoding:
/// `heads` per decoded token.
#[test]
fn bench_reports_ngram_rows() {
    use slotstream::tools::bench::{run, BenchOptions, Budget};
    use std::sync::Arc;
    let ckpt = Arc::new(Checkpoint::open(&fixture_dir(QWEN4_EXP)).unwrap());
    let heads = Model::load(&ckpt, &CpuBackend).unwrap().ngram_tables()[0].heads() as u64;
    let options = BenchOptions {
        budgets: vec![Budget::Percent(50.0)],
        lookahead: vec![true],
        prompt_len: 12,
        tokens: 8,
        warmup: 2,
        source: Default::default(),
        seed: rand::random(),
        reuse_tail: None,
        replay: vec![],
        draft_tokens: vec![1],
        verify_cost: 0,
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let report = run(&CpuBackend, &ckpt, &options, &runtime, |_| {}).unwrap();
    let row = &report.rows[0];
    let n = row.ngram.expect("n-gram counts for a Flash-Next model");
    assert_eq!(n.row_hits + n.row_misses, row.decode_tokens as u64 * heads);
    assert!(report.table().contains("n-gram table"));
}

/// The QSA indexer's key selection equals transformers' on the fixture's scored sequence
/// (90 positions, 71 of them past the budget), in one pass and as a prefill followed by
/// one-token steps (the pooled keys then come from the cache).
#[test]
fn qsa_selections_equal_transformers() {
    let r = reference_json();
    let ids: Vec<u32> = ints(&r["scored_ids"]);
    let layer = r["qsa_layer"].as_u64().unwrap() as usize;
    let want: Vec<Vec<usize>> = r["qsa_selected"]
        .as_array()
        .unwrap()
        .iter()
        .map(ints)
        .collect();
    assert_eq!(want.len(), ids.len());
    let sparse = want
        .iter()
        .enumerate()
        .filter(|(q, k)| k.len() < q + 1)
        .count();
    assert!(sparse > 60, "{sparse} positions select blocks");
    let ckpt = std::sync::Arc::new(Checkpoint::open(&fixture_dir(QWEN4_EXP)).unwrap());
    let model = Model::load(&ckpt, &CpuBackend).unwrap();
    let experts = MappedExperts::new(ckpt.clone(), std::sync::Arc::new(model.experts.clone()));
    let split = rand::random_range(1..ids.len() - 8);
    for pieces in [vec![ids.len()], {
        let mut p = vec![split];
        p.extend(std::iter::repeat_n(1, ids.len() - split));
        p
    }] {
        let mut state = model.new_state(&CpuBackend);
        state.keep_qsa_selections();
        let mut at = 0;
        for n in &pieces {
            model
                .forward(
                    &CpuBackend,
                    &mut state,
                    &ids[at..at + n],
                    &experts,
                    Logits::Last,
                )
                .unwrap();
            at += n;
        }
        let kept = state.qsa_selections();
        assert_eq!(kept.len(), 1, "one QSA layer");
        assert_eq!(kept[0].0, layer);
        let mut got = Vec::new();
        for mask in kept[0].1 {
            let rows = mask.bits.len() / mask.words_per_row();
            for row in 0..rows {
                got.push(
                    (0..mask.keys)
                        .filter(|&k| mask.kept(row, k))
                        .collect::<Vec<usize>>(),
                );
            }
        }
        assert_eq!(got.len(), ids.len(), "pieces {:?}", &pieces[..1]);
        for (q, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "position {q} (first piece {})", pieces[0]);
        }
    }
}

/// The synthetic Flash-Next checkpoint's hashing buffers are the ones transformers
/// computes at the released geometry (the fixture's `ngram_real`), so its n-gram ids are
/// the released model's.
#[test]
fn synth_ngram_buffers_equal_transformers() {
    let real = &reference_json()["ngram_real"];
    let g = QWEN38_FLASH_NEXT.ngram_geometry().unwrap();
    assert_eq!(g.multipliers, ints::<i64>(&real["layer_multipliers"]));
    assert_eq!(g.sizes, ints::<i64>(&real["ngram_heads_vocab_sizes"]));
    assert_eq!(g.offsets, ints::<i64>(&real["ngram_heads_offsets"]));
    assert_eq!(
        g.rows_per_shard as u64,
        real["rows_per_shard"].as_u64().unwrap()
    );
}

/// A 4-layer Flash-Next synth at toy sizes has every block, QSA attention included (a
/// 2-layer synth at the released sizes has none): it loads, and 24 tokens with an EOS
/// among them (past the indexer's 16-token budget, so it selects blocks) give finite
/// logits, prefilled at once or decoded one at a time.
#[test]
fn four_layer_flash_next_synth_runs_past_the_indexer_budget() {
    const TINY: Preset = Preset {
        name: "tiny-flash-next",
        family: Family::Qwen4Exp,
        hidden: 512,
        layers: 4,
        vocab: 512,
        heads: 4,
        kv_heads: 1,
        head_dim: 64,
        linear_key_heads: 2,
        linear_value_heads: 4,
        linear_head_dim: 32,
        experts: 16,
        top_k: 4,
        intermediate: 64,
        group_size: 64,
        rope_theta: 1e7,
        flash_next: Some(FlashNextShape {
            hc_lowrank: 64,
            indexer_head_dim: 32,
            indexer_budget: 16,
            ngram_vocab_base: 1000,
            ngram_shards: 4,
            eos: 509,
            ..FLASH_NEXT_SHAPE
        }),
        vision: None,
        mtp: false,
    };
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint_with(dir.path(), &TINY, 4, false, None).unwrap();
    let ckpt = std::sync::Arc::new(Checkpoint::open(dir.path()).unwrap());
    assert_eq!(ckpt.config.layer_kinds[3], LayerKind::FullAttention);
    assert!(ckpt.contains("language_model.model.layers.3.self_attn.indexer.index_qk_proj.weight"));
    let model = Model::load(&ckpt, &CpuBackend).unwrap();
    assert_eq!(model.norms, Some(NormConvention::Folded));
    let experts = MappedExperts::new(ckpt.clone(), std::sync::Arc::new(model.experts.clone()));
    let ids: Vec<u32> = (0..24)
        .map(|i| if i == 9 { 509 } else { 40 + 7 * i })
        .collect();
    let mut state = model.new_state(&CpuBackend);
    let all = model
        .forward(&CpuBackend, &mut state, &ids, &experts, Logits::All)
        .unwrap();
    assert_eq!(all.len(), 24 * 512);
    assert!(all.iter().all(|v| v.is_finite()));
    let mut state = model.new_state(&CpuBackend);
    for &id in &ids {
        let last = model
            .forward(&CpuBackend, &mut state, &[id], &experts, Logits::Last)
            .unwrap();
        assert!(last.len() == 512 && last.iter().all(|v| v.is_finite()));
    }
}
