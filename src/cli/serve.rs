//! `slotstream serve`: the HTTP API (OpenAI, Anthropic Messages, Ollama).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;

use super::flags::{Minutes, PrefillArgs, PromptCacheArgs, SamplingArgs, StreamArgs};
use super::load::engine_options;

/// The port `serve` and `launch` use unless told (Ollama's, which its clients expect).
pub const DEFAULT_PORT: u16 = 11434;

#[derive(Args)]
pub struct ServeArgs {
    /// Model directory (an MLX checkpoint), or ORG/NAME downloaded by `slotstream pull`.
    #[arg(short, long, value_parser = super::pull::model_path)]
    model: PathBuf,
    /// Address to bind (127.0.0.1: this machine only).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on: Ollama's, so its clients find the server with no setting (0: any
    /// free port, printed at start).
    #[arg(long, default_value_t = DEFAULT_PORT)]
    port: u16,
    /// Require `Authorization: Bearer <KEY>` (or `x-api-key: <KEY>`) on the model's
    /// routes and /stats.
    #[arg(long, env = "SLOTSTREAM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Name of the model in /v1/models (default: the directory's name). Requests may
    /// name any model: this server serves the one it loaded, as llama.cpp's does.
    #[arg(long)]
    model_name: Option<String>,
    /// Another name to list in /v1/models (repeatable).
    #[arg(long)]
    alias: Vec<String>,
    /// `auto`: a thinking model's `<think>...</think>` comes back as `reasoning_content`
    /// (streamed as `delta.reasoning_content`), as llama.cpp and vLLM return it; `none`:
    /// it stays in `content`.
    #[arg(long, value_enum, default_value = "auto")]
    reasoning_format: ReasoningFormat,
    /// Requests running or waiting at once; more get 503 with Retry-After.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    queue: u32,
    #[command(flatten)]
    prompt_cache: PromptCacheArgs,
    /// New tokens when a request does not give max_tokens.
    #[arg(short = 'n', long, visible_alias = "n-predict", default_value_t = 512, value_parser = super::flags::at_least(1))]
    max_tokens: usize,
    /// Sampling defaults for requests that do not set their own.
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Compute device: `cpu`, `gpu` (any GPU adapter), or part of an adapter's name.
    #[arg(long)]
    device: Option<String>,
    #[command(flatten)]
    stream: StreamArgs,
    #[command(flatten)]
    prefill: PrefillArgs,
    /// Exit, as on Ctrl-C, after this many minutes without a request (fractions allowed;
    /// 0: never). A request counts until its response has been sent.
    #[arg(long, default_value = "0")]
    idle_exit: Minutes,
}

/// Where a thinking model's reasoning goes in the server's replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ReasoningFormat {
    Auto,
    None,
}

pub fn serve(args: ServeArgs) -> Result<()> {
    use slotstream::engine::Engine;
    use slotstream::server::idle::Idle;
    use slotstream::server::{loading_router, serve_until, ServerOptions};
    let sampling = args.sampling.options()?;
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        bail!("the API key (--api-key or SLOTSTREAM_API_KEY) is empty");
    }
    let model_id = match &args.model_name {
        Some(n) => n.clone(),
        None => model_name(&args.model),
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the runtime")?;
    let (engine, served) = runtime.block_on(async {
        // The port first: a busy one fails now, not after loading the model. While the
        // model loads, /health answers 503 `loading` and the model's routes 503.
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| {
                format!(
                    "binding {}:{} (another server may be using the port: choose another with --port, or --port 0 for any free one)",
                    args.host, args.port
                )
            })?;
        let address = listener.local_addr()?;
        tracing::info!(%address, "listening; loading the model");
        let (app, loading) = loading_router(ServerOptions {
            model_id: model_id.clone(),
            aliases: args.alias.clone(),
            queue: args.queue as usize,
            api_key: args.api_key.clone(),
            default_max_tokens: args.max_tokens,
            sampling,
            reasoning: args.reasoning_format == ReasoningFormat::Auto,
            max_prefill_wait: args.prefill.max_prefill_wait,
        });
        let idle = Idle::new();
        let app = idle.track(app);
        // Loading counts as activity: a load slower than --idle-exit is not idle time.
        let loading_model = idle.begin();
        let idle_after = args.idle_exit.duration();
        let idle_minutes = args.idle_exit.to_string();
        let idle_exit = async move {
            match idle_after {
                Some(after) => {
                    idle.elapsed(after).await;
                    tracing::info!("no request for {idle_minutes} minutes (--idle-exit)");
                }
                None => std::future::pending().await,
            }
        };
        let mut serving = tokio::spawn(serve_until(listener, app, Default::default(), idle_exit));
        let options = engine_options(
            args.device.clone(),
            &args.stream,
            false,
            |budget| {
                Ok((
                    args.prompt_cache.options(budget)?,
                    args.prompt_cache.share(budget)?,
                ))
            },
        )?;
        let engine = tokio::select! {
            loaded = Engine::load(&args.model, options) => loaded.context("loading the model")?,
            // Ctrl-C, SIGTERM or --idle-exit while loading: the server has stopped.
            served = &mut serving => {
                served.context("serving")?.context("serving")?;
                return anyhow::Ok((None, Ok(())));
            }
        };
        loading.loaded(engine.clone());
        drop(loading_model);
        eprintln!(
            "serving {model_id} on http://{address} (OpenAI: /v1, Anthropic: /v1/messages, Ollama: /api; Ctrl-C stops)"
        );
        let served = serving
            .await
            .context("serving")
            .and_then(|r| r.context("serving"));
        if served.is_ok() && args.stream.stats {
            eprintln!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({
                    "engine": engine.stats(),
                    "pool": engine.pool_stats(),
                }))?
            );
        }
        anyhow::Ok((Some(engine), served))
    })?;
    // The runtime's threads end (and the requests still open with them) before the engine's
    // device is destroyed (see `Engine`).
    drop(runtime);
    drop(engine);
    served
}

/// The name a model directory is served under without `--model-name`: the directory's
/// own name (`.` resolved). A missing or unreadable directory is left for the loader to
/// report.
pub fn model_name(dir: &Path) -> String {
    std::fs::canonicalize(dir)
        .unwrap_or_else(|_| dir.to_path_buf())
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned())
}
