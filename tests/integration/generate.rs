//! `slotstream generate` end to end: greedy output ids equal mlx-lm's for the fixtures, on
//! the CPU, with experts mapped and streamed through pools of several sizes, queue depths
//! and I/O modes; plus the CLI's errors for bad input.

use std::process::Command;

use crate::common::*;

fn slotstream() -> Command {
    Command::new(env!("CARGO_BIN_EXE_slotstream"))
}

/// mlx-lm's greedy ids up to (not including) the first EOS.
fn expected(name: &str) -> Vec<u32> {
    let r = reference(name);
    let eos = [509u32, 511];
    r.greedy_ids
        .into_iter()
        .take_while(|t| !eos.contains(t))
        .collect()
}

fn run_json(args: &[&str]) -> serde_json::Value {
    let out = slotstream().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {err}");

    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn greedy_generation_matches_mlx_lm_through_the_pool() {
    for name in FIXTURES {
        let r = reference(name);
        let dir = fixture_dir(name);
        let prompt: Vec<String> = r.prompt_ids.iter().map(|i| i.to_string()).collect();
        let prompt = prompt.join(",");
        let want = expected(name);
        let n = r.greedy_ids.len().to_string();
        let base = [
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            &prompt,
            "--max-tokens",
            &n,
            "--json",
            "--device",
            "cpu",
        ];
        let mapped = run_json(&base);
        let ids: Vec<u32> = serde_json::from_value(mapped["output_ids"].clone()).unwrap();
        assert_eq!(ids, want, "{name}: mapped experts");
        for (slots, qd, io, lookahead, device) in [
            ("24", "1", "direct", "on", "cpu"),
            ("24", "32", "buffered", "off", "cpu"),
            ("40", "32", "buffered", "on", "cpu"),
            ("64", "32", "direct", "off", "cpu"),
            // `--device gpu`: the first GPU adapter (lavapipe in CI); an error without one.
            ("24", "32", "direct", "on", "gpu"),
            ("64", "1", "buffered", "off", "gpu"),
        ] {
            let mut args: Vec<&str> = base
                .iter()
                .copied()
                .filter(|&a| a != "cpu" && a != "--device")
                .collect();
            args.extend(["--device", device]);
            args.extend([
                "--pool-slots",
                slots,
                "--queue-depth",
                qd,
                "--io",
                io,
                "--lookahead",
                lookahead,
            ]);
            let v = run_json(&args);
            let ids: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
            assert_eq!(
                ids, want,
                "{name}: pool {slots} qd {qd} {io} lookahead {lookahead} on {device}"
            );
            let pool = &v["pool"];
            assert!(
                pool["misses"].as_u64().unwrap() > 0 && pool["hits"].as_u64().unwrap() > 0,
                "{pool}"
            );
            let speculative = pool["speculative_reads"].as_u64().unwrap();
            assert_eq!(
                speculative > 0,
                lookahead == "on" && slots != "64",
                "{name} {slots} {lookahead}: {pool}"
            );
        }
    }
}

#[test]
fn bad_input_gives_clear_errors() {
    let dir = fixture_dir(FIXTURES[0]);
    let dir = dir.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["generate", "--model", "/no/such/model", "--prompt", "hi"],
            "no/such/model",
        ),
        (
            &["serve", "--model", "/no/such/model"],
            "loading the model: /no/such/model: model directory not found",
        ),
        (
            &["generate", "--model", dir, "--prompt-ids", "1,x"],
            "not a token id",
        ),
        (
            &[
                "generate",
                "--model",
                dir,
                "--prompt-ids",
                "1,99999",
                "--device",
                "cpu",
            ],
            "out of range",
        ),
        (
            &[
                "generate",
                "--model",
                dir,
                "--prompt",
                "hi",
                "--pool-slots",
                "3",
                "--device",
                "cpu",
            ],
            "below the floor",
        ),
        (
            &[
                "generate", "--model", dir, "--prompt", "hi", "--top-p", "2", "--device", "cpu",
            ],
            "top-p",
        ),
        (
            &[
                "generate", "--model", dir, "--prompt", "hi", "--io", "sideways",
            ],
            "sideways",
        ),
        (
            &[
                "generate",
                "--model",
                dir,
                "--prompt",
                "hi",
                "--memory-budget",
                "20MiB",
                "--device",
                "cpu",
            ],
            "below the floor",
        ),
        (
            &[
                "generate",
                "--model",
                dir,
                "--prompt",
                "hi",
                "--memory-budget",
                "1GiB",
                "--pool-slots",
                "30",
            ],
            "cannot be used with",
        ),
        (
            &[
                "generate",
                "--model",
                dir,
                "--prompt",
                "hi",
                "--memory-budget",
                "lots",
            ],
            "not a size",
        ),
        // Negative values reach the checks instead of being taken for flags.
        (
            &[
                "generate",
                "--model",
                dir,
                "--prompt",
                "hi",
                "--temperature",
                "-1",
                "--device",
                "cpu",
            ],
            "temperature must be",
        ),
        // Read as the server reads them: top-k -1 is off, but a seed is -1 or 0 to 2^64 - 1.
        (
            &[
                "generate", "--model", dir, "--prompt", "hi", "--seed", "-2", "--top-k", "-1",
            ],
            "--seed -2 is not an integer from 0 to 2^64 - 1, or -1 for a random one",
        ),
        // A flag where a value belongs is a missing value, not a value.
        (
            &[
                "generate",
                "--model",
                dir,
                "--prompt",
                "hi",
                "--memory-budget",
                "--pool-slots",
                "3",
            ],
            "a value is required for '--memory-budget",
        ),
        // Values with which every request would fail or come back empty are refused at
        // startup (the port is not even bound). `generate --max-tokens 0` is one run that
        // reports that nothing ran (below).
        (
            &["serve", "--model", dir, "--max-tokens", "0"],
            "invalid value '0' for '--max-tokens",
        ),
        (
            &["chat", "--model", dir, "--max-tokens", "0"],
            "invalid value '0' for '--max-tokens",
        ),
        (
            &["serve", "--model", dir, "--context", "1"],
            "invalid value '1' for '--context",
        ),
    ];
    for (args, needle) in cases {
        let out = slotstream().args(*args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// A chat template that cannot be read (chat_template.jinja not UTF-8) or rendered (an
/// unclosed tag) fails what needs it (a text wrapped in the template, `chat`), naming
/// the template, and nothing else: raw text, ids and scoring still run.
#[test]
fn a_malformed_chat_template_fails_only_what_needs_it() {
    let unreadable = copy_fixture(FIXTURES[0]);
    std::fs::write(
        unreadable.path().join("chat_template.jinja"),
        b"{{ messages \xff\xfe }}",
    )
    .unwrap();
    let unclosed = copy_fixture(FIXTURES[0]);
    edit_json(&unclosed.path().join("tokenizer_config.json"), |v| {
        v["chat_template"] = "{% if messages %}{{ unclosed".into();
    });
    for tmp in [&unreadable, &unclosed] {
        check_malformed_template(tmp.path().to_str().unwrap());
    }
}

fn check_malformed_template(dir: &str) {
    // `command --model dir` with `rest`, and a chat's first turn on stdin for `chat` to
    // render.
    let run = |command: &str, rest: &[&str]| {
        use std::io::Write;
        let mut child = slotstream()
            .args([command, "--model", dir])
            .args(rest)
            .args(["--device", "cpu"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The command may end before it reads (an error at open): a closed pipe is fine.
        let _ = child.stdin.take().unwrap().write_all(b"hi\n");
        child.wait_with_output().unwrap()
    };
    let two = ["--max-tokens", "2"];
    for (command, rest) in [
        (
            "generate",
            &[&["--prompt", "hi", "--raw"][..], &two].concat(),
        ),
        ("generate", &[&["--prompt-ids", "1,2"][..], &two].concat()),
        ("score", &vec!["--ids", "1,2,3"]),
    ] {
        let out = run(command, rest);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{command} {rest:?}: {err}");
    }
    for (command, rest) in [
        ("generate", &[&["--prompt", "hi"][..], &two].concat()),
        ("chat", &vec![]),
    ] {
        let out = run(command, rest);
        let err = String::from_utf8_lossy(&out.stderr);
        // `chat` reports a turn that fails to render and goes on to the next (it ends at
        // the end of its input); a template it cannot read ends it at once.
        if command == "generate" {
            assert!(!out.status.success(), "{command} {rest:?} succeeded");
        }
        assert!(err.contains("chat template"), "{command} {rest:?}: {err}");
        assert!(!err.contains("panicked"), "{command} {rest:?}: {err}");
    }
}

/// `--max-tokens 0` runs nothing, not even the prefill, and the stats lines say so
/// instead of printing rates and a hit rate of nothing.
#[test]
fn zero_max_tokens_reports_that_nothing_ran() {
    let dir = fixture_dir(FIXTURES[0]);
    let out = slotstream()
        .args([
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "0",
            "--stats",
            "--device",
            "cpu",
            "--pool-slots",
            "30",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("prefill of 3 tokens not run"), "{err}");
    assert!(err.contains("decode 0 tokens"), "{err}");
    assert!(err.contains("pool: no expert lookups"), "{err}");
}

#[test]
fn peak_rss_stays_within_the_planned_budget() {
    let name = FIXTURES[0];
    let r = reference(name);
    let dir = fixture_dir(name);
    let prompt: Vec<String> = r.prompt_ids.iter().map(|i| i.to_string()).collect();
    let budget = 64u64 << 20;
    let v = run_json(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        &prompt.join(","),
        "--max-tokens",
        "16",
        "--json",
        "--device",
        "cpu",
        "--memory-budget",
        "64MiB",
    ]);
    let ids: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
    assert_eq!(ids, expected(name)[..16.min(expected(name).len())]);
    let peak = v["peak_rss_bytes"]
        .as_u64()
        .expect("peak RSS is reported on Linux");
    assert!(
        peak <= budget,
        "peak RSS {peak} above the planned budget {budget}"
    );
    assert!(v["pool"]["slots"].as_u64().unwrap() > 0);
}

/// NaN, +Inf and -Inf logits (a row of lm_head's scales each, at random ids the greedy
/// continuation never picks) are left out: greedy generation gives mlx-lm's tokens (it
/// used to give token 0 forever), with one warning counting them. With the final norm
/// NaN no logit is finite: exit 1 naming the fault, no tokens.
#[test]
fn non_finite_logits_are_left_out_and_none_finite_fails() {
    use rand::Rng;
    let name = FIXTURES[0];
    let r = reference(name);
    let want = expected(name);
    let n = r.greedy_ids.len();
    let mut rng = rand::rng();
    let mut rows: Vec<usize> = Vec::new();
    while rows.len() < 3 {
        let id = rng.random_range(0..r.vocab);
        if !r.greedy_ids.contains(&(id as u32)) && !rows.contains(&id) {
            rows.push(id);
        }
    }
    let tmp = copy_fixture(name);
    let planted = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
    fill_rows(tmp.path(), "lm_head.scales", |row| {
        rows.iter().position(|&r| r == row).map(|i| planted[i])
    });
    let prompt: Vec<String> = r.prompt_ids.iter().map(|i| i.to_string()).collect();
    let args = |dir: &std::path::Path| -> Vec<String> {
        [
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            &prompt.join(","),
            "--max-tokens",
            &n.to_string(),
            "--json",
            "--device",
            "cpu",
        ]
        .map(String::from)
        .to_vec()
    };
    let out = slotstream().args(args(tmp.path())).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "rows {rows:?}: {err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
    assert_eq!(ids, want, "rows {rows:?}");
    // One draw per token, and one more for the EOS where the continuation ends with one.
    let steps = if want.len() < n { want.len() + 1 } else { n };
    let warnings: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("non_finite_logits"))
        .collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(
        warnings[0].contains(&format!("non_finite_logits={} steps={steps}", 3 * steps)),
        "{err}"
    );

    let tmp = copy_fixture(name);
    fill_rows(tmp.path(), "model.norm.weight", |_| Some(f32::NAN));
    let out = slotstream().args(args(tmp.path())).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("none of the 512 logits of a step is finite"),
        "{err}"
    );
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Generation stops at the context with finish reason `length`: `--context`, or the
/// model's `max_position_embeddings` when that is smaller (a larger `--context` is
/// capped, with a warning); a prompt that fills the context is refused with the numbers,
/// exit 1. (EOS ids removed, so only the bound stops it.)
#[test]
fn generation_stops_at_the_context() {
    let tmp = copy_fixture(FIXTURES[0]);
    without_eos(tmp.path());
    let dir = tmp.path().to_str().unwrap();
    let ids: Vec<String> = (0..10).map(|i| (7 * i + 3).to_string()).collect();
    let ids = ids.join(",");
    let run = |extra: &[&str]| {
        let base = [
            "generate",
            "--model",
            dir,
            "--prompt-ids",
            &ids,
            "--json",
            "--device",
            "cpu",
        ];
        slotstream().args(base).args(extra).output().unwrap()
    };
    let out = run(&["--max-tokens", "5000", "--context", "40"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 30, "{v}");
    assert_eq!(v["stats"]["finish_reason"], "length");
    // The model's own bound, under a larger --context.
    edit_json(&tmp.path().join("config.json"), |v| {
        v["max_position_embeddings"] = serde_json::json!(24)
    });
    let out = run(&["--max-tokens", "5000", "--context", "8192"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("max_position_embeddings=24"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 14, "{v}");
    // A prompt that fills the context.
    let out = run(&["--context", "10"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the prompt has 10 tokens, which leaves no room in the context of 10 tokens"),
        "{err}"
    );
}

/// One log line says which backend runs and why, whatever picked it (on a machine whose
/// only adapter is lavapipe the default is the CPU backend, and no GPU is opened first).
#[test]
fn one_line_says_which_backend_runs_and_why() {
    let dir = fixture_dir(FIXTURES[0]);
    for (device, want) in [
        (None, "backend: "),
        (Some("cpu"), "using the CPU backend: --device cpu"),
        (Some("gpu"), "using the GPU backend: --device gpu"),
    ] {
        let mut cmd = slotstream();
        cmd.env("RUST_LOG", "slotstream=info").args([
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "1",
        ]);
        if let Some(d) = device {
            cmd.args(["--device", d]);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{device:?}: {err}");
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| l.contains("backend") || l.contains("GPU opened"))
            .collect();
        assert_eq!(lines.len(), 1, "{device:?}: {err}");
        assert!(lines[0].contains(want), "{device:?}: {err}");
        if device.is_none() && lines[0].contains("CPU backend") {
            assert!(lines[0].contains("no GPU adapter") || lines[0].contains("CPU emulation"));
        }
    }
}

/// The prompt is checked before the weights load: against a copy of a fixture whose
/// shards are gone, an empty prompt, an id out of range, a prompt that fills the context,
/// `--think` on a model without a chat template and `chat` on that model report their own
/// error, not the missing shard (which a prompt that passes the checks meets).
#[test]
fn prompt_errors_come_before_the_weights_load() {
    let tmp = copy_fixture(FIXTURES[0]);
    for entry in std::fs::read_dir(tmp.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            std::fs::remove_file(path).unwrap();
        }
    }
    let bare = copy_dir(tmp.path());
    edit_json(&bare.path().join("tokenizer_config.json"), |v| {
        v.as_object_mut().unwrap().remove("chat_template");
    });
    let dir = tmp.path().to_str().unwrap();
    let bare = bare.path().to_str().unwrap();
    let cpu = ["--device", "cpu"];
    let cases: &[(&[&str], &str)] = &[
        (
            &["generate", "--model", dir, "--prompt-ids", "1,99999"],
            "out of range",
        ),
        (
            &["generate", "--model", dir, "--prompt", "", "--raw"],
            "the prompt is empty",
        ),
        (
            &[
                "generate",
                "--model",
                dir,
                "--prompt-ids",
                "1,2,3",
                "--context",
                "3",
            ],
            "leaves no room in the context of 3 tokens",
        ),
        (
            &[
                "generate", "--model", bare, "--prompt", "hi", "--think", "on",
            ],
            "need a prompt text, without --raw, and a model with a chat template",
        ),
        (&["chat", "--model", bare], "has no chat template"),
        // The control: a good prompt gets as far as the weights.
        (
            &["generate", "--model", dir, "--prompt-ids", "1,2"],
            "model.safetensors",
        ),
    ];
    for (args, needle) in cases {
        let out = slotstream()
            .args(*args)
            .args(cpu)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// The common tiny body with wider experts: 64 of 512 columns a layer, so the routed
/// records (about 50 MiB) dominate the fixed terms and a machine can hold the pool's
/// floor but not every record.
const WIDE: slotstream::tools::synth::Preset = slotstream::tools::synth::Preset {
    name: "wide",
    hidden: 256,
    experts: 64,
    intermediate: 512,
    ..TINY
};

/// Without a pool or budget flag, `generate` plans from the machine (simulated by
/// `SLOTSTREAM_SIM_RAM_GB`): on a machine too small for the whole model the experts
/// stream through a pool within 70% of its RAM, the context chosen for that budget (and
/// lowered to leave the pool its floor);
/// on a large one every record stays resident; the greedy ids agree.
#[test]
fn a_no_flag_generate_streams_on_a_machine_too_small_for_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    slotstream::tools::synth::write_checkpoint_with(tmp.path(), &WIDE, WIDE.layers, false, None)
        .unwrap();
    let dir = tmp.path().to_str().unwrap();
    let run = |gib: &str| {
        let out = slotstream()
            .args(["generate", "--model", dir, "--prompt-ids", "1,2,3,4,5"])
            .args(["--max-tokens", "6", "--device", "cpu", "--json"])
            .env(slotstream::machine::SIM_RAM_ENV, gib)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{gib} GiB: {err}");
        let plan = err
            .lines()
            .find(|l| l.contains("memory plan:"))
            .unwrap_or_else(|| panic!("no plan logged: {err}"))
            .to_string();
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (json, plan)
    };
    let (small, plan) = run("0.22");
    let budget = (0.22 * (1u64 << 30) as f64) as u64 * 70 / 100;
    assert!(
        plan.contains("RAM 225.3 MiB") && plan.contains("(70% of RAM)"),
        "{plan}"
    );
    assert!(plan.contains("experts streamed through a pool"), "{plan}");
    let p = &small["plan"];
    assert!(p["budget"].as_u64().unwrap().abs_diff(budget) <= 1, "{p}");
    let (slots, floor, records) = (
        p["slots"].as_u64().unwrap(),
        p["floor"].as_u64().unwrap(),
        p["records"].as_u64().unwrap(),
    );
    assert!(floor <= slots && slots < records, "{p}");
    assert!(!small["pool"].is_null());
    // 10% of the budget holds 16384 tokens of this model's KV cache and states (about
    // 520 bytes a token), not 32768; that context, with a prompt's hidden states for
    // layer-major prefill (2 KiB a token), would leave the pool below its floor,
    // so the plan steps down to a smaller size that does not.
    let context = p["context"].as_u64().unwrap();
    assert!([4096, 8192].contains(&context), "{p}");
    assert!(
        plan.contains(&format!("context {context} tokens")),
        "{plan}"
    );

    let (big, plan) = run("64");
    assert!(plan.contains("every record resident"), "{plan}");
    assert!(big["plan"].is_null() && big["pool"].is_null(), "{big}");
    assert_eq!(small["output_ids"], big["output_ids"]);
    assert_eq!(small["output_ids"].as_array().unwrap().len(), 6);
}

/// `generate` says the prompt's size and its prefill estimate before the prefill (a
/// streamed plan's read-bound rate, before any prompt is measured), and
/// `--max-prefill-wait` refuses a prompt whose estimate is over it, with the numbers.
#[test]
fn generate_estimates_the_prefill_and_refuses_one_over_max_prefill_wait() {
    let tmp = tempfile::tempdir().unwrap();
    slotstream::tools::synth::write_checkpoint_with(tmp.path(), &WIDE, WIDE.layers, false, None)
        .unwrap();
    let dir = tmp.path().to_str().unwrap();
    let run = |extra: &[&str]| {
        slotstream()
            .args(["generate", "--model", dir, "--prompt-ids", "1,2,3,4,5"])
            .args(["--max-tokens", "2", "--device", "cpu"])
            .args(extra)
            .env(slotstream::machine::SIM_RAM_ENV, "0.22")
            .output()
            .unwrap()
    };
    let out = run(&["--max-prefill-wait", "1000000"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("prompt: 5 tokens; prefill at least "))
        .unwrap_or_else(|| panic!("no estimate: {err}"));
    assert!(line.contains("the plan's reads alone, at 2 GB/s"), "{line}");
    let out = run(&["--max-prefill-wait", "0.000001"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("the prompt's 5 tokens would take at least")
            && err.contains("more than the 0.000001 s allowed (--max-prefill-wait)"),
        "{err}"
    );
}

/// `chat` (whose prompt cache takes 10% of the budget) refuses a random budget below the
/// floor with the smallest budget that runs; that figure, typed back, is accepted, and
/// the figure printed one step (0.1 MiB) lower is refused.
#[test]
fn the_budget_chat_advises_runs_the_first_time() {
    use rand::Rng;
    let dir = fixture_dir("qwen3-next-bf16");
    let dir = dir.to_str().unwrap();
    let chat = |budget: &str| {
        let out = slotstream()
            .args(["chat", "--model", dir, "--device", "cpu"])
            .args(["--memory-budget", budget])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let given = format!("{} KiB", rand::rng().random_range(1024..40 * 1024));
    let (ok, err) = chat(&given);
    assert!(!ok, "{given} ran");
    let advised = err
        .split("the smallest budget that runs is ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .unwrap_or_else(|| panic!("no advice: {err}"))
        .to_string();
    let (ok, err) = chat(&advised);
    assert!(ok, "{advised} (advised after {given}) refused: {err}");
    let mib: f64 = advised
        .strip_suffix(" MiB")
        .expect("a figure in MiB")
        .parse()
        .unwrap();
    let (ok, _) = chat(&format!("{:.1} MiB", mib - 0.1));
    assert!(
        !ok,
        "one step below {advised} ran: the advice is not the smallest"
    );
}
