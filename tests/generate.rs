//! `slotstream generate` end to end: greedy output ids equal mlx-lm's for the fixtures, on
//! the CPU, with experts mapped and streamed through pools of several sizes, queue depths
//! and I/O modes; plus the CLI's errors for bad input.

mod common;

use std::process::Command;

use common::*;

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
            "loading model /no/such/model: /no/such/model: model directory not found",
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
        (
            &[
                "generate", "--model", dir, "--prompt", "hi", "--top-k", "-1",
            ],
            "invalid value '-1' for '--top-k",
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
    ];
    for (args, needle) in cases {
        let out = slotstream().args(*args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
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
