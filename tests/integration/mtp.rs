//! The MTP draft head and speculative decoding: the head's logits against the reference
//! of `tools/make_mtp_fixture.py` (vLLM's predictor with mlx-lm's decoder layer, in f32),
//! and drafted generation against plain generation.

use std::sync::Arc;

use rand::Rng;

use crate::common::compare::assert_rel;
use crate::common::*;
use slotstream::checkpoint::Checkpoint;
use slotstream::model::{Logits, Model};

/// The fixtures that have an MTP head (`mtp.safetensors`, with `mtp_logits.npy`).
const WITH_HEAD: [&str; 2] = ["qwen3-next-bf16", QWEN35];

/// The fixture `name` with its MTP head added from `mtp.safetensors`.
fn checkpoint_with_head(name: &str) -> Arc<Checkpoint> {
    let dir = fixture_dir(name);
    let mut ckpt = Checkpoint::open(&dir).unwrap();
    ckpt.add_file(&dir.join("mtp.safetensors")).unwrap();
    Arc::new(ckpt)
}

fn model_with_head<B: TestBackend>(name: &str, backend: &B) -> (Arc<Checkpoint>, Model<B>) {
    let ckpt = checkpoint_with_head(name);
    let mut model = Model::load(&ckpt, backend).unwrap();
    model.load_mtp(&ckpt, backend).unwrap();
    (ckpt, model)
}

backend_tests!(head_logits_match_the_reference);

/// At every position of the reference sequence the head's logits (given the model's
/// hidden state there and the next token) are within 1e-3 (norm-wise relative, per
/// position) of the reference's, with the sequence run in two calls split at a random
/// point, so the head's cache carries over between catch-ups.
fn head_logits_match_the_reference<B: TestBackend>(backend: &B) {
    for name in WITH_HEAD {
        let r = reference(name);
        let npy = npyz::NpyFile::new(
            std::fs::File::open(fixture_dir(name).join("mtp_logits.npy")).unwrap(),
        )
        .unwrap();
        let want: Vec<f32> = npy.into_vec().unwrap();
        let ids = &r.scored_ids;
        let positions = ids.len() - 1;
        assert_eq!(want.len(), positions * r.vocab);
        let (ckpt, model) = model_with_head(name, backend);
        let experts =
            slotstream::experts::MappedExperts::new(ckpt.clone(), Arc::new(model.experts.clone()));
        let mut state = model.new_drafting_state(backend).unwrap();
        let split = rand::rng().random_range(1..positions);
        let mut got = Vec::new();
        for (from, to) in [(0, split), (split, positions)] {
            model
                .forward(backend, &mut state, &ids[from..to], &experts, Logits::Last)
                .unwrap();
            let (logits, _) = model
                .mtp_catch_up(backend, &mut state, ids[to], Logits::All)
                .unwrap();
            got.extend(logits);
        }
        let mut worst = 0f64;
        for (p, (g, w)) in got.chunks(r.vocab).zip(want.chunks(r.vocab)).enumerate() {
            let what = format!(
                "{name} on {}: MTP logits at position {p} (split {split})",
                backend.name()
            );
            worst = worst.max(assert_rel(&what, g, w, 1e-3));
        }
        eprintln!(
            "{name} on {}: worst MTP logit error {worst:.2e}",
            backend.name()
        );
    }
}

backend_tests!(drafted_greedy_equals_plain);

/// Greedy generation with 1 to 4 drafts per step gives plain decoding's tokens, twice on
/// one sequence (a second turn after the first), so the state a drafted run leaves
/// (rewound after rejections) is the one plain decoding leaves; the counts add up.
fn drafted_greedy_equals_plain<B: TestBackend>(backend: &B) {
    use slotstream::generate::{generate, GenerateOptions};
    for name in WITH_HEAD {
        let r = reference(name);
        let (ckpt, model) = model_with_head(name, backend);
        let experts =
            slotstream::experts::MappedExperts::new(ckpt.clone(), Arc::new(model.experts.clone()));
        let turns = [&r.prompt_ids[..], &r.prompt_ids[3..11]];
        let run = |drafts: usize| {
            let options = GenerateOptions {
                max_tokens: 24,
                sampling: Default::default(),
                eos_ids: vec![],
                cancel: None,
                prefilled: None,
                draft_tokens: drafts,
                logprobs: None,
                constraint: None,
            };
            let mut state = model.new_state(backend);
            let outs: Vec<_> = turns
                .iter()
                .map(|prompt| {
                    generate(
                        &model,
                        backend,
                        &experts,
                        &mut state,
                        prompt,
                        &options,
                        |_| Ok(true),
                    )
                    .unwrap()
                })
                .collect();
            (outs, state.tokens.clone())
        };
        let (plain, plain_tokens) = run(0);
        for drafts in 1..=4 {
            let (got, tokens) = run(drafts);
            for ((want, _), (got, stats)) in plain.iter().zip(&got) {
                let what = format!("{name} on {}, {drafts} drafts", backend.name());
                assert_eq!(got, want, "{what}");
                assert!(
                    stats.verify_passes > 0 && stats.drafted >= stats.verify_passes,
                    "{what}: {stats:?}"
                );
                assert!(stats.accepted <= stats.drafted, "{what}: {stats:?}");
                // Every token after the first comes from a verify pass or a plain step.
                assert!(
                    stats.verify_passes + stats.accepted <= got.len(),
                    "{what}: {stats:?}"
                );
            }
            assert_eq!(
                tokens, plain_tokens,
                "{name}: the sequence after {drafts} drafts"
            );
        }
    }
}

use crate::serve::generate_json;

/// The CLI drafts with a head from `--mtp-weights` (mlx-lm's ids, drafts counted), and
/// with a synthetic checkpoint's own head (`synth --mtp-head`) under `--mtp on`, giving
/// `--mtp off`'s ids; `--mtp auto` does not draft on the CPU (its verify passes cost as
/// many steps as they have positions); `--mtp on` without a head is an error that names
/// the way out.
#[test]
fn the_cli_drafts_with_a_head_from_either_place() {
    let name = "qwen3-next-bf16";
    let r = reference(name);
    let dir = fixture_dir(name);
    let prompt: Vec<String> = r.prompt_ids.iter().map(|i| i.to_string()).collect();
    let prompt = prompt.join(",");
    let head = dir.join("mtp.safetensors");
    let got = generate_json(&[
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        &prompt,
        "--max-tokens",
        "16",
        "--mtp-weights",
        head.to_str().unwrap(),
        "--mtp",
        "on",
        "--draft-tokens",
        "2",
    ]);
    let ids: Vec<u32> = serde_json::from_value(got["output_ids"].clone()).unwrap();
    let want: Vec<u32> = (r.greedy_ids.iter().copied())
        .take_while(|t| ![509, 511].contains(t))
        .take(16)
        .collect();
    assert_eq!(ids, want, "{got}");
    assert!(got["stats"]["verify_passes"].as_u64().unwrap() > 0, "{got}");

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .args([
            "generate",
            "--device",
            "cpu",
            "--mtp",
            "on",
            "--prompt-ids",
            "1,2",
        ])
        .args(["--model", dir.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--mtp-weights"),
        "{err}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let preset = slotstream::tools::synth::Preset { mtp: true, ..TINY };
    slotstream::tools::synth::write_checkpoint_with(tmp.path(), &preset, 4, false, None).unwrap();
    let run = |mtp: &str| {
        generate_json(&[
            "--model",
            tmp.path().to_str().unwrap(),
            "--prompt-ids",
            "5,6,7,8,9",
            "--max-tokens",
            "12",
            "--mtp",
            mtp,
        ])
    };
    let (on, auto, off) = (run("on"), run("auto"), run("off"));
    assert_eq!(on["output_ids"], off["output_ids"]);
    assert_eq!(auto["output_ids"], off["output_ids"]);
    assert!(on["stats"]["drafted"].as_u64().unwrap() > 0, "{on}");
    assert_eq!(auto["stats"]["drafted"].as_u64(), Some(0), "{auto}");
    assert_eq!(off["stats"]["drafted"].as_u64(), Some(0), "{off}");
}

/// The chi-square statistic of `counts` against probabilities `want` (same order), with
/// the cells expected fewer than 5 times merged into one (the statistic's chi-square law
/// needs that), and its critical value at significance about 1e-4: the Wilson–Hilferty
/// approximation of the chi-square quantile, `df (1 - 2/(9 df) + z sqrt(2/(9 df)))^3`
/// with z = 3.719 (the normal's upper 1e-4 point), within a few percent of the exact one
/// (and above it) for 3 degrees of freedom or more. Cells of probability 0 must be empty.
fn chi_square(what: &str, counts: &[u64], want: &[f64]) -> (f64, f64) {
    let n: u64 = counts.iter().sum();
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut rest_seen, mut rest_expected) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(want) {
        let expected = p * n as f64;
        if p == 0.0 {
            assert_eq!(c, 0, "{what}: a token of probability 0 was emitted");
        } else if expected < 5.0 {
            rest_seen += c as f64;
            rest_expected += expected;
        } else {
            stat += (c as f64 - expected).powi(2) / expected;
            bins += 1;
        }
    }
    if rest_expected > 0.0 {
        stat += (rest_seen - rest_expected).powi(2) / rest_expected;
        bins += 1;
    }
    let df = (bins - 1) as f64;
    assert!(df >= 3.0, "{what}: only {bins} cells to compare");
    let a = 2.0 / (9.0 * df);
    (stat, df * (1.0 - a + 3.719 * a.sqrt()).powi(3))
}

/// Speculative sampling ([`Sampler::speculate`]) on fresh random distributions: drafts
/// drawn from `q`, kept or replaced against `p`, come out distributed as `p` (chi-square
/// over 40,000 draws per pair, significance 1e-4, a fresh seed each run in the message),
/// with `p` and `q` from random logits through the sampler's own transforms (temperature,
/// top-k) so that their supports differ; tokens outside `p`'s support never come out.
#[test]
fn speculative_sampling_emits_the_models_distribution() {
    use slotstream::sampling::{Sampler, SamplingOptions};
    let seed: u64 = rand::random();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
    for case in 0..6 {
        let n = rng.random_range(6..14);
        let sampler = |temperature: f32, top_k: usize, seed: u64| {
            Sampler::new(SamplingOptions {
                temperature,
                top_k,
                seed,
                ..Default::default()
            })
            .unwrap()
        };
        let mut logits = || -> Vec<f32> { (0..n).map(|_| rng.random_range(-3.0..3.0)).collect() };
        let (lp, lq) = (logits(), logits());
        let t = rng.random_range(0.5..1.5);
        let (kp, kq) = (rng.random_range(4..=n), rng.random_range(2..=n));
        let p = sampler(t, kp, 0).probabilities(&lp, &[]).unwrap();
        let q = sampler(t, kq, 0).probabilities(&lq, &[]).unwrap();
        let mut s = sampler(t, 0, rng.random());
        let mut counts = vec![0u64; n];
        let mut kept = 0;
        for _ in 0..40_000 {
            let draft = s.draw_from(&q);
            let token = s.speculate(&p, &q, draft).unwrap_or_else(|| {
                kept += 1;
                draft
            });
            counts[token as usize] += 1;
        }
        let what = format!("seed {seed}, case {case}: p {p:?}, q {q:?}, counts {counts:?}");
        let want: Vec<f64> = p.iter().map(|&v| v as f64).collect();
        let (stat, critical) = chi_square(&what, &counts, &want);
        assert!(
            stat < critical,
            "{what}: chi-square {stat:.1} >= {critical:.1}"
        );
        // Drafts are kept with probability sum_x min(p(x), q(x)).
        let overlap: f64 = p.iter().zip(&q).map(|(a, b)| a.min(*b) as f64).sum();
        let rate = kept as f64 / 40_000.0;
        assert!(
            (rate - overlap).abs() < 0.02,
            "{what}: kept {rate} vs {overlap}"
        );
    }
}

/// Drafted sampling on the fixture (temperature 0.8, top-k 3, repetition penalty 1.3, one
/// draft per step) emits its first three tokens with the model's own joint distribution:
/// the first from the prompt's logits, the second through a verify pass (kept or
/// replaced), the third either drawn from the verify pass's last row or after the
/// rewind. Chi-square over 800 runs against the exact probabilities, computed from the
/// model's logits with the sampler's transforms, at significance 1e-4 with a fresh seed
/// each run, for the head's drafts (random weights: almost all replaced) and for a
/// replay's ([`Replay`]: the most probable path half the time, so that both kept and
/// replaced drafts occur).
#[test]
fn drafted_sampling_follows_the_models_distribution() {
    use slotstream::generate::{generate, generate_replayed, GenerateOptions, Replay};
    use slotstream::sampling::{Sampler, SamplingOptions};
    let backend = slotstream::backend::cpu::CpuBackend;
    let name = "qwen3-next-bf16";
    let r = reference(name);
    let (ckpt, model) = model_with_head(name, &backend);
    let experts =
        slotstream::experts::MappedExperts::new(ckpt.clone(), Arc::new(model.experts.clone()));
    let prompt = &r.prompt_ids[..3];
    let sampling = |seed| SamplingOptions {
        temperature: 0.8,
        top_k: 3,
        repetition_penalty: 1.3,
        seed,
        ..Default::default()
    };
    // The exact joint distribution of three tokens, over the first's top-k.
    let vocab = r.vocab;
    let mut probs = Sampler::new(sampling(0)).unwrap();
    let mut next = |tokens: &[u32]| {
        let mut state = model.new_state(&backend);
        let logits = model
            .forward(&backend, &mut state, tokens, &experts, Logits::Last)
            .unwrap();
        probs.probabilities(&logits, tokens).unwrap()
    };
    let mut joint = std::collections::HashMap::new();
    let p1 = next(prompt);
    for t1 in (0..vocab as u32).filter(|&t| p1[t as usize] > 0.0) {
        let seq1: Vec<u32> = prompt.iter().copied().chain([t1]).collect();
        let p2 = next(&seq1);
        for t2 in (0..vocab as u32).filter(|&t| p2[t as usize] > 0.0) {
            let seq2: Vec<u32> = seq1.iter().copied().chain([t2]).collect();
            let p3 = next(&seq2);
            for t3 in (0..vocab as u32).filter(|&t| p3[t as usize] > 0.0) {
                let p = p1[t1 as usize] as f64 * p2[t2 as usize] as f64 * p3[t3 as usize] as f64;
                joint.insert([t1, t2, t3], p);
            }
        }
    }
    let cells: Vec<[u32; 3]> = joint.keys().copied().collect();
    let want: Vec<f64> = cells.iter().map(|c| joint[c]).collect();
    let best = |p: &[f32]| slotstream::sampling::argmax(p);
    let first = best(&p1);
    let replay = Replay {
        tokens: vec![first, best(&next(&[prompt, &[first][..]].concat()))],
        acceptance: 0.5,
        seed: rand::random(),
    };
    for replayed in [false, true] {
        let seed: u64 = rand::random();
        let mut counts = vec![0u64; cells.len()];
        let (mut drafted, mut accepted) = (0, 0);
        for run in 0..800u64 {
            let options = GenerateOptions {
                max_tokens: 3,
                sampling: sampling(seed.wrapping_add(run)),
                eos_ids: vec![],
                cancel: None,
                prefilled: None,
                draft_tokens: 1,
                logprobs: None,
                constraint: None,
            };
            let mut state = model.new_state(&backend);
            let (out, stats) = match replayed {
                true => generate_replayed(
                    &model,
                    &backend,
                    &experts,
                    &mut state,
                    prompt,
                    &options,
                    &Replay {
                        seed: replay.seed.wrapping_add(run),
                        ..replay.clone()
                    },
                    |_| Ok(true),
                ),
                false => generate(
                    &model,
                    &backend,
                    &experts,
                    &mut state,
                    prompt,
                    &options,
                    |_| Ok(true),
                ),
            }
            .unwrap();
            let cell = cells.iter().position(|c| c[..] == out[..]);
            let cell = cell.unwrap_or_else(|| panic!("seed {seed}: {out:?} has probability 0"));
            counts[cell] += 1;
            drafted += stats.drafted;
            accepted += stats.accepted;
        }
        let what = format!(
            "replayed {replayed}, seed {seed} (replay's from {}): {drafted} drafted, {accepted} kept",
            replay.seed
        );
        let (stat, critical) = chi_square(&what, &counts, &want);
        assert!(
            stat < critical,
            "{what}: chi-square {stat:.1} >= {critical:.1}"
        );
        if replayed {
            assert!(0 < accepted && accepted < drafted, "{what}");
        }
        eprintln!("{what}: chi-square {stat:.1} (critical {critical:.1})");
    }
}

/// An expert source that logs each fetch (layer and ids) and serves it from the mapped
/// checkpoint.
struct Logged {
    inner: slotstream::experts::MappedExperts,
    fetches: std::sync::Mutex<Vec<(usize, Vec<u32>)>>,
}

impl slotstream::records::ExpertSource for Logged {
    type Record<'a> = Vec<u8>;

    fn fetch(&self, layer: usize, experts: &[u32]) -> slotstream::error::Result<Vec<Vec<u8>>> {
        self.fetches.lock().unwrap().push((layer, experts.to_vec()));
        self.inner.fetch(layer, experts)
    }
}

impl Logged {
    /// The fetches since the last call.
    fn take(&self) -> Vec<(usize, Vec<u32>)> {
        std::mem::take(&mut self.fetches.lock().unwrap())
    }
}

/// A verify pass of k + 1 positions (k = 1 to 4, after a prompt) reads each record its
/// positions route to once: one fetch per MoE layer, of distinct ids, which are the union
/// of the ids the same tokens route to when run one at a time (from the same state, put
/// back with a rewind).
#[test]
fn a_verify_pass_reads_the_union_of_its_routes_once() {
    use std::collections::BTreeSet;
    let backend = slotstream::backend::cpu::CpuBackend;
    let name = "qwen3-next-bf16";
    let r = reference(name);
    let (ckpt, model) = model_with_head(name, &backend);
    let experts = Logged {
        inner: slotstream::experts::MappedExperts::new(
            ckpt.clone(),
            Arc::new(model.experts.clone()),
        ),
        fetches: Default::default(),
    };
    let mut state = model.new_state(&backend);
    model
        .forward(&backend, &mut state, &r.prompt_ids, &experts, Logits::Last)
        .unwrap();
    let moe_layers = &model.experts.moe_layers;
    for k in 1..=4 {
        let run = &r.greedy_ids[..k + 1];
        let point = state.rewind_point(&backend).unwrap();
        experts.take();
        let mut union = vec![BTreeSet::new(); model.config.num_hidden_layers];
        for &t in run {
            model
                .forward(&backend, &mut state, &[t], &experts, Logits::Last)
                .unwrap();
            for (layer, ids) in experts.take() {
                union[layer].extend(ids);
            }
        }
        state.rewind(&backend, &point);
        model
            .forward(&backend, &mut state, run, &experts, Logits::All)
            .unwrap();
        let fetches = experts.take();
        state.rewind(&backend, &point);
        let layers: Vec<usize> = fetches.iter().map(|(l, _)| *l).collect();
        assert_eq!(&layers, moe_layers, "k {k}: one fetch per MoE layer");
        for (layer, ids) in fetches {
            let distinct: BTreeSet<u32> = ids.iter().copied().collect();
            assert_eq!(distinct.len(), ids.len(), "k {k}, layer {layer}: {ids:?}");
            assert_eq!(distinct, union[layer], "k {k}, layer {layer}");
        }
    }
}

/// Drafting reads the MTP head's experts apart from the pool: the head's passes
/// ([`Model::draft`], 1 to 4 drafts, on a sequence the pool's experts ran) leave the
/// pool's counters (lookups, reads, evictions of the main model's records) as they were.
#[test]
fn drafting_leaves_the_pool_alone() {
    use slotstream::pool::{PoolExperts, SlotPool, StreamOptions};
    let backend = slotstream::backend::cpu::CpuBackend;
    let name = "qwen3-next-bf16";
    let r = reference(name);
    let (ckpt, model) = model_with_head(name, &backend);
    let index = Arc::new(model.experts.clone());
    let rt = runtime();
    let slots = slotstream::pool::floor_slots(index.num_experts, 8);
    let options = StreamOptions::with_slots(slots);
    let pool = SlotPool::open(&ckpt, index.clone(), options, rt.handle().clone()).unwrap();
    let experts = PoolExperts::new(pool.clone());
    let mut state = model.new_drafting_state(&backend).unwrap();
    let mut next = r.greedy_ids[0];
    model
        .forward(&backend, &mut state, &r.prompt_ids, &experts, Logits::Last)
        .unwrap();
    for k in 1..=4 {
        let before = pool.stats();
        let drafts = model
            .draft(&backend, &mut state, next, k, |l| {
                Ok(slotstream::sampling::argmax(l))
            })
            .unwrap();
        let after = pool.stats();
        assert_eq!(drafts.len(), k);
        let counts = |s: &slotstream::pool::PoolStats| {
            (
                s.hits,
                s.misses,
                s.bytes_read,
                s.speculative_reads,
                s.prefetches_wasted,
            )
        };
        assert_eq!(counts(&before), counts(&after), "{k} drafts");
        // The next position runs through the pool, so the head has one more to catch up.
        model
            .forward(&backend, &mut state, &[next], &experts, Logits::Last)
            .unwrap();
        next = r.greedy_ids[k];
    }
}

/// A memory plan counts a drafting head (`Footprint::mtp`): with `--mtp on` and a budget,
/// the plan's head term is the head's tensors as held (more than stored, its bf16 dense
/// weights widened) and the context state holds one more attention layer's KV cache, and
/// the pool is smaller by what both take; `--mtp off` counts neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_plan_counts_a_drafting_head() {
    use slotstream::engine::{Engine, EngineOptions, MtpMode, MtpOptions};
    use slotstream::experts::{PoolSize, SourceOptions};
    use slotstream::prompt_cache::PromptCacheOptions;
    let name = "qwen3-next-bf16";
    let dir = fixture_dir(name);
    let ckpt = checkpoint_with_head(name);
    let stored: u64 = (ckpt.tensors())
        .filter(|t| t.name.starts_with("mtp."))
        .map(|t| t.len)
        .sum();
    assert_eq!(
        slotstream::plan::mtp_bytes(&Checkpoint::open(&dir).unwrap()),
        0
    );
    let charged = slotstream::plan::mtp_bytes(&ckpt);
    assert!(
        stored > 0 && charged > stored && charged <= 2 * stored,
        "{charged} for {stored}"
    );
    let plan = |mode: MtpMode, budget: u64| {
        let dir = dir.clone();
        async move {
            let engine = Engine::load(
                &dir,
                EngineOptions {
                    source: SourceOptions {
                        pool: Some(PoolSize::Budget(budget)),
                        context: 64,
                        ..Default::default()
                    },
                    device: Some("cpu".into()),
                    mtp: MtpOptions {
                        mode,
                        weights: Some(dir.join("mtp.safetensors")),
                        draft_tokens: 1,
                    },
                    prompt_cache: PromptCacheOptions {
                        memory: 0,
                        ..Default::default()
                    },
                    ..Default::default()
                },
            )
            .await
            .unwrap();
            engine.plan().unwrap().clone()
        }
    };
    // A budget of 60 slots beyond the other terms without the head (fewer than the
    // fixture's records, so the head's bytes come out of the pool).
    let roomy = plan(MtpMode::Off, 64 << 20).await;
    let budget = roomy.budget - roomy.pool - roomy.unused + 60 * roomy.slot_bytes;
    let (on, off) = (
        plan(MtpMode::On, budget).await,
        plan(MtpMode::Off, budget).await,
    );
    assert_eq!(off.slots, 60);
    assert_eq!((on.mtp, off.mtp), (charged, 0));
    let cfg = &ckpt.config;
    let head_kv = 64 * (2 * cfg.num_key_value_heads * cfg.head_dim * 4) as u64;
    assert_eq!(on.context_state, off.context_state + head_kv);
    let taken = charged + head_kv;
    assert_eq!(on.pool + on.unused + taken, off.pool + off.unused);
    assert!(
        on.slots < off.slots,
        "{} slots with the head, {} without",
        on.slots,
        off.slots
    );
}
