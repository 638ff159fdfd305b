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

/// `slotstream generate` on `args` (CPU), its JSON reply.
fn generate_json(args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .args(["generate", "--device", "cpu", "--json"])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {err}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The CLI drafts with a head from `--mtp-weights` (mlx-lm's ids, drafts counted), and
/// with a synthetic checkpoint's own head (`synth --mtp-head`) under `--mtp auto`, giving
/// `--mtp off`'s ids; `--mtp on` without a head is an error that names the way out.
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
    let (auto, off) = (run("auto"), run("off"));
    assert_eq!(auto["output_ids"], off["output_ids"]);
    assert!(auto["stats"]["drafted"].as_u64().unwrap() > 0, "{auto}");
    assert_eq!(off["stats"]["drafted"].as_u64(), Some(0), "{off}");
}
