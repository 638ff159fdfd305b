//! `slotstream launch` and `slotstream stop`: a coding agent (Claude Code, Codex, opencode)
//! run against a slotstream server on this machine.
//!
//! `launch` looks for a server on the port: one that answers `GET /v1/models` with a
//! model `owned_by: "slotstream"` is used as it is (a server still loading is waited
//! for; a server of another kind on the port is an error, never used). With none there,
//! it starts `slotstream serve` (this same binary) in the background, in its own process
//! group so the tool's Ctrl-C does not reach it, with `--idle-exit` so it ends by itself
//! once no client has called for that long; its log and pid file go to
//! `<cache>/logs/serve-<port>.log` and `.pid`. It then gives the tool the server's base
//! URL, model name, context window and key (if one is set) through its environment,
//! command-line overrides or a configuration file of this run's own, never through the
//! user's configuration, and becomes the tool (`exec`), so the tool's exit status is
//! `launch`'s. `stop` ends a server that `launch` started.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use super::flags::Minutes;
use super::serve::{model_name, DEFAULT_PORT};

/// How long a started server has to answer `/health` with 200 (loading a large model
/// from a slow disk takes minutes).
const START_TIMEOUT: Duration = Duration::from_secs(600);
/// How long `stop` waits for a server to exit: its shutdown grace (30 s) and some.
const STOP_TIMEOUT: Duration = Duration::from_secs(40);
/// How long one probe of the server waits for a connection or an answer (a server
/// binds its port before loading, and answers nothing until it has loaded).
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Time between two probes.
const POLL: Duration = Duration::from_millis(100);
/// Lines of a failed server's log shown.
const LOG_TAIL: usize = 20;
/// The room opencode keeps for a reply (and asks for as `max_tokens`), at most this or
/// half the context.
const OPENCODE_OUTPUT_TOKENS: usize = 8192;

#[derive(Args)]
pub struct LaunchArgs {
    /// The tool to run.
    #[arg(value_enum)]
    tool: Tool,
    /// Model directory to serve when no server runs on the port.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Port of the server on this machine (127.0.0.1).
    #[arg(long, default_value_t = DEFAULT_PORT)]
    port: u16,
    /// A server this command starts exits after this many minutes without a request
    /// (fractions allowed; 0: never).
    #[arg(long, default_value = "30")]
    idle_exit: Minutes,
    /// Context, in tokens, of a server this command starts (at most the model's; a coding
    /// agent's system prompt and tools alone take 10,000 to 20,000).
    #[arg(long, default_value_t = 65536)]
    context: usize,
    /// Another flag for a server this command starts (repeatable), e.g.
    /// `--serve-arg=--memory-budget=24GiB`.
    #[arg(long, allow_hyphen_values = true)]
    serve_arg: Vec<String>,
    /// Use a server already running on the port; never start one.
    #[arg(long)]
    no_start: bool,
    /// Print the environment, configuration files and command lines, and start nothing.
    #[arg(long)]
    dry_run: bool,
    /// The server's API key (a server this command starts requires it).
    #[arg(long, env = "SLOTSTREAM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Arguments for the tool, after `--`.
    #[arg(last = true)]
    args: Vec<String>,
}

#[derive(Args)]
pub struct StopArgs {
    /// Port of the server to stop.
    #[arg(long, default_value_t = DEFAULT_PORT)]
    port: u16,
}

/// The coding agents `launch` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Tool {
    /// Claude Code (Anthropic Messages, `/v1/messages`).
    Claude,
    /// Codex (OpenAI Responses, `/v1/responses`).
    Codex,
    /// opencode (OpenAI chat completions, `/v1/chat/completions`).
    Opencode,
}

impl Tool {
    fn program(self) -> &'static str {
        match self {
            Tool::Claude => "claude",
            Tool::Codex => "codex",
            Tool::Opencode => "opencode",
        }
    }

    /// What to say when the tool is not found: how to install it.
    fn not_found(self) -> String {
        let install = match self {
            Tool::Claude => {
                "npm install -g @anthropic-ai/claude-code (see https://code.claude.com/docs/en/quickstart)"
            }
            Tool::Codex => "npm install -g @openai/codex",
            Tool::Opencode => "npm install -g opencode-ai (see https://opencode.ai/docs)",
        };
        format!(
            "`{}` is not on PATH: install it with {install}",
            self.program()
        )
    }

    /// The environment, arguments before the user's, and files that point the tool at
    /// `server` for this run alone.
    fn setup(self, server: &Served, key: Option<&str>) -> Setup {
        let base = format!("http://127.0.0.1:{}", server.port);
        let model = &server.model;
        match self {
            // Claude Code's LLM-gateway settings (code.claude.com/docs/en/llm-gateway,
            // /en/settings#environment-variables): ANTHROPIC_AUTH_TOKEN is sent as
            // `Authorization: Bearer`, and an empty ANTHROPIC_API_KEY keeps a key of the
            // user's from taking precedence over it; every model alias maps to the served
            // model (the small one runs Claude Code's background requests).
            Tool::Claude => Setup {
                env: vec![
                    ("ANTHROPIC_BASE_URL", base),
                    ("ANTHROPIC_AUTH_TOKEN", key.unwrap_or("slotstream").into()),
                    ("ANTHROPIC_API_KEY", String::new()),
                    ("ANTHROPIC_MODEL", model.clone()),
                    ("ANTHROPIC_SMALL_FAST_MODEL", model.clone()),
                    ("ANTHROPIC_DEFAULT_OPUS_MODEL", model.clone()),
                    ("ANTHROPIC_DEFAULT_SONNET_MODEL", model.clone()),
                    ("ANTHROPIC_DEFAULT_HAIKU_MODEL", model.clone()),
                ],
                args: Vec::new(),
                files: Vec::new(),
            },
            // Codex's `-c key=value` overrides, TOML values at dotted keys, taking
            // precedence over config.toml and passed on to its subcommands (openai/codex
            // docs/config.md; codex-rs/cli/src/main.rs, `prepend_config_flags`): a provider
            // of this run's own, so ~/.codex/config.toml is left as it is. `env_key` names
            // the variable holding the key (codex refuses to start when it is named and
            // unset, so it is named only with a key).
            Tool::Codex => {
                let mut provider = format!(
                    "name = {}, base_url = {}, wire_api = \"responses\"",
                    toml_string("slotstream"),
                    toml_string(&format!("{base}/v1"))
                );
                let mut env = Vec::new();
                if let Some(key) = key {
                    provider.push_str(", env_key = \"SLOTSTREAM_API_KEY\"");
                    env.push(("SLOTSTREAM_API_KEY", key.to_string()));
                }
                let mut overrides = vec![
                    "model_provider=\"slotstream\"".to_string(),
                    format!("model_providers.slotstream={{ {provider} }}"),
                    format!("model={}", toml_string(model)),
                ];
                if let Some(context) = server.context {
                    overrides.push(format!("model_context_window={context}"));
                }
                Setup {
                    env,
                    args: overrides
                        .into_iter()
                        .flat_map(|o| ["-c".into(), o])
                        .collect(),
                    files: Vec::new(),
                }
            }
            // opencode reads a config file named by OPENCODE_CONFIG, merged over the
            // user's global one (opencode.ai/docs/config, "Custom config"); a custom
            // provider is an `@ai-sdk/openai-compatible` package with `options.baseURL`
            // and its models' `limit` (opencode.ai/docs/providers, "Custom provider").
            // `{env:VAR}` keeps a key out of the file.
            Tool::Opencode => {
                let mut options = json!({ "baseURL": format!("{base}/v1") });
                let mut env = Vec::new();
                if let Some(key) = key {
                    options["apiKey"] = json!("{env:SLOTSTREAM_API_KEY}");
                    env.push(("SLOTSTREAM_API_KEY", key.to_string()));
                }
                let mut entry = json!({ "name": model });
                if let Some(context) = server.context {
                    let output = OPENCODE_OUTPUT_TOKENS.min(context / 2);
                    entry["limit"] = json!({ "context": context, "output": output });
                }
                let config = json!({
                    "$schema": "https://opencode.ai/config.json",
                    "provider": { "slotstream": {
                        "npm": "@ai-sdk/openai-compatible",
                        "name": "slotstream",
                        "options": options,
                        "models": { model.as_str(): entry },
                    } },
                    "model": format!("slotstream/{model}"),
                });
                // One file per port: every run on it writes the same text, so runs at
                // once do not disturb each other.
                let path = super::cache_dir()
                    .join("launch")
                    .join(format!("opencode-{}.json", server.port));
                env.push(("OPENCODE_CONFIG", path.display().to_string()));
                let text = serde_json::to_string_pretty(&config).expect("JSON values serialize");
                Setup {
                    env,
                    args: Vec::new(),
                    files: vec![(path, text + "\n")],
                }
            }
        }
    }

    /// The tool's executable: on PATH, or (Claude Code) its local install.
    fn find(self) -> Option<PathBuf> {
        let on_path = std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join(self.program()))
                .find(|p| is_executable(p))
        });
        // Claude Code's `claude migrate-installer` puts it here, often not on PATH.
        let local = || {
            let home = PathBuf::from(std::env::var_os("HOME")?);
            Some(home.join(".claude/local/claude")).filter(|p| is_executable(p))
        };
        on_path.or_else(|| (self == Tool::Claude).then(local).flatten())
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `s` as a TOML basic string: JSON's string escapes are TOML's (serde_json writes
/// control characters as `\u00XX` and never `\/`).
fn toml_string(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialize")
}

/// What a tool run gets: environment variables, arguments before the user's, and files
/// written for it (path, text).
struct Setup {
    env: Vec<(&'static str, String)>,
    args: Vec<String>,
    files: Vec<(PathBuf, String)>,
}

/// The server a tool is pointed at.
struct Served {
    port: u16,
    /// The model's name (the first of `/v1/models`).
    model: String,
    /// Tokens a sequence may hold (`context_window` of `/v1/models`), when known.
    context: Option<usize>,
}

/// Where a server that `launch` started on a port keeps its log and its process id.
struct ServerFiles {
    port: u16,
    log: PathBuf,
    pid: PathBuf,
}

impl ServerFiles {
    fn new(port: u16) -> Self {
        let dir = super::cache_dir().join("logs");
        ServerFiles {
            port,
            log: dir.join(format!("serve-{port}.log")),
            pid: dir.join(format!("serve-{port}.pid")),
        }
    }
}

pub fn launch(args: LaunchArgs) -> Result<()> {
    let program = args.tool.find();
    if program.is_none() && !args.dry_run {
        bail!("{}", args.tool.not_found());
    }
    let key = args.api_key.as_deref();
    if key.is_some_and(|k| k.trim().is_empty()) {
        bail!("the API key (--api-key or SLOTSTREAM_API_KEY) is empty");
    }
    let probe = Probe::new()?;
    let files = ServerFiles::new(args.port);
    let mut out = String::new();
    let served = if listening(args.port) {
        probe.wait_ready(args.port, None, &files.log)?;
        let served = probe.identify(args.port, key)?;
        out += &format!(
            "# slotstream serve on port {} serves {}\n",
            args.port, served.model
        );
        if let Some(dir) = &args.model {
            if model_name(dir) != served.model {
                eprintln!(
                    "note: the server on port {} serves {}; --model {} is not loaded (`slotstream stop --port {}` first to serve it)",
                    args.port,
                    served.model,
                    dir.display(),
                    args.port
                );
            }
        }
        served
    } else if args.no_start {
        bail!("no server on port {} (--no-start)", args.port);
    } else {
        let Some(dir) = &args.model else {
            bail!(
                "no slotstream server on port {}: give --model DIR to start one",
                args.port
            );
        };
        let command = serve_command(&args, dir)?;
        if args.dry_run {
            out += &format!(
                "# no server on port {}: this starts, in the background (log {}):\n{}\n",
                args.port,
                files.log.display(),
                shown(&command)
            );
            // What the server will say: its name for the directory, and its context
            // capped at the model's (the engine's rule, `context::limit`).
            let config = slotstream::config::ModelConfig::load(dir)
                .with_context(|| format!("reading {}", dir.display()))?;
            Served {
                port: args.port,
                model: model_name(dir),
                context: Some(slotstream::context::limit(args.context, &config)),
            }
        } else {
            let mut child = start(command, &files)?;
            probe.wait_ready(args.port, Some(&mut child), &files.log)?;
            probe.identify(args.port, key)?
        }
    };
    let setup = args.tool.setup(&served, key);
    let mut tool = Command::new(program.as_deref().unwrap_or(Path::new(args.tool.program())));
    tool.args(&setup.args).args(&args.args);
    for (name, value) in &setup.env {
        tool.env(name, value);
    }
    if args.dry_run {
        if program.is_none() {
            out += &format!("# {}\n", args.tool.not_found());
        }
        out += "# environment:\n";
        for (name, value) in &setup.env {
            out += &format!("{name}={}\n", shown_word(value));
        }
        for (path, text) in &setup.files {
            out += &format!("# {}:\n{text}", path.display());
        }
        out += "# command:\n";
        out += &format!("{}\n", shown(&tool));
        print!("{out}");
        return Ok(());
    }
    for (path, text) in &setup.files {
        write_file(path, text)?;
    }
    // Only returns on failure; the tool's exit status is this process's from here on.
    let error = std::os::unix::process::CommandExt::exec(&mut tool);
    Err(error).with_context(|| format!("running {}", shown(&tool)))
}

/// `slotstream serve` of this binary as `launch` starts it.
fn serve_command(args: &LaunchArgs, dir: &Path) -> Result<Command> {
    let exe = std::env::current_exe().context("finding the slotstream executable")?;
    let mut command = Command::new(exe);
    command
        .arg("serve")
        .arg("--model")
        .arg(dir)
        .args(["--port", &args.port.to_string()])
        .args(["--idle-exit", &args.idle_exit.to_string()])
        .args(["--context", &args.context.to_string()])
        .args(&args.serve_arg);
    // Through the environment, not argv, where other users' `ps` would show it.
    if let Some(key) = &args.api_key {
        command.env("SLOTSTREAM_API_KEY", key);
    }
    Ok(command)
}

/// Starts `command` detached: no input, output to the log, its own process group (the
/// terminal's Ctrl-C goes to the tool, not to it), its process id in the pid file.
fn start(mut command: Command, files: &ServerFiles) -> Result<Child> {
    use std::os::unix::process::CommandExt;
    let dir = files.log.parent().expect("the log is in a directory");
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let log = std::fs::File::create(&files.log)
        .with_context(|| format!("creating {}", files.log.display()))?;
    let child = command
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {}", shown(&command)))?;
    write_file(&files.pid, &format!("{}\n", child.id()))?;
    eprintln!(
        "started slotstream serve on port {} (pid {}, log {})",
        files.port,
        child.id(),
        files.log.display()
    );
    Ok(child)
}

/// Writes `text` to `path` whole or not at all, creating its directory.
fn write_file(path: &Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let file = slotstream::atomic_file::AtomicFile::create(path)?;
    file.file()
        .write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    file.commit()?;
    Ok(())
}

/// A command line as a shell would take it.
fn shown(command: &Command) -> String {
    std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|a| shown_word(&a.to_string_lossy()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One word quoted for a POSIX shell where it needs it.
fn shown_word(word: &str) -> String {
    // A NUL cannot be in an argument or a variable; show it rather than fail.
    shlex::try_quote(word).map_or_else(|_| format!("{word:?}"), |q| q.into_owned())
}

/// Whether something accepts connections on the port of this machine.
fn listening(port: u16) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        PROBE_TIMEOUT,
    )
    .is_ok()
}

/// HTTP requests to a server on this machine.
struct Probe {
    runtime: tokio::runtime::Runtime,
}

impl Probe {
    fn new() -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the runtime")?;
        Ok(Probe { runtime })
    }

    /// `GET path` on the port with the key as a bearer token: the status and the body.
    /// Errors: no connection, or no answer within [`PROBE_TIMEOUT`].
    fn get(&self, port: u16, path: &str, key: Option<&str>) -> Result<(u16, Vec<u8>)> {
        use http_body_util::{BodyExt, Empty};
        use hyper::header::{AUTHORIZATION, HOST};
        let request = async {
            let stream = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await?;
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
            tokio::spawn(connection);
            let mut request = hyper::Request::get(path).header(HOST, format!("127.0.0.1:{port}"));
            if let Some(key) = key {
                request = request.header(AUTHORIZATION, format!("Bearer {key}"));
            }
            let response = sender
                .send_request(request.body(Empty::<hyper::body::Bytes>::new())?)
                .await?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, body.to_vec()))
        };
        // The timer is made inside the runtime, whose clock it needs.
        self.runtime
            .block_on(async { tokio::time::timeout(PROBE_TIMEOUT, request).await })
            .map_err(|_| anyhow!("no answer within {PROBE_TIMEOUT:?}"))?
            .with_context(|| format!("GET http://127.0.0.1:{port}{path}"))
    }

    /// Waits, with a spinner, until the server on the port answers `/health` with 200.
    /// Errors: `child` (the server this run started) exits first (with the end of its
    /// log), nothing listens on the port any more, or [`START_TIMEOUT`] passes.
    fn wait_ready(&self, port: u16, mut child: Option<&mut Child>, log: &Path) -> Result<()> {
        let spinner = indicatif::ProgressBar::new_spinner().with_message(format!(
            "waiting for slotstream serve on port {port} to load the model"
        ));
        spinner.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        spinner.enable_steady_tick(Duration::from_millis(100));
        let start = Instant::now();
        let result = loop {
            if let Ok((200, _)) = self.get(port, "/health", None) {
                break Ok(());
            }
            if let Some(child) = child.as_deref_mut() {
                if let Some(status) = child.try_wait()? {
                    break Err(anyhow!(
                        "slotstream serve exited ({status}) before it was ready; the end of its log ({}):\n{}",
                        log.display(),
                        tail(log, LOG_TAIL)
                    ));
                }
            } else if !listening(port) {
                break Err(anyhow!("the server on port {port} went away"));
            }
            if start.elapsed() > START_TIMEOUT {
                break Err(anyhow!(
                    "the server on port {port} did not answer /health within {} s (its log, if launch started it: {})",
                    START_TIMEOUT.as_secs(),
                    log.display()
                ));
            }
            std::thread::sleep(POLL);
        };
        spinner.finish_and_clear();
        result
    }

    /// The model a slotstream server on the port serves. Errors: the port answers as
    /// something else, or wants a key this run does not have.
    fn identify(&self, port: u16, key: Option<&str>) -> Result<Served> {
        let (status, body) = self.get(port, "/v1/models", key)?;
        if status == 401 {
            bail!(
                "the server on port {port} needs an API key: set SLOTSTREAM_API_KEY (or --api-key) to its key"
            );
        }
        let models: Value = serde_json::from_slice(&body).unwrap_or_default();
        let first = &models["data"][0];
        match (status, first["owned_by"].as_str(), first["id"].as_str()) {
            (200, Some("slotstream"), Some(id)) => Ok(Served {
                port,
                model: id.to_string(),
                context: first["context_window"]
                    .as_u64()
                    .and_then(|c| usize::try_from(c).ok()),
            }),
            _ => bail!(
                "port {port} is used by a server that is not slotstream's (GET /v1/models answered {status}); choose another with --port"
            ),
        }
    }
}

/// The last `n` lines of the file at `path` (a note when it cannot be read).
fn tail(path: &Path, n: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        }
        Err(e) => format!("({e})"),
    }
}

pub fn stop(args: StopArgs) -> Result<()> {
    let files = ServerFiles::new(args.port);
    let text = match std::fs::read_to_string(&files.pid) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!(
                "no server started by `slotstream launch` on port {}",
                args.port
            );
            return Ok(());
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", files.pid.display())),
    };
    let pid: libc::pid_t = text.trim().parse().with_context(|| {
        format!(
            "{} does not hold a process id: {text:?}",
            files.pid.display()
        )
    })?;
    // The pid file outlives a server that ended by itself (--idle-exit) or was killed,
    // and its number may since have gone to another process: signal only a `serve` on
    // this port.
    if !is_serve(pid, args.port) {
        remove(&files.pid)?;
        println!(
            "no server started by `slotstream launch` runs on port {} (it had ended; removed {})",
            args.port,
            files.pid.display()
        );
        return Ok(());
    }
    // SAFETY: kill only sends a signal to the process checked above.
    if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(e).with_context(|| format!("signalling slotstream serve (pid {pid})"));
    }
    let start = Instant::now();
    while is_serve(pid, args.port) {
        if start.elapsed() > STOP_TIMEOUT {
            bail!(
                "slotstream serve (pid {pid}) still runs {} s after SIGTERM; its log: {}",
                STOP_TIMEOUT.as_secs(),
                files.log.display()
            );
        }
        std::thread::sleep(POLL);
    }
    remove(&files.pid)?;
    println!("stopped slotstream serve on port {} (pid {pid})", args.port);
    Ok(())
}

fn remove(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Whether process `pid` is a live `slotstream serve` on `port` (as [`serve_command`]
/// starts it). An exited process awaiting its parent (a zombie) has no command line,
/// so it is not.
fn is_serve(pid: libc::pid_t, port: u16) -> bool {
    let Some(args) = command_line(pid) else {
        return false;
    };
    let port = port.to_string();
    let named = args.first().is_some_and(|a| {
        Path::new(a)
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("slotstream"))
    });
    named
        && args.get(1).is_some_and(|a| a == "serve")
        && args.windows(2).any(|w| w[0] == "--port" && w[1] == port)
}

/// The arguments process `pid` was started with; `None` when it is gone.
#[cfg(target_os = "linux")]
fn command_line(pid: libc::pid_t) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    (!args.is_empty()).then_some(args)
}

/// The arguments process `pid` was started with (as `ps` shows them, split at spaces);
/// `None` when it is gone.
#[cfg(not(target_os = "linux"))]
fn command_line(pid: libc::pid_t) -> Option<Vec<String>> {
    let out = Command::new("ps")
        .args(["-o", "args=", "-p", &pid.to_string()])
        .output()
        .ok()?;
    let args: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(String::from)
        .collect();
    (out.status.success() && !args.is_empty()).then_some(args)
}
