//! `slotstream launch` and `slotstream stop`, with stand-in tools: shell scripts named
//! `claude`, `codex` and `opencode`, first on PATH, that record their environment,
//! arguments and the configuration file they were pointed at. The base URLs they get are
//! asked for the model list, so they are the server's; `--dry-run` starts nothing;
//! `launch` starts one server and a second reuses it; `stop` ends it with SIGTERM; and
//! `--idle-exit` ends one by itself (0.02 minutes: 1.2 s); `serve` itself exits with
//! status 0 on SIGTERM and when idle. The cache directory is a
//! temporary `XDG_CACHE_HOME`, the servers run on the CPU on free ports.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::Value;

const NAME: &str = "qwen3-next-bf16";
/// The fixture's max_position_embeddings: the context a launched server reports.
const CONTEXT: u64 = 4096;

/// A stand-in for a coding agent: records how it was run, exits with `$STUB_EXIT`.
const STUB: &str = r#"#!/bin/sh
out="$LAUNCH_RECORD/$(basename "$0")"
mkdir -p "$out"
env > "$out/env"
: > "$out/args"
for a in "$@"; do printf '%s\n' "$a" >> "$out/args"; done
if [ -n "$OPENCODE_CONFIG" ]; then cp "$OPENCODE_CONFIG" "$out/config.json"; fi
exit "${STUB_EXIT:-0}"
"#;

/// A temporary home: the stand-in tools, what they record, and the cache directory.
struct Bench {
    tmp: tempfile::TempDir,
}

impl Bench {
    fn new() -> Self {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let bin = tmp.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        for tool in ["claude", "codex", "opencode"] {
            let path = bin.join(tool);
            std::fs::write(&path, STUB).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        Bench { tmp }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    /// `slotstream ARGS` with the stand-ins first on PATH and `env` set.
    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let path = format!(
            "{}:{}",
            self.path("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut command = Command::new(env!("CARGO_BIN_EXE_slotstream"));
        command
            .args(args)
            .env("PATH", path)
            .env("HOME", self.path("home"))
            .env("XDG_CACHE_HOME", self.path("cache"))
            .env("LAUNCH_RECORD", self.path("record"))
            .env("RUST_LOG", "slotstream=info")
            .env_remove("SLOTSTREAM_API_KEY")
            .env_remove("STUB_EXIT");
        for (k, v) in env {
            command.env(k, v);
        }
        command.output().unwrap()
    }

    /// `slotstream launch TOOL` on the fixture at `port`, the server on the CPU, with
    /// `flags` and then the tool's arguments `a "b c"`; asserts success.
    fn launch(&self, tool: &str, port: u16, flags: &[&str], env: &[(&str, &str)]) -> Output {
        let fixture = fixture_dir(NAME);
        let port = port.to_string();
        let mut args = vec![
            "launch",
            tool,
            "--model",
            fixture.to_str().unwrap(),
            "--port",
            &port,
            "--serve-arg=--device=cpu",
        ];
        args.extend(flags);
        args.extend(["--", "a", "b c"]);
        let out = self.run(&args, env);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        out
    }

    /// What the stand-in `tool` recorded: its environment and arguments.
    fn recorded(&self, tool: &str) -> (HashMap<String, String>, Vec<String>) {
        let dir = self.path("record").join(tool);
        let env = std::fs::read_to_string(dir.join("env")).unwrap();
        let env = env
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let args = std::fs::read_to_string(dir.join("args")).unwrap();
        (env, args.lines().map(String::from).collect())
    }

    fn pid_file(&self, port: u16) -> PathBuf {
        self.path(&format!("cache/slotstream/logs/serve-{port}.pid"))
    }

    fn log(&self, port: u16) -> String {
        std::fs::read_to_string(self.path(&format!("cache/slotstream/logs/serve-{port}.log")))
            .unwrap()
    }

    /// The pid of the server `launch` started on `port`.
    fn pid(&self, port: u16) -> u32 {
        std::fs::read_to_string(self.pid_file(port))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for Bench {
    /// Ends any server a failed test left running (those `stop` did not remove).
    fn drop(&mut self) {
        let Ok(dir) = std::fs::read_dir(self.path("cache/slotstream/logs")) else {
            return;
        };
        for entry in dir.flatten() {
            let pid = std::fs::read_to_string(entry.path())
                .ok()
                .and_then(|t| t.trim().parse::<i32>().ok());
            if let Some(pid) = pid.filter(|&p| running(p as u32)) {
                // SAFETY: kill only signals the server this bench's launch started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A port nothing listens on (free when asked).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

fn listening(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// Whether process `pid` runs (an exited one awaiting its parent does not).
fn running(pid: u32) -> bool {
    let out = Command::new("ps")
        .args(["-o", "stat=", "-p", &pid.to_string()])
        .output()
        .unwrap();
    let stat = text(&out.stdout);
    out.status.success() && !stat.trim().is_empty() && !stat.trim_start().starts_with('Z')
}

/// Waits up to `limit` for `pid` to end; whether it did.
fn ends_within(pid: u32, limit: Duration) -> bool {
    let start = Instant::now();
    while running(pid) {
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// `GET url`: the status and the JSON body.
fn get(url: &str) -> (u16, Value) {
    runtime().block_on(async {
        let r = reqwest::get(url).await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    })
}

/// The models a base URL's `/models` lists, with their context windows.
fn models_at(base: &str) -> Vec<(String, u64)> {
    let (status, body) = get(&format!("{base}/models"));
    assert_eq!(status, 200, "{body}");
    body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_string(),
                m["context_window"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// The `-c key=value` overrides in a Codex command line, in order.
fn codex_overrides(args: &[String]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "-c" {
            let (k, v) = it.next().unwrap().split_once('=').unwrap();
            out.push((k.to_string(), v.to_string()));
        }
    }
    out
}

/// The value of a TOML inline table's `field = "..."`, in the form launch writes it.
fn inline_field(table: &str, field: &str) -> Option<String> {
    let at = table.find(&format!("{field} = \""))? + field.len() + 4;
    Some(table[at..].split('"').next()?.to_string())
}

#[test]
fn launch_starts_a_server_reuses_it_and_stop_ends_it() {
    let bench = Bench::new();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");

    // Claude Code: nothing runs on the port, so launch starts a server.
    let out = bench.launch("claude", port, &["--idle-exit", "0"], &[]);
    assert!(text(&out.stderr).contains("started slotstream serve"));
    let pid = bench.pid(port);
    assert!(running(pid), "the server ended: {}", bench.log(port));
    assert_eq!(get(&format!("{base}/health")).0, 200);
    assert_eq!(models_at(&format!("{base}/v1"))[0], (NAME.into(), CONTEXT));
    let (env, args) = bench.recorded("claude");
    assert_eq!(env["ANTHROPIC_BASE_URL"], base);
    // No key set: a stand-in token, and no key of the user's in the way.
    assert_eq!(env["ANTHROPIC_AUTH_TOKEN"], "slotstream");
    assert_eq!(env["ANTHROPIC_API_KEY"], "");
    for var in ["ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL"] {
        assert_eq!(env[var], NAME, "{var}");
    }
    assert_eq!(args, ["a", "b c"]);

    // Codex: the same server (same process, not started again), through -c overrides.
    let out = bench.launch("codex", port, &[], &[]);
    assert!(
        !text(&out.stderr).contains("started"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(bench.pid(port), pid);
    let (env, args) = bench.recorded("codex");
    assert!(!env.contains_key("SLOTSTREAM_API_KEY"));
    assert_eq!(args[args.len() - 2..], ["a", "b c"]);
    let overrides: HashMap<_, _> = codex_overrides(&args).into_iter().collect();
    assert_eq!(overrides["model_provider"], "\"slotstream\"");
    assert_eq!(overrides["model"], format!("\"{NAME}\""));
    assert_eq!(overrides["model_context_window"], CONTEXT.to_string());
    let provider = &overrides["model_providers.slotstream"];
    assert_eq!(inline_field(provider, "wire_api").unwrap(), "responses");
    assert_eq!(inline_field(provider, "env_key"), None);
    let provider_base = inline_field(provider, "base_url").unwrap();
    assert_eq!(models_at(&provider_base)[0].0, NAME);

    // opencode: a config file of its own; the tool's exit status is launch's.
    let out = bench.run(
        &[
            "launch",
            "opencode",
            "--no-start",
            "--port",
            &port.to_string(),
        ],
        &[("STUB_EXIT", "3")],
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let (env, _) = bench.recorded("opencode");
    let config_path = Path::new(&env["OPENCODE_CONFIG"]);
    assert!(config_path.starts_with(bench.path("cache/slotstream")));
    let config = read_json(&bench.path("record/opencode/config.json"));
    assert_eq!(config["model"], format!("slotstream/{NAME}"));
    let provider = &config["provider"]["slotstream"];
    assert_eq!(provider["npm"], "@ai-sdk/openai-compatible");
    assert_eq!(provider["models"][NAME]["limit"]["context"], CONTEXT);
    assert!(provider["options"].get("apiKey").is_none());
    let listed = models_at(provider["options"]["baseURL"].as_str().unwrap());
    assert_eq!(listed[0], (NAME.into(), CONTEXT));
    assert_eq!(bench.pid(port), pid);

    // stop: SIGTERM, a clean shutdown, the pid file gone.
    let out = bench.run(&["stop", "--port", &port.to_string()], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains(&format!(
        "stopped slotstream serve on port {port} (pid {pid})"
    )));
    assert!(!running(pid));
    assert!(!listening(port));
    assert!(!bench.pid_file(port).exists());
    assert!(
        bench.log(port).contains("shutting down"),
        "{}",
        bench.log(port)
    );
    let out = bench.run(&["stop", "--port", &port.to_string()], &[]);
    assert!(out.status.success());
    assert!(text(&out.stdout).contains("no server started by `slotstream launch`"));
}

#[test]
fn idle_exit_ends_a_launched_server_by_itself() {
    let bench = Bench::new();
    let port = free_port();
    bench.launch("claude", port, &["--idle-exit", "0.02"], &[]);
    let pid = bench.pid(port);
    assert!(
        ends_within(pid, Duration::from_secs(60)),
        "still running: {}",
        bench.log(port)
    );
    let log = bench.log(port);
    assert!(
        log.contains("no request for 0.02 minutes (--idle-exit)"),
        "{log}"
    );
    assert!(log.contains("shutting down"), "{log}");
    assert!(!listening(port));
    // stop finds the pid file of a server that ended, says so, and removes it.
    let out = bench.run(&["stop", "--port", &port.to_string()], &[]);
    assert!(out.status.success());
    assert!(
        text(&out.stdout).contains("it had ended"),
        "{}",
        text(&out.stdout)
    );
    assert!(!bench.pid_file(port).exists());
}

/// The sections of a dry run's output: each `# heading` with the lines under it.
fn sections(out: &str) -> Vec<(String, String)> {
    let mut sections: Vec<(String, String)> = Vec::new();
    for line in out.lines() {
        match line.strip_prefix("# ") {
            Some(heading) => sections.push((heading.to_string(), String::new())),
            None => {
                let last = sections.last_mut().expect("output starts with a heading");
                last.1 += line;
                last.1 += "\n";
            }
        }
    }
    sections
}

#[test]
fn dry_run_prints_what_it_would_set_and_run_and_starts_nothing() {
    let bench = Bench::new();
    let port = free_port();
    let fixture = fixture_dir(NAME);
    for key in [None, Some("sekrit")] {
        let env: Vec<(&str, &str)> = key.map(|k| ("SLOTSTREAM_API_KEY", k)).into_iter().collect();
        for tool in ["claude", "codex", "opencode"] {
            let out = bench.launch(tool, port, &["--dry-run"], &env);
            let stdout = text(&out.stdout);
            let sections = sections(&stdout);
            let headings: Vec<&str> = sections.iter().map(|(h, _)| h.as_str()).collect();
            // The server it would start, with the idle exit, on the port.
            assert!(
                headings[0].starts_with(&format!("no server on port {port}")),
                "{stdout}"
            );
            let serve = shlex::split(sections[0].1.trim()).unwrap();
            assert_eq!(
                serve[1..5],
                ["serve", "--model", fixture.to_str().unwrap(), "--port"]
            );
            assert_eq!(serve[5], port.to_string());
            assert!(
                serve.windows(2).any(|w| w == ["--idle-exit", "30"]),
                "{serve:?}"
            );
            assert_eq!(serve.last().unwrap(), "--device=cpu");
            // The tool's command line, with the user's arguments last.
            let (heading, command) = sections.last().unwrap();
            assert_eq!(heading, "command:");
            let command = shlex::split(command.trim()).unwrap();
            assert_eq!(command[0], bench.path("bin").join(tool).to_str().unwrap());
            assert_eq!(command[command.len() - 2..], ["a", "b c"]);
            let env: HashMap<String, String> = sections
                .iter()
                .find(|(h, _)| h == "environment:")
                .unwrap()
                .1
                .lines()
                .map(|l| {
                    let (k, v) = l.split_once('=').unwrap();
                    (k.to_string(), shlex::split(v).unwrap().concat())
                })
                .collect();
            let base = format!("http://127.0.0.1:{port}");
            match tool {
                "claude" => {
                    assert_eq!(env["ANTHROPIC_BASE_URL"], base);
                    assert_eq!(env["ANTHROPIC_AUTH_TOKEN"], key.unwrap_or("slotstream"));
                    assert_eq!(env["ANTHROPIC_API_KEY"], "");
                    assert_eq!(env["ANTHROPIC_MODEL"], NAME);
                }
                "codex" => {
                    let overrides: HashMap<_, _> = codex_overrides(&command).into_iter().collect();
                    let provider = &overrides["model_providers.slotstream"];
                    assert_eq!(
                        inline_field(provider, "base_url").unwrap(),
                        format!("{base}/v1")
                    );
                    assert_eq!(overrides["model_context_window"], CONTEXT.to_string());
                    match key {
                        Some(k) => {
                            assert_eq!(
                                inline_field(provider, "env_key").unwrap(),
                                "SLOTSTREAM_API_KEY"
                            );
                            assert_eq!(env["SLOTSTREAM_API_KEY"], k);
                        }
                        None => assert_eq!(inline_field(provider, "env_key"), None),
                    }
                }
                _ => {
                    // The file's path, then its text (not written by a dry run).
                    let path = &env["OPENCODE_CONFIG"];
                    let (_, file) = sections
                        .iter()
                        .find(|(h, _)| h == &format!("{path}:"))
                        .unwrap_or_else(|| panic!("no {path} in {stdout}"));
                    assert!(!Path::new(path).exists());
                    let config: Value = serde_json::from_str(file).unwrap();
                    let provider = &config["provider"]["slotstream"];
                    assert_eq!(provider["options"]["baseURL"], format!("{base}/v1"));
                    assert_eq!(provider["models"][NAME]["limit"]["context"], CONTEXT);
                    match key {
                        // The key stays in the environment, out of the file.
                        Some(k) => {
                            assert_eq!(provider["options"]["apiKey"], "{env:SLOTSTREAM_API_KEY}");
                            assert!(!file.contains(k));
                            assert_eq!(env["SLOTSTREAM_API_KEY"], k);
                        }
                        None => assert!(provider["options"].get("apiKey").is_none()),
                    }
                }
            }
        }
    }
    // Nothing ran: no tool, no server, no files.
    assert!(!bench.path("record").exists());
    assert!(!bench.path("cache").exists());
    assert!(!listening(port));
}

#[test]
fn launch_says_what_is_missing() {
    let bench = Bench::new();
    let port = free_port().to_string();
    let fixture = fixture_dir(NAME);
    let fixture = fixture.to_str().unwrap();
    let fails = |args: &[&str], env: &[(&str, &str)], says: &str| {
        let out = bench.run(args, env);
        let err = text(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
    };
    // A tool not on PATH: how to install it, and no server started.
    let empty = bench.path("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let launch = ["launch", "codex", "--model", fixture, "--port", &port];
    fails(
        &launch,
        &[("PATH", empty.to_str().unwrap())],
        "`codex` is not on PATH: install it with npm install -g @openai/codex",
    );
    assert!(!bench.path("cache").exists());
    fails(
        &["launch", "claude", "--no-start", "--port", &port],
        &[],
        &format!("no server on port {port} (--no-start)"),
    );
    fails(
        &["launch", "claude", "--port", &port],
        &[],
        "give --model DIR to start one",
    );

    // A port taken by a server of another kind is neither used nor fought over.
    let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let other_port = other.local_addr().unwrap().port().to_string();
    std::thread::spawn(move || {
        for stream in other.incoming() {
            let mut stream = stream.unwrap();
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let body = r#"{"data":[{"id":"x","owned_by":"someone"}]}"#;
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    fails(
        &[
            "launch",
            "claude",
            "--model",
            fixture,
            "--port",
            &other_port,
        ],
        &[],
        &format!("port {other_port} is used by a server that is not slotstream's"),
    );
    assert!(!bench.path("record").exists());
}

/// `slotstream serve` on the fixture (CPU) on `port` with `flags`, its stderr piped;
/// killed when dropped, so a failed test leaves no server behind.
struct Serve(std::process::Child);

impl Serve {
    fn spawn(port: u16, flags: &[&str]) -> Self {
        let fixture = fixture_dir(NAME);
        let child = Command::new(env!("CARGO_BIN_EXE_slotstream"))
            .args([
                "serve",
                "--device",
                "cpu",
                "--port",
                &port.to_string(),
                "--model",
            ])
            .arg(&fixture)
            .args(flags)
            .env("RUST_LOG", "slotstream=info")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        Serve(child)
    }

    /// Its exit status and everything it logged.
    fn wait(&mut self) -> (std::process::ExitStatus, String) {
        let mut log = String::new();
        self.0
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut log)
            .unwrap();
        (self.0.wait().unwrap(), log)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn serve_exits_cleanly_on_sigterm_and_when_idle() {
    // SIGTERM once serving (it answers: it is in its accept loop, watching the signals):
    // the shutdown Ctrl-C gets, and exit status 0.
    let port = free_port();
    let mut serve = Serve::spawn(port, &[]);
    let start = Instant::now();
    while !listening(port) || get(&format!("http://127.0.0.1:{port}/health")).0 != 200 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "serve never answered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: kill only sends a signal to the child this test started.
    assert_eq!(unsafe { libc::kill(serve.0.id() as i32, libc::SIGTERM) }, 0);
    let (status, log) = serve.wait();
    assert!(status.success(), "{status}: {log}");
    assert!(log.contains("shutting down"), "{log}");

    // --idle-exit 0.01 (0.6 s) with no request at all: it exits by itself, status 0.
    let (status, log) = Serve::spawn(free_port(), &["--idle-exit", "0.01"]).wait();
    assert!(status.success(), "{status}: {log}");
    assert!(
        log.contains("no request for 0.01 minutes (--idle-exit)"),
        "{log}"
    );
}
