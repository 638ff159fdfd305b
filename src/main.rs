//! The `slotstream` command line.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use slotstream::backend::gpu::GpuOptions;
use slotstream::backend::gpu::{list_adapters, Placement};
use slotstream::backend::Backend;
use slotstream::backend::{open_compute, Compute};
use slotstream::chat_template::{chat_prompt, Chat, ChatTemplate, Message};
use slotstream::checkpoint::{Checkpoint, ExpertIndex};
use slotstream::experts::{open_source, OpenedSource, PoolSize, SourceOptions};
use slotstream::generate::GenerateOptions;
use slotstream::io::IoMode;
use slotstream::model::Model;
use slotstream::plan::Plan;
use slotstream::pool::{PoolStats, SlotPool};
use slotstream::prompt_cache::{PromptCache, PromptCacheOptions};
use slotstream::sampling::{SamplingInput, SamplingOptions};
use slotstream::score::Score;
use slotstream::tokenizer::{eos_ids, StreamDecoder, Tokenizer};
use slotstream::tools::cachesim;

#[derive(Parser)]
#[command(
    name = "slotstream",
    version,
    about = "Run Mixture-of-Experts models larger than memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Teacher-forced log-likelihood and perplexity of a token sequence.
    Score(ScoreArgs),
    /// Write every expert record into one aligned file (one read per miss).
    Pack(PackArgs),
    /// Replay a routing trace under CLOCK, LRU and Belady's optimal policy.
    Cachesim(CachesimArgs),
    /// Generate decode steps straight from a synthetic routing model (no forward pass),
    /// replay them under CLOCK, LRU and Belady, and print the calibration figures against
    /// the published summaries of real traces.
    RoutingCalibration(RoutingCalibrationArgs),
    /// List GPU adapters and their limits.
    Devices,
    /// Generate text from a prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Chat in the terminal, keeping the conversation's state between turns.
    Chat(ChatArgs),
    /// Show how a memory budget splits: resident weights, context state, workspaces,
    /// staging and the slots that remain.
    Plan(PlanArgs),
    /// Write a synthetic checkpoint in the exact MLX layout of a preset (random weights).
    Synth(SynthArgs),
    /// Measure prefill and decode speed at several pool sizes, each beside its limit
    /// (copy bandwidth when all experts are resident, raw disk reads when streaming).
    Bench(BenchArgs),
    /// Serve the OpenAI API (chat and text completions, streaming or not) over HTTP.
    Serve(ServeArgs),
    /// The built-in demo: a synthetic model (made on first use) streamed through a pool
    /// that holds a third of its experts.
    Demo(DemoArgs),
}

#[derive(Args)]
struct ChatArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// A system prompt for the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    #[command(flatten)]
    template: TemplateArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Compute device: `cpu`, `gpu` (any GPU adapter), or part of an adapter's name.
    #[arg(long)]
    device: Option<String>,
    #[command(flatten)]
    stream: StreamArgs,
    #[command(flatten)]
    prompt_cache: PromptCacheArgs,
    #[command(flatten)]
    trace: TraceArgs,
}

/// Prompt reuse (`chat`, `serve`, and `generate` with a directory): snapshots of the
/// sequence states at prefix boundaries.
#[derive(Args)]
struct PromptCacheArgs {
    /// Memory for prompt-reuse snapshots: a size (2GiB), a share of --memory-budget
    /// (10%), or 0 (off). Default: 10% of --memory-budget, else 2GiB. With
    /// --memory-budget it is one of the plan's terms.
    #[arg(long)]
    prompt_cache: Option<CacheSize>,
    /// Tokens between snapshots of a long prefill (0: only at the ends of prompts).
    #[arg(long, default_value_t = 1024)]
    prompt_cache_every: usize,
    /// Also write snapshots to this directory (created if missing), to reuse them after a
    /// restart.
    #[arg(long)]
    prompt_cache_dir: Option<PathBuf>,
    /// Most bytes the snapshot files in --prompt-cache-dir may take (every model's); the
    /// least recently used go first.
    #[arg(long, default_value = "16GiB", value_parser = slotstream::plan::parse_size)]
    prompt_cache_disk: u64,
}

impl Default for PromptCacheArgs {
    /// As the flags' defaults.
    fn default() -> Self {
        let o = PromptCacheOptions::default();
        PromptCacheArgs {
            prompt_cache: None,
            prompt_cache_every: o.every,
            prompt_cache_dir: None,
            prompt_cache_disk: o.disk,
        }
    }
}

impl PromptCacheArgs {
    /// The library's options, a share taken of `memory_budget`. Errors: a share without
    /// a budget.
    fn options(&self, memory_budget: Option<u64>) -> Result<PromptCacheOptions> {
        Ok(PromptCacheOptions {
            memory: CacheSize::bytes(self.prompt_cache, memory_budget)?,
            every: self.prompt_cache_every,
            dir: self.prompt_cache_dir.clone(),
            disk: self.prompt_cache_disk,
        })
    }
}

/// `--prompt-cache`: bytes, or a share of the memory budget.
#[derive(Clone, Copy, Debug)]
enum CacheSize {
    Bytes(u64),
    Share(f64),
}

/// The share of a memory budget the prompt cache gets by default.
const DEFAULT_CACHE_SHARE: f64 = 0.10;

impl CacheSize {
    /// Bytes of `size` (by default 10% of the budget, else the library's default) within
    /// `memory_budget`. Errors: a share without a budget.
    fn bytes(size: Option<CacheSize>, memory_budget: Option<u64>) -> Result<u64> {
        let size = size.unwrap_or(match memory_budget {
            Some(_) => CacheSize::Share(DEFAULT_CACHE_SHARE),
            None => CacheSize::Bytes(PromptCacheOptions::default().memory),
        });
        match (size, memory_budget) {
            (CacheSize::Bytes(n), _) => Ok(n),
            (CacheSize::Share(share), Some(budget)) => Ok((share * budget as f64) as u64),
            (CacheSize::Share(_), None) => {
                bail!(
                    "--prompt-cache as a share (%) needs --memory-budget; give a size such as 2GiB"
                )
            }
        }
    }
}

impl std::str::FromStr for CacheSize {
    type Err = String;

    /// `0`, a size (`2GiB`) or a share (`10%`, 0 to 100).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let t = s.trim();
        if t == "0" {
            return Ok(CacheSize::Bytes(0));
        }
        match t.strip_suffix('%') {
            Some(pct) => match pct.trim().parse::<f64>() {
                Ok(p) if (0.0..=100.0).contains(&p) => Ok(CacheSize::Share(p / 100.0)),
                _ => Err(format!("`{s}` is not a share from 0% to 100%")),
            },
            None => slotstream::plan::parse_size(t).map(CacheSize::Bytes),
        }
    }
}

/// Chat template variables (`generate` with the template, `chat`).
#[derive(Args, Clone, Debug, Default)]
struct TemplateArgs {
    /// Thinking models (Qwen3): `on` or `off` sets the template's `enable_thinking`.
    #[arg(long, value_enum)]
    think: Option<OnOff>,
    /// More template variables as a JSON object, e.g. '{"enable_thinking": false}'.
    #[arg(long, value_parser = parse_kwargs)]
    chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

impl TemplateArgs {
    /// The template's variables. Errors: `--think` contradicting the JSON.
    fn kwargs(&self) -> Result<serde_json::Map<String, serde_json::Value>> {
        let mut kwargs = self.chat_template_kwargs.clone().unwrap_or_default();
        if let Some(think) = self.think {
            slotstream::chat_template::set_enable_thinking(&mut kwargs, think == OnOff::On)
                .map_err(|e| anyhow::anyhow!("--think: {e}"))?;
        }
        Ok(kwargs)
    }

    fn is_set(&self) -> bool {
        self.think.is_some() || self.chat_template_kwargs.is_some()
    }
}

fn parse_kwargs(
    s: &str,
) -> std::result::Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(s) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err("must be a JSON object, e.g. '{\"enable_thinking\": false}'".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

#[derive(Args)]
struct PlanArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Total memory for the run, e.g. 8GiB.
    #[arg(long, value_parser = slotstream::plan::parse_size)]
    memory_budget: u64,
    /// Context to reserve KV cache for, in tokens.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Reads in flight.
    #[arg(long, default_value_t = 32)]
    queue_depth: usize,
    /// Memory for prompt-reuse snapshots to plan for, as `chat` and `serve` take it
    /// (they default to 10% of the budget). Default 0: `generate` without
    /// --prompt-cache-dir and `score` keep no snapshots.
    #[arg(long)]
    prompt_cache: Option<CacheSize>,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct SynthArgs {
    /// demo, qwen3-next-80b-a3b, qwen3.5-35b-a3b or qwen3.8-flash-next.
    #[arg(long)]
    preset: String,
    /// Keep this many layers (every per-layer shape is kept), for small disks. At least 2
    /// for qwen3.8-flash-next, whose layer 1 holds the PLE block and the n-gram table.
    #[arg(long)]
    layers: Option<usize>,
    /// qwen3.8-flash-next only: about N rows for each of the n-gram table's 16 heads
    /// (`ngram_vocab_size_base`, 1 to 20000000) instead of the released 20000000 (32 GB):
    /// a table of about N x 1.6 KB, for small disks and tests. NOT the released shape.
    #[arg(long)]
    ngram_rows: Option<u64>,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// `synthetic`: write the calibrated routing model (synthetic_routing.json),
    /// which replaces the random router's expert ids with realistic ones; `router`: keep
    /// the checkpoint's random router (routing almost uniform).
    #[arg(long, value_enum, default_value = "synthetic")]
    routing: SynthRouting,
}

/// How a synthetic checkpoint routes (see `slotstream::routing_model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum SynthRouting {
    Synthetic,
    Router,
}

#[derive(Args)]
struct RoutingCalibrationArgs {
    /// The preset whose geometry and default routing model to use.
    #[arg(long, default_value = "qwen3-next-80b-a3b", conflicts_with = "model")]
    preset: String,
    /// A model directory instead of a preset: its config.json's geometry and its
    /// synthetic_routing.json.
    #[arg(long)]
    model: Option<PathBuf>,
    /// A routing model file to use instead of the preset's or model's.
    #[arg(long)]
    params: Option<PathBuf>,
    /// Replace the routing model's seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Decode steps to generate.
    #[arg(long, default_value_t = cachesim::TARGET_STEPS)]
    steps: usize,
    /// Also write the trace (token,layer,expert CSV) here, for `slotstream cachesim`.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchArgs {
    /// Model directory (for example one written by `slotstream synth`).
    #[arg(long)]
    model: PathBuf,
    /// Pool sizes, comma-separated: `floor`, `all` (every record, loaded before timing),
    /// a share of the records (`30%`) or a memory budget (`8GiB`).
    #[arg(long, value_delimiter = ',', default_value = "floor,30%,all")]
    budgets: Vec<slotstream::tools::bench::Budget>,
    /// Tokens to decode per row (the first --warmup are left out of the decode figures).
    #[arg(long, default_value_t = 96)]
    tokens: usize,
    #[arg(long, default_value_t = 32)]
    warmup: usize,
    /// Prompt length in tokens (random ids).
    #[arg(long, default_value_t = 64)]
    prompt_len: usize,
    /// Lookahead settings to run each budget with.
    #[arg(long, value_delimiter = ',', default_value = "on")]
    lookahead: Vec<OnOff>,
    /// Seed of the prompt.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also time the first token with prompt reuse: the prompt cold, again, and with its
    /// last N tokens replaced (a shared prefix), with the tokens each runs.
    #[arg(long, value_name = "N")]
    reuse_tail: Option<usize>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Compute device: `cpu`, `gpu` (any GPU adapter), or part of an adapter's name.
    #[arg(long)]
    device: Option<String>,
    #[command(flatten)]
    io: IoArgs,
}

#[derive(Args)]
struct ServeArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Address to bind (127.0.0.1: this machine only).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer <KEY>` on /v1/... and /stats.
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
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Sampling defaults for requests that do not set their own.
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Compute device: `cpu`, `gpu` (any GPU adapter), or part of an adapter's name.
    #[arg(long)]
    device: Option<String>,
    #[command(flatten)]
    stream: StreamArgs,
}

/// Where a thinking model's reasoning goes in the server's replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ReasoningFormat {
    Auto,
    None,
}

#[derive(Args)]
struct DemoArgs {
    /// Where the demo model lives (default: $XDG_CACHE_HOME/slotstream/demo, else
    /// ~/.cache/slotstream/demo).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 48)]
    max_tokens: usize,
    /// Compute device: `cpu`, `gpu` (any GPU adapter), or part of an adapter's name.
    #[arg(long)]
    device: Option<String>,
    /// Print one JSON object (prompt and output ids, text, timings, the pool's counters)
    /// on stdout instead of the text and the summary.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct GenerateArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Prompt text (the same as --prompt).
    #[arg(value_name = "PROMPT", conflicts_with_all = ["prompt", "prompt_file", "prompt_ids"])]
    text: Option<String>,
    /// Prompt text (wrapped in the model's chat template unless --raw).
    #[arg(long, conflicts_with_all = ["prompt_file", "prompt_ids"])]
    prompt: Option<String>,
    /// Read the prompt text from a file (`-`: standard input).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt_file: Option<PathBuf>,
    /// Prompt as comma-separated token ids (no template).
    #[arg(long)]
    prompt_ids: Option<IdList>,
    /// Use the prompt text as is, without the chat template (special-token texts in it
    /// count as those tokens).
    #[arg(long)]
    raw: bool,
    #[command(flatten)]
    template: TemplateArgs,
    /// Stop after this many new tokens.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print one JSON object (prompt ids, output ids, text, stats) instead of streaming.
    #[arg(long)]
    json: bool,
    /// Compute device: `cpu`, `gpu` (any GPU adapter), or part of an adapter's name.
    #[arg(long)]
    device: Option<String>,
    #[command(flatten)]
    stream: StreamArgs,
    /// Reuse across runs needs --prompt-cache-dir (without it nothing outlives the run).
    #[command(flatten)]
    prompt_cache: PromptCacheArgs,
    #[command(flatten)]
    trace: TraceArgs,
}

/// `--trace` (commands that write the pool's routing trace).
#[derive(Args, Default)]
struct TraceArgs {
    /// Write the pool's routing trace (token,layer,expert,outcome CSV) here.
    #[arg(long)]
    trace: Option<PathBuf>,
}

/// How routed experts are read: through a slot pool sized by `--pool-slots`,
/// `--experts-per-layer` or `--memory-budget`, or (without them) from the memory-mapped
/// checkpoint.
#[derive(Args)]
struct StreamArgs {
    /// Stream experts through a pool of this many slots (records).
    #[arg(long, conflicts_with_all = ["experts_per_layer", "memory_budget"])]
    pool_slots: Option<usize>,
    /// A pool of this many slots per MoE layer (shared by all layers).
    #[arg(long, conflicts_with = "memory_budget")]
    experts_per_layer: Option<usize>,
    /// Plan the run within this much memory (e.g. 8GiB); the pool gets what the other
    /// terms leave (see `slotstream plan`).
    #[arg(long, value_parser = slotstream::plan::parse_size)]
    memory_budget: Option<u64>,
    #[command(flatten)]
    io: IoArgs,
    /// Print statistics on stderr (the pool's as JSON when streaming).
    #[arg(long)]
    stats: bool,
    /// Prefetch the experts that layer L+2's router picks on layer L's hidden state.
    #[arg(long, value_enum, default_value = "on")]
    lookahead: OnOff,
}

/// How expert records are read and where a GPU keeps them (streaming commands and bench).
#[derive(Args)]
struct IoArgs {
    /// The most tokens, prompt and output together, a sequence may hold (generation
    /// stops there; at most the model's max_position_embeddings), and what the memory
    /// plan reserves KV cache for.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Demand reads in flight at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..))]
    queue_depth: u16,
    /// direct (O_DIRECT / F_NOCACHE) or buffered reads.
    #[arg(long, default_value = "direct")]
    io: IoMode,
    /// Read the checkpoint shards even if a valid experts.pack is present.
    #[arg(long)]
    no_pack: bool,
    /// Where a GPU reads the slots: `unified` (host memory imported, read in place) or
    /// `device` (device-local arenas, copied on a miss). Default: unified on integrated
    /// and CPU adapters that support it, device on discrete GPUs.
    #[arg(long)]
    placement: Option<Placement>,
}

impl IoArgs {
    /// The library's options for these flags (no pool, lookahead on).
    fn source(&self) -> SourceOptions {
        SourceOptions {
            context: self.context,
            queue_depth: self.queue_depth as usize,
            io: self.io,
            use_pack: !self.no_pack,
            placement: self.placement,
            ..Default::default()
        }
    }
}

#[derive(Args)]
struct PackArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Output directory (default: the model directory, where the engine looks for it).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct CachesimArgs {
    /// Trace CSV written with --trace.
    #[arg(long)]
    trace: PathBuf,
    /// Pool sizes to simulate, comma-separated (each at least 1).
    #[arg(long, value_delimiter = ',', required = true, value_parser = clap::value_parser!(u64).range(1..))]
    slots: Vec<u64>,
}

#[derive(Args)]
struct ScoreArgs {
    /// Model directory (config.json, safetensors shards, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated token ids, e.g. `1,2,3`.
    #[arg(long, conflicts_with = "text")]
    ids: Option<IdList>,
    /// Text, tokenized with the model's tokenizer.json.
    #[arg(long)]
    text: Option<String>,
    /// Write all logits as a float32 .npy of shape [tokens, vocab].
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Compute device: `cpu`, `gpu` (any GPU adapter), or part of an adapter's name (see `slotstream devices`).
    /// Default: the first GPU, else the CPU (also preferred over a CPU-emulated adapter).
    #[arg(long)]
    device: Option<String>,
    #[command(flatten)]
    stream: StreamArgs,
    #[command(flatten)]
    trace: TraceArgs,
}

/// Sampling flags of `generate`, `chat` and `serve` (mlx-lm's sampler; see `sampling.rs`),
/// read as the server reads a request's fields ([`SamplingInput::apply`]).
#[derive(Args, Clone, Debug, Default)]
struct SamplingArgs {
    /// 0 is greedy (the default).
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Keep the k most probable tokens (0 or less: off, the default; 1: greedy).
    #[arg(long, allow_negative_numbers = true)]
    top_k: Option<i64>,
    /// Nucleus sampling mass (1: off, the default; 0 keeps the most probable token).
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Drop tokens less probable than this fraction of the most probable (0: off, the
    /// default).
    #[arg(long, allow_negative_numbers = true)]
    min_p: Option<f32>,
    /// Penalty on the logits of the last 20 tokens (1: off, the default).
    #[arg(long, allow_negative_numbers = true)]
    repetition_penalty: Option<f32>,
    /// Seed of the sampler's random stream: 0 to 2^64 - 1 (default 0), or -1 for a random
    /// one.
    #[arg(long, allow_negative_numbers = true)]
    seed: Option<i128>,
}

impl SamplingArgs {
    /// The sampling options the flags give. Errors name the flag out of range.
    fn options(&self) -> Result<SamplingOptions> {
        let input = SamplingInput {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
        };
        input
            .apply(&SamplingOptions::default())
            .map_err(|e| match e {
                slotstream::Error::Sampling { field, message } => {
                    anyhow::anyhow!("--{} {message}", field.replace('_', "-"))
                }
                e => e.into(),
            })
    }
}

/// A switch given as `on` or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum OnOff {
    On,
    Off,
}

/// Token ids given on the command line as `1,2,3`.
#[derive(Clone, Debug)]
struct IdList(Vec<u32>);

impl std::str::FromStr for IdList {
    type Err = String;

    /// Parses `1,2,3`, naming the first bad entry.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let ids = s
            .split(',')
            .map(str::trim)
            .enumerate()
            .map(|(i, part)| {
                part.parse::<u32>().map_err(|_| {
                    format!(
                        "entry {} (`{part}`) is not a token id (a non-negative integer)",
                        i + 1
                    )
                })
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(IdList(ids))
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "slotstream=info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Score(args) => score(args),
        Command::Pack(args) => pack(args),
        Command::Cachesim(args) => cachesim(args),
        Command::RoutingCalibration(args) => routing_calibration(args),
        Command::Devices => devices(),
        Command::Generate(args) => generate(args),
        Command::Chat(args) => chat(args),
        Command::Plan(args) => plan(args),
        Command::Synth(args) => synth(args),
        Command::Demo(args) => demo(args),
        Command::Serve(args) => serve(args),
        Command::Bench(args) => bench(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn score(args: ScoreArgs) -> Result<()> {
    let ckpt = Arc::new(Checkpoint::open(&args.model).context("opening the model")?);
    let ids = match (&args.ids, &args.text) {
        (Some(ids), None) => ids.0.clone(),
        (None, Some(text)) => Tokenizer::load(&args.model)?.encode(text)?,
        _ => bail!("give exactly one of --ids or --text"),
    };
    for path in [&args.logits_out, &args.trace.trace].into_iter().flatten() {
        slotstream::atomic_file::check_writable(path)
            .with_context(|| format!("output {}", path.display()))?;
    }
    let s = match open_compute(args.device.as_deref(), &GpuOptions::from_env())? {
        Compute::Cpu(b) => score_on(&b, &ckpt, &ids, &args.stream, &args.trace)?,
        Compute::Gpu(b) => score_on(&*b, &ckpt, &ids, &args.stream, &args.trace)?,
    };
    println!("tokens: {}", s.tokens);
    println!("mean_nll: {:.6}", s.mean_nll);
    println!("perplexity: {:.6}", s.perplexity);
    if let Some(path) = &args.logits_out {
        slotstream::score::write_npy(path, &s.logits, s.tokens, s.vocab)
            .with_context(|| format!("writing {}", path.display()))?;
        println!(
            "logits: {} [{}, {}] float32",
            path.display(),
            s.tokens,
            s.vocab
        );
    }
    Ok(())
}

impl StreamArgs {
    /// The library's options for these flags.
    fn source(&self) -> SourceOptions {
        SourceOptions {
            pool: match (self.pool_slots, self.experts_per_layer, self.memory_budget) {
                (Some(n), _, _) => Some(PoolSize::Slots(n)),
                (_, Some(n), _) => Some(PoolSize::PerLayer(n)),
                (_, _, Some(bytes)) => Some(PoolSize::Budget(bytes)),
                _ => None,
            },
            lookahead: self.lookahead == OnOff::On,
            ..self.io.source()
        }
    }
}

/// A model and the expert source the stream flags ask for (the memory-mapped checkpoint,
/// or a slot pool attached to the backend, tracing if asked), its prompt cache, with the
/// runtime its reads run on. Fields drop in order: the pool before its runtime.
struct Streamed<B: Backend> {
    model: Model<B>,
    source: OpenedSource,
    cache: PromptCache<B>,
    _runtime: tokio::runtime::Runtime,
}

/// Loads as [`Streamed`] says; a memory budget sets `cache.memory` aside for the prompt
/// cache.
fn load_streamed<B: Backend>(
    backend: &B,
    ckpt: &Arc<Checkpoint>,
    a: &StreamArgs,
    trace: &TraceArgs,
    cache: &PromptCacheOptions,
) -> Result<Streamed<B>> {
    let mut model = Model::load(ckpt, backend).context("loading weights")?;
    let mut options = a.source();
    // Generation stops at the context; the memory plan reserves state for it.
    options.context = model.set_context(options.context);
    let runtime = tokio::runtime::Runtime::new().context("starting the I/O runtime")?;
    let index = Arc::new(model.experts.clone());
    options.trace = trace.trace.is_some();
    options.prompt_cache = cache.memory;
    let source = open_source(backend, ckpt, index, &options, runtime.handle().clone())?;
    let cache = PromptCache::open(ckpt, &model, backend, cache).context("the prompt cache")?;
    Ok(Streamed {
        model,
        source,
        cache,
        _runtime: runtime,
    })
}

/// Writes the trace `--trace` asks for, and prints the pool's statistics as JSON when
/// `json` (`--stats`).
fn finish_pool(pool: &Option<Arc<SlotPool>>, trace: &TraceArgs, json: bool) -> Result<()> {
    let Some(pool) = pool else { return Ok(()) };
    if let Some(path) = &trace.trace {
        cachesim::write_trace(path, &pool.take_trace())
            .with_context(|| format!("writing trace {}", path.display()))?;
    }
    if json {
        eprintln!("{}", serde_json::to_string_pretty(&pool.stats())?);
    }
    Ok(())
}

fn score_on<B: Backend>(
    backend: &B,
    ckpt: &Arc<Checkpoint>,
    ids: &[u32],
    a: &StreamArgs,
    trace: &TraceArgs,
) -> Result<Score> {
    let off = PromptCacheOptions {
        memory: 0,
        ..Default::default()
    };
    let m = load_streamed(backend, ckpt, a, trace, &off)?;
    let s = slotstream::score::score(&m.model, backend, &m.source.experts, ids)?;
    finish_pool(&m.source.pool, trace, a.stats)?;
    Ok(s)
}

fn generate(args: GenerateArgs) -> Result<()> {
    let pool_json = args.stream.stats;
    run_generate(args, pool_json)
}

/// `generate` with `args`; with `--stats`, a summary on stderr; the pool's counters as
/// JSON after it when `pool_json`.
fn run_generate(mut args: GenerateArgs, pool_json: bool) -> Result<()> {
    let ckpt = Arc::new(Checkpoint::open(&args.model).context("opening the model")?);
    let tokenizer = Tokenizer::load(&args.model)?;
    let text = match (&args.text, &args.prompt, &args.prompt_file) {
        (Some(t), None, None) | (None, Some(t), None) => Some(t.clone()),
        (None, None, Some(f)) if f.as_os_str() == "-" => {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
                .context("reading the prompt from standard input")?;
            Some(text)
        }
        (None, None, Some(f)) => {
            Some(std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?)
        }
        (None, None, None) => None,
        _ => bail!("give the prompt once: as an argument, --prompt, --prompt-file or --prompt-ids"),
    };
    let template = match (&text, args.raw) {
        (Some(_), false) => ChatTemplate::load(&args.model)?,
        _ => None,
    };
    if args.template.is_set() && template.is_none() {
        bail!("--think and --chat-template-kwargs set chat template variables: they need a prompt text, without --raw, and a model with a chat template");
    }
    let prompt = match (&args.prompt_ids, text) {
        (Some(ids), None) => ids.0.clone(),
        (None, Some(text)) if template.is_some() => {
            let chat = Chat {
                kwargs: args.template.kwargs()?,
                ..Chat::new(vec![Message::new("user", &text)])
            };
            chat_prompt(&tokenizer, template.as_ref(), &chat)?.ids
        }
        (None, Some(text)) => tokenizer.encode(&text)?,
        _ => bail!("give a prompt: as an argument, --prompt, --prompt-file or --prompt-ids"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    // Refused before the weights load; generation stops at this context.
    args.stream.io.context = slotstream::context::limit(args.stream.io.context, &ckpt.config);
    slotstream::context::room(prompt.len(), args.stream.io.context)?;
    if let Some(path) = &args.trace.trace {
        slotstream::atomic_file::check_writable(path)
            .with_context(|| format!("output {}", path.display()))?;
    }
    let options = generate_options(
        &args.model,
        &ckpt,
        &tokenizer,
        args.max_tokens,
        &args.sampling,
    )?;
    match open_compute(args.device.as_deref(), &GpuOptions::from_env())? {
        Compute::Cpu(b) => generate_on(&b, &ckpt, &tokenizer, &prompt, &options, &args, pool_json),
        Compute::Gpu(b) => generate_on(&*b, &ckpt, &tokenizer, &prompt, &options, &args, pool_json),
    }
}

/// Generation options from the flags, with the model's EOS ids. Errors: bad sampling
/// flags, unreadable generation config.
fn generate_options(
    dir: &std::path::Path,
    ckpt: &Checkpoint,
    tokenizer: &Tokenizer,
    max_tokens: usize,
    sampling: &SamplingArgs,
) -> Result<GenerateOptions> {
    Ok(GenerateOptions {
        max_tokens,
        sampling: sampling.options()?,
        eos_ids: eos_ids(
            dir,
            &ckpt.config.eos_token_ids,
            tokenizer,
            ckpt.config.vocab_size,
        )?,
        cancel: None,
    })
}

fn generate_on<B: Backend>(
    backend: &B,
    ckpt: &Arc<Checkpoint>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    options: &GenerateOptions,
    args: &GenerateArgs,
    pool_json: bool,
) -> Result<()> {
    use std::io::Write;
    let mut cache_options = args.prompt_cache.options(args.stream.memory_budget)?;
    if cache_options.dir.is_none() {
        // Nothing outlives the run: no snapshots to take.
        cache_options.memory = 0;
    }
    let Streamed {
        model,
        source,
        mut cache,
        _runtime,
    } = load_streamed(backend, ckpt, &args.stream, &args.trace, &cache_options)?;
    let OpenedSource {
        experts,
        pool,
        plan,
    } = source;
    let mut decoder = StreamDecoder::new();
    let mut text = String::new();
    let mut stdout = std::io::stdout();
    // Ctrl-C stops after the current token; the output so far and the stats still print.
    let interrupted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        // The first Ctrl-C stops at the next token or prompt chunk; a second one ends
        // the process.
        if let Err(e) = ctrlc::set_handler(move || {
            if flag.swap(true, std::sync::atomic::Ordering::SeqCst) {
                std::process::exit(130);
            }
        }) {
            tracing::warn!(error = %e, "Ctrl-C will end the process without stats");
        }
    }
    // The flag also stops a long prompt between its chunks.
    let options = GenerateOptions {
        cancel: Some(interrupted.clone()),
        ..options.clone()
    };
    let generated = cache.generate(&model, backend, &experts, prompt, &options, |id| {
        let piece = decoder.push(tokenizer, id)?;
        if !args.json {
            print!("{piece}");
            let _ = stdout.flush();
        }
        text.push_str(&piece);
        Ok(!interrupted.load(std::sync::atomic::Ordering::SeqCst))
    })?;
    let (ids, stats) = (&generated.output_ids, &generated.stats);
    let tail = decoder.finish(tokenizer)?;
    if !args.json {
        print!("{tail}");
    }
    text.push_str(&tail);
    let pool_stats = pool.as_ref().map(|p| p.stats());
    cache.save(&model, backend);
    if args.json {
        let out = serde_json::json!({
            "prompt_ids": prompt,
            "output_ids": ids,
            "text": text,
            "stats": stats,
            "reused_tokens": generated.reused_tokens,
            "prompt_cache": cache.stats(),
            "pool": pool_stats,
            "plan": plan,
            "peak_rss_bytes": slotstream::plan::peak_rss(),
        });
        println!("{out}");
    } else {
        println!();
    }
    if args.stream.stats {
        eprint!(
            "{}",
            summary(stats, generated.reused_tokens, pool_stats.as_ref())
        );
    }
    finish_pool(&pool, &args.trace, pool_json)
}

/// The run in words, for `--stats` and the demo: prefill and decode rates (with the prompt
/// tokens a snapshot spared, `reused`), peak RSS, and
/// with a pool its hit rate, everything read from the disk split by why it was read, and
/// the share of decode time spent waiting on reads.
fn summary(
    stats: &slotstream::generate::GenerateStats,
    reused: usize,
    pool: Option<&PoolStats>,
) -> String {
    use slotstream::plan::human;
    // With --max-tokens 0 nothing runs, not even the prefill.
    let prefill = if stats.prefill_seconds > 0.0 {
        format!(
            "prefill {} tokens at {:.1} tok/s ({reused} reused)",
            stats.prompt_tokens, stats.prefill_tps
        )
    } else {
        format!("prefill of {} tokens not run", stats.prompt_tokens)
    };
    let mut out = format!(
        "{prefill}, decode {} tokens at {:.1} tok/s ({}), peak RSS {}\n",
        stats.generated_tokens,
        stats.decode_tps,
        stats.finish_reason,
        slotstream::plan::peak_rss().map_or("unknown".into(), human)
    );
    match pool {
        None => {}
        Some(p) if p.hits + p.misses == 0 => {
            out += &format!("pool: no expert lookups ({} slots)\n", p.slots);
        }
        Some(p) => {
            let wait_share = if stats.decode_seconds > 0.0 {
                p.decode_wait_seconds / stats.decode_seconds
            } else {
                0.0
            };
            let parts: Vec<String> = [
                ("misses", p.demand_bytes),
                ("lookahead", p.speculative_bytes),
                ("prefill sweeps", p.sweep_bytes),
                ("admitted after prefill", p.admitted_bytes),
                ("n-gram rows", p.range_bytes),
            ]
            .into_iter()
            .filter(|&(_, bytes)| bytes > 0)
            .map(|(what, bytes)| format!("{} {what}", human(bytes)))
            .collect();
            out += &format!(
                "pool: hit rate {:.3}, {} read from disk ({}), {} prefetches used, {} wasted, {:.0}% of decode time waiting on reads\n",
                p.hit_rate,
                human(p.bytes_read),
                parts.join(", "),
                p.prefetches_used,
                p.prefetches_wasted,
                100.0 * wait_share
            );
        }
    }
    out
}

fn devices() -> Result<()> {
    let adapters = list_adapters();
    if adapters.is_empty() {
        println!("no GPU adapter found (on Linux without a GPU, install Mesa's lavapipe: mesa-vulkan-drivers)");
    }
    for a in adapters {
        println!("{} [{} {}] {}", a.name, a.backend, a.device_type, a.driver);
        println!(
            "  max buffer {} MiB, max storage binding {} MiB, workgroups/dim {}, invocations/workgroup {}, shared memory {} KiB",
            a.max_buffer_size >> 20,
            a.max_storage_buffer_binding_size >> 20,
            a.max_compute_workgroups_per_dimension,
            a.max_compute_invocations_per_workgroup,
            a.max_compute_workgroup_storage_size >> 10
        );
        match a.subgroup_sizes {
            Some((lo, hi)) => println!("  subgroups of {lo} to {hi} invocations"),
            None => println!("  no subgroup operations (reductions in shared memory alone)"),
        }
    }
    Ok(())
}

fn pack(args: PackArgs) -> Result<()> {
    let ckpt = Checkpoint::open(&args.model).context("opening the model")?;
    let index = slotstream::checkpoint::ExpertIndex::build(&ckpt)?;
    let out = args.out.unwrap_or_else(|| args.model.clone());
    let m = slotstream::pack::pack(&ckpt, &index, &out, true)
        .with_context(|| format!("packing into {}", out.display()))?;
    println!(
        "packed {} records of {} bytes ({} layers x {} experts) into {}",
        index.records(),
        m.record_bytes,
        m.moe_layers.len(),
        m.experts,
        out.join(slotstream::pack::PACK_FILE).display()
    );
    Ok(())
}

fn cachesim(args: CachesimArgs) -> Result<()> {
    let requests = cachesim::read_trace(&args.trace)?;
    let lookups: usize = requests.iter().map(|r| r.experts.len()).sum();
    println!("{} lookups in {} requests", lookups, requests.len());
    print!("{:>8}", "slots");
    for p in cachesim::Policy::ALL {
        print!(" {:>8}", p.name());
    }
    println!();
    for &slots in &args.slots {
        let slots = usize::try_from(slots).unwrap_or(usize::MAX);
        print!("{slots:>8}");
        for p in cachesim::Policy::ALL {
            print!(
                " {:>8.4}",
                cachesim::simulate(&requests, slots, p).hit_rate()
            );
        }
        println!();
    }
    Ok(())
}

fn routing_calibration(args: RoutingCalibrationArgs) -> Result<()> {
    use cachesim::{Figures, TARGETS};
    use slotstream::routing_model::{RoutingModel, RoutingParams, ROUTING_FILE};
    // Geometry from the model or preset; the routing model from --params, else the model
    // directory's file, else the calibrated defaults.
    let (layers, moe_layers, experts, top_k, own_file) = match &args.model {
        Some(dir) => {
            let cfg = slotstream::config::ModelConfig::load(dir)?;
            let file = dir.join(ROUTING_FILE);
            (
                cfg.num_hidden_layers,
                cfg.moe_layers(),
                cfg.num_experts,
                cfg.num_experts_per_tok,
                Some(file),
            )
        }
        None => {
            let p = slotstream::tools::synth::preset(&args.preset)?;
            (p.layers, (0..p.layers).collect(), p.experts, p.top_k, None)
        }
    };
    let mut params = match args.params.as_ref().or(own_file.as_ref()) {
        Some(path) => RoutingParams::load(path)?,
        None => RoutingParams::calibrated(),
    };
    if let Some(seed) = args.seed {
        params.seed = seed;
    }
    if args.steps == 0 || moe_layers.is_empty() {
        bail!("nothing to trace: --steps must be at least 1 and the model needs MoE layers");
    }
    let model = RoutingModel::new(params, layers, experts, top_k)?;
    let trace = model.trace(&moe_layers, args.steps)?;
    if let Some(path) = &args.trace {
        cachesim::write_requests(path, &trace)
            .with_context(|| format!("writing trace {}", path.display()))?;
    }
    let got = Figures::measure(&trace, moe_layers.len(), experts);
    let [clock, lru, belady] = Figures::pools(moe_layers.len(), experts);
    // The published targets are for 48 x 512, top-10, 220 steps; other runs have none.
    let at_target = moe_layers.len() == 48
        && experts == 512
        && top_k == 10
        && args.steps == cachesim::TARGET_STEPS;
    if args.json {
        let out = serde_json::json!({
            "params": model.params, "layers": moe_layers.len(), "experts": experts, "top_k": top_k,
            "steps": args.steps, "pools": {"clock": clock, "lru": lru, "belady": belady},
            "figures": got, "targets": at_target.then_some(TARGETS),
        });
        println!("{out}");
        return Ok(());
    }
    println!(
        "{} MoE layers x {experts} experts, top-{top_k}, {} steps, {} active experts a layer, seed {}",
        moe_layers.len(),
        args.steps,
        model.active_experts(),
        model.params.seed
    );
    let target = |v: f64| {
        if at_target {
            format!("{v:.3}")
        } else {
            "-".into()
        }
    };
    println!("{:<36} {:>10} {:>10}", "figure", "synthetic", "target");
    println!(
        "{:<36} {:>10} {:>10}",
        format!("records touched (of {})", got.records),
        got.touched,
        if at_target {
            TARGETS.touched.to_string()
        } else {
            "-".into()
        }
    );
    println!(
        "{:<36} {:>10.3} {:>10}",
        "touched share",
        got.touched_share(),
        target(TARGETS.touched_share())
    );
    println!(
        "{:<36} {:>10.3} {:>10}",
        "lookups served by the top 10%",
        got.top_decile_share,
        target(TARGETS.top_decile_share)
    );
    println!(
        "{:<36} {:>10.3} {:>10}",
        format!("CLOCK hit rate, {clock} slots"),
        got.clock,
        target(TARGETS.clock)
    );
    println!(
        "{:<36} {:>10.3} {:>10}",
        format!("LRU hit rate, {lru} slots"),
        got.lru,
        target(TARGETS.lru)
    );
    println!(
        "{:<36} {:>10.3} {:>10}",
        format!("Belady hit rate, {belady} slots"),
        got.belady,
        target(TARGETS.belady)
    );
    Ok(())
}

fn synth(args: SynthArgs) -> Result<()> {
    use slotstream::routing_model::RoutingParams;
    let mut preset = slotstream::tools::synth::preset(&args.preset)?;
    let layers = args.layers.unwrap_or(preset.layers);
    if layers < preset.min_layers() {
        bail!(
            "--layers must be at least {} for {}",
            preset.min_layers(),
            preset.name
        );
    }
    if let Some(rows) = args.ngram_rows {
        preset = preset
            .with_ngram_rows(rows)
            .map_err(|e| anyhow::anyhow!("--ngram-rows {rows}: {e}"))?;
    }
    let routing = (args.routing == SynthRouting::Synthetic).then(RoutingParams::calibrated);
    slotstream::tools::synth::write_checkpoint_with(
        &args.out,
        &preset,
        layers,
        true,
        routing.as_ref(),
    )
    .with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "wrote {} ({} layers, {:.2} GB) to {}",
        preset.name,
        layers,
        preset.checkpoint_bytes(layers) as f64 / 1e9,
        args.out.display()
    );
    Ok(())
}

fn demo(args: DemoArgs) -> Result<()> {
    let dir = match args.dir {
        Some(d) => d,
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(std::env::temp_dir)
            .join("slotstream/demo"),
    };
    let preset = slotstream::tools::synth::DEMO;
    if !dir.join("model.safetensors.index.json").exists() {
        eprintln!(
            "creating the demo model in {} (first run only, 240 MB)",
            dir.display()
        );
        slotstream::tools::synth::write_checkpoint(&dir, &preset, preset.layers, true)
            .with_context(|| format!("writing the demo model to {}", dir.display()))?;
    } else if slotstream::tools::synth::refresh_tokenizer(&dir, &preset)
        .with_context(|| format!("updating the demo model in {}", dir.display()))?
    {
        eprintln!(
            "updated the tokenizer of the demo model in {} (made by an older slotstream)",
            dir.display()
        );
    }
    let cfg = slotstream::config::ModelConfig::load(&dir)?;
    let (layers, experts) = (cfg.moe_layers().len(), cfg.num_experts);
    let records = layers * experts;
    let slots = (records / 3).max(slotstream::pool::floor_slots(
        experts,
        slotstream::pool::DEFAULT_SPECULATIVE_CAP,
    ));
    eprintln!(
        "demo: {layers} layers x {experts} experts = {records} records; pool of {slots} slots; weights are random, so the text is noise"
    );
    let args = GenerateArgs {
        model: dir,
        text: None,
        prompt: Some("Explain how experts are streamed from disk.".into()),
        prompt_file: None,
        prompt_ids: None,
        raw: false,
        template: TemplateArgs::default(),
        max_tokens: args.max_tokens,
        sampling: SamplingArgs::default(),
        json: args.json,
        device: args.device,
        prompt_cache: PromptCacheArgs::default(),
        stream: StreamArgs {
            pool_slots: Some(slots),
            experts_per_layer: None,
            memory_budget: None,
            io: IoArgs {
                context: 4096,
                queue_depth: 32,
                io: IoMode::Direct,
                no_pack: false,
                placement: None,
            },
            stats: !args.json,
            lookahead: OnOff::On,
        },
        trace: TraceArgs::default(),
    };
    // The summary alone: the pool's counters as JSON come with --json.
    run_generate(args, false)
}

fn chat(args: ChatArgs) -> Result<()> {
    let ckpt = Arc::new(Checkpoint::open(&args.model).context("opening the model")?);
    let tokenizer = Tokenizer::load(&args.model)?;
    let template = ChatTemplate::load(&args.model)?
        .with_context(|| format!("{} has no chat template", args.model.display()))?;
    let options = generate_options(
        &args.model,
        &ckpt,
        &tokenizer,
        args.max_tokens,
        &args.sampling,
    )?;
    match open_compute(args.device.as_deref(), &GpuOptions::from_env())? {
        Compute::Cpu(b) => chat_on(&b, &ckpt, &tokenizer, &template, &options, &args),
        Compute::Gpu(b) => chat_on(&*b, &ckpt, &tokenizer, &template, &options, &args),
    }
}

fn chat_on<B: Backend>(
    backend: &B,
    ckpt: &Arc<Checkpoint>,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    options: &GenerateOptions,
    args: &ChatArgs,
) -> Result<()> {
    use slotstream::chat::{read_input, ChatInput};
    use std::io::Write;
    let cache_options = args.prompt_cache.options(args.stream.memory_budget)?;
    let Streamed {
        model,
        source,
        cache,
        _runtime,
    } = load_streamed(backend, ckpt, &args.stream, &args.trace, &cache_options)?;
    let OpenedSource { experts, pool, .. } = source;
    let mut start = Chat {
        kwargs: args.template.kwargs()?,
        ..Chat::default()
    };
    if let Some(system) = &args.system {
        start.messages.push(Message::new("system", system));
    }
    let mut conversation = slotstream::chat::Conversation::new(start, cache);
    let mut stdin = std::io::stdin().lock();
    let mut stdout = std::io::stdout();
    eprintln!(
        "type a message (\"\"\" starts and ends one of several lines); /reset forgets the conversation, /exit or end of input ends it"
    );
    while let Some(input) = read_input(&mut stdin, |more| {
        eprint!("{}", if more { "... " } else { "> " });
    })? {
        let text = match input {
            ChatInput::Exit => break,
            ChatInput::Reset => {
                conversation.reset();
                eprintln!("(conversation reset)");
                continue;
            }
            ChatInput::Message(text) => text,
        };
        let turn = conversation.turn(
            &model,
            backend,
            &experts,
            tokenizer,
            template,
            &text,
            options,
            |t| {
                print!("{t}");
                let _ = stdout.flush();
            },
        );
        println!();
        let turn = match turn {
            Ok(turn) => turn,
            // The conversation is kept as it was before the message; the next turn goes on.
            Err(e) => {
                eprintln!("error: {e}");
                continue;
            }
        };
        if args.stream.stats {
            eprintln!(
                "[{} new prompt tokens, {} reused; {} tokens at {:.1} tok/s]",
                turn.prompt_tokens,
                turn.reused_tokens,
                turn.stats.generated_tokens,
                turn.stats.decode_tps
            );
        }
    }
    if args.stream.stats {
        eprintln!(
            "prompt cache: {}",
            serde_json::to_string(&conversation.cache.stats())?
        );
    }
    finish_pool(&pool, &args.trace, args.stream.stats)
}

fn serve(args: ServeArgs) -> Result<()> {
    use slotstream::engine::{Engine, EngineOptions};
    use slotstream::server::{router, ServerOptions};
    let sampling = args.sampling.options()?;
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        bail!("the API key (--api-key or SLOTSTREAM_API_KEY) is empty");
    }
    let model_id = match &args.model_name {
        Some(n) => n.clone(),
        // A missing or unreadable directory is reported by the loader below.
        None => std::fs::canonicalize(&args.model)
            .unwrap_or_else(|_| args.model.clone())
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned()),
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the runtime")?;
    runtime.block_on(async {
        // The port first: a busy one fails now, not after loading the model. Connections
        // made while the model loads wait in the backlog.
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
        let options = EngineOptions {
            device: args.device.clone(),
            gpu: GpuOptions::from_env(),
            source: args.stream.source(),
            prompt_cache: args.prompt_cache.options(args.stream.memory_budget)?,
        };
        let engine = Engine::load(&args.model, options)
            .await
            .with_context(|| format!("loading model {}", args.model.display()))?;
        eprintln!("serving {model_id} on http://{address}/v1 (Ctrl-C stops)");
        let app = router(
            engine.clone(),
            ServerOptions {
                model_id,
                aliases: args.alias.clone(),
                queue: args.queue as usize,
                api_key: args.api_key.clone(),
                default_max_tokens: args.max_tokens,
                sampling,
                reasoning: args.reasoning_format == ReasoningFormat::Auto,
            },
        );
        slotstream::server::serve(listener, app)
            .await
            .context("serving")?;
        if args.stream.stats {
            eprintln!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({
                    "engine": engine.stats(),
                    "pool": engine.pool_stats(),
                }))?
            );
        }
        Ok(())
    })
}

fn bench(args: BenchArgs) -> Result<()> {
    use slotstream::tools::bench::BenchOptions;
    let ckpt = Arc::new(Checkpoint::open(&args.model).context("opening the model")?);
    let options = BenchOptions {
        budgets: args.budgets.clone(),
        lookahead: args.lookahead.iter().map(|l| *l == OnOff::On).collect(),
        prompt_len: args.prompt_len,
        tokens: args.tokens,
        warmup: args.warmup,
        source: args.io.source(),
        seed: args.seed,
        reuse_tail: args.reuse_tail,
    };
    if args.prompt_len == 0 {
        bail!("--prompt-len must be at least 1");
    }
    let runtime = tokio::runtime::Runtime::new().context("starting the I/O runtime")?;
    let steps = (options.budgets.len() * options.lookahead.len()) as u64 + 2;
    let bar = indicatif::ProgressBar::new(steps).with_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("template"),
    );
    let progress = |what: &str| {
        bar.set_message(what.to_string());
        bar.inc(1);
    };
    let report = match open_compute(args.device.as_deref(), &GpuOptions::from_env())? {
        Compute::Cpu(b) => slotstream::tools::bench::run(&b, &ckpt, &options, &runtime, progress)?,
        Compute::Gpu(b) => slotstream::tools::bench::run(&*b, &ckpt, &options, &runtime, progress)?,
    };
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

fn plan(args: PlanArgs) -> Result<()> {
    let ckpt = Checkpoint::open(&args.model).context("opening the model")?;
    let index = ExpertIndex::build(&ckpt)?;
    let plan = Plan::new(
        &ckpt,
        &index,
        args.memory_budget,
        args.context,
        args.queue_depth,
        slotstream::plan::PREFILL_CHUNK,
        CacheSize::bytes(
            Some(args.prompt_cache.unwrap_or(CacheSize::Bytes(0))),
            Some(args.memory_budget),
        )?,
    )?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", plan.table());
    }
    Ok(())
}
