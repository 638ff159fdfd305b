//! Flag groups that several subcommands share (flattened into their arguments), and
//! the values they parse.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;

use slotstream::backend::gpu::Placement;
use slotstream::experts::{PoolSize, SourceOptions};
use slotstream::io::IoMode;
use slotstream::machine::MachineMemory;
use slotstream::plan::{Bound, CacheTerm, Target, DEFAULT_MAX_RAM_PERCENT};
use slotstream::prompt_cache::PromptCacheOptions;
use slotstream::sampling::{SamplingInput, SamplingOptions};

/// Prompt reuse (`chat`, `serve`, and `generate` with a directory): snapshots of the
/// sequence states at prefix boundaries.
#[derive(Args)]
pub struct PromptCacheArgs {
    /// Memory for prompt-reuse snapshots: a size (2GiB), a share of the memory budget
    /// (10%), or 0 (off). Default: 10% of the memory budget (--memory-budget, or the one
    /// planned from the machine); 2GiB with --pool-slots or --experts-per-layer. It is
    /// one of the plan's terms.
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
    pub fn options(&self, memory_budget: Option<u64>) -> Result<PromptCacheOptions> {
        Ok(PromptCacheOptions {
            memory: CacheSize::bytes(self.prompt_cache, memory_budget)?,
            every: self.prompt_cache_every,
            dir: self.prompt_cache_dir.clone(),
            disk: self.prompt_cache_disk,
        })
    }

    /// The share of `memory_budget` the snapshots take (`--prompt-cache 10%`, or the
    /// default with a budget), for the memory plan; `None` for a size. Errors: a share
    /// without a budget.
    pub fn share(&self, memory_budget: Option<u64>) -> Result<Option<f64>> {
        Ok(CacheSize::term(self.prompt_cache, memory_budget)?.share())
    }
}

/// `--prompt-cache`: bytes, or a share of the memory budget.
#[derive(Clone, Copy, Debug)]
pub enum CacheSize {
    Bytes(u64),
    Share(f64),
}

/// The share of a memory budget the prompt cache gets by default.
const DEFAULT_CACHE_SHARE: f64 = 0.10;

impl CacheSize {
    /// Bytes of `size` (by default 10% of the budget, else the library's default) within
    /// `memory_budget`. Errors: a share without a budget.
    pub fn bytes(size: Option<CacheSize>, memory_budget: Option<u64>) -> Result<u64> {
        Ok(CacheSize::term(size, memory_budget)?.bytes(memory_budget.unwrap_or(0)))
    }

    /// `size` (by default 10% of the budget, else the library's default) as the memory
    /// plan's term: a share of the budget stays a share, so that a refused plan advises
    /// a budget whose share leaves the pool its floor. Errors: a share without a budget.
    pub fn term(size: Option<CacheSize>, memory_budget: Option<u64>) -> Result<CacheTerm> {
        let size = size.unwrap_or(match memory_budget {
            Some(_) => CacheSize::Share(DEFAULT_CACHE_SHARE),
            None => CacheSize::Bytes(PromptCacheOptions::default().memory),
        });
        match (size, memory_budget) {
            (CacheSize::Bytes(n), _) => Ok(CacheTerm::Bytes(n)),
            (CacheSize::Share(share), Some(_)) => Ok(CacheTerm::Share(share)),
            (CacheSize::Share(_), None) => {
                bail!(
                    "--prompt-cache as a share (%) needs a memory budget (not --pool-slots or --experts-per-layer); give a size such as 2GiB"
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

/// The parser of a count flag that refuses values below `least`: values with which every
/// request would fail or come back empty (`--max-tokens 0`, a `--context` with no room
/// for a prompt token and a new one) are refused at startup.
pub fn at_least(least: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(least..)
}

/// `--context` (llama.cpp's `-c`/`--ctx-size`, the reference system's `--max-context`):
/// tokens, or `auto` (as without the flag).
#[derive(Clone, Copy, Debug)]
pub enum ContextSize {
    Auto,
    Tokens(usize),
}

impl ContextSize {
    /// The tokens given; `None` for `auto`.
    pub fn tokens(size: Option<ContextSize>) -> Option<usize> {
        match size? {
            ContextSize::Auto => None,
            ContextSize::Tokens(n) => Some(n),
        }
    }
}

/// `auto`, or a number of tokens of at least 2 (room for a prompt token and a new one).
pub fn parse_context(s: &str) -> std::result::Result<ContextSize, String> {
    match s.trim() {
        "auto" => Ok(ContextSize::Auto),
        t => match t.parse::<usize>() {
            Ok(n) if n >= 2 => Ok(ContextSize::Tokens(n)),
            _ => Err(format!(
                "`{s}` is not `auto` or a number of tokens of at least 2"
            )),
        },
    }
}

/// `--max-prefill-wait` (`generate`, `chat`, `serve`).
#[derive(Args, Clone, Debug, Default)]
pub struct PrefillArgs {
    /// Refuse a prompt whose prefill is estimated to take longer than this many seconds
    /// (at the rate measured on the last prompt, else the plan's read-bound rate).
    #[arg(long, value_parser = parse_seconds)]
    pub max_prefill_wait: Option<f64>,
}

fn parse_seconds(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("`{s}` is not a positive number of seconds")),
    }
}

/// Chat template variables (`generate` with the template, `chat`).
#[derive(Args, Clone, Debug, Default)]
pub struct TemplateArgs {
    /// Thinking models (Qwen3): `on` or `off` sets the template's `enable_thinking`.
    #[arg(long, value_enum)]
    think: Option<OnOff>,
    /// More template variables as a JSON object, e.g. '{"enable_thinking": false}'.
    #[arg(long, value_parser = parse_kwargs)]
    chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

impl TemplateArgs {
    /// The template's variables. Errors: `--think` contradicting the JSON.
    pub fn kwargs(&self) -> Result<serde_json::Map<String, serde_json::Value>> {
        let mut kwargs = self.chat_template_kwargs.clone().unwrap_or_default();
        if let Some(think) = self.think {
            slotstream::chat_template::set_enable_thinking(&mut kwargs, think == OnOff::On)
                .map_err(|e| anyhow::anyhow!("--think: {e}"))?;
        }
        Ok(kwargs)
    }

    pub fn is_set(&self) -> bool {
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

/// `--trace` (commands that write the pool's routing trace).
#[derive(Args, Default)]
pub struct TraceArgs {
    /// Write the pool's routing trace (token,layer,expert,outcome CSV) here.
    #[arg(long)]
    pub trace: Option<PathBuf>,
}

/// How routed experts are read: through a slot pool sized by `--pool-slots`,
/// `--experts-per-layer` or `--memory-budget`, or (without them) as the machine allows:
/// every record resident when the whole model fits, else streamed (see `slotstream plan`).
#[derive(Args)]
pub struct StreamArgs {
    /// Stream experts through a pool of this many slots (records).
    #[arg(long, conflicts_with_all = ["experts_per_layer", "memory_budget", "memory_limit"])]
    pub pool_slots: Option<usize>,
    /// A pool of this many slots per MoE layer (shared by all layers).
    #[arg(long, conflicts_with_all = ["memory_budget", "memory_limit"])]
    pub experts_per_layer: Option<usize>,
    #[command(flatten)]
    pub budget: BudgetArgs,
    #[command(flatten)]
    pub io: IoArgs,
    /// Print statistics on stderr (the pool's as JSON when streaming).
    #[arg(long)]
    pub stats: bool,
    /// Prefetch the experts that layer L+2's router picks on layer L's hidden state.
    #[arg(long, value_enum, default_value = "on")]
    pub lookahead: OnOff,
    #[command(flatten)]
    pub draft: DraftArgs,
    /// Images: `auto` takes them (the model's vision tower is loaded on the first one),
    /// `off` refuses them.
    #[arg(long, value_enum, default_value = "auto")]
    pub vision: VisionFlag,
}

/// `--vision`'s values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum VisionFlag {
    #[default]
    Auto,
    Off,
}

impl VisionFlag {
    /// The engine's mode for this flag.
    pub fn mode(self) -> slotstream::engine::VisionMode {
        match self {
            VisionFlag::Auto => slotstream::engine::VisionMode::Auto,
            VisionFlag::Off => slotstream::engine::VisionMode::Off,
        }
    }
}

/// Speculative decoding with the checkpoint's MTP draft head.
#[derive(Args, Clone, Debug, Default)]
pub struct DraftArgs {
    /// Draft tokens with the MTP head and verify them in one pass (speculative sampling;
    /// greedy output unchanged): `auto` when the checkpoint has a head, every expert is
    /// resident and the device is a GPU (on the CPU drafts slow decoding), `on`, `off`.
    #[arg(long, value_enum, default_value = "auto")]
    pub mtp: MtpFlag,
    /// The MTP head's weights in a safetensors file of their own (the reference system's
    /// `mtp.safetensors`: `mtp.*` tensors).
    #[arg(long, value_name = "FILE")]
    pub mtp_weights: Option<std::path::PathBuf>,
    /// Draft tokens per decode step, 1 to 4.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=4))]
    pub draft_tokens: u8,
}

/// `--mtp`'s values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MtpFlag {
    #[default]
    Auto,
    On,
    Off,
}

impl DraftArgs {
    /// The engine's options for these flags.
    pub fn options(&self) -> slotstream::engine::MtpOptions {
        use slotstream::engine::MtpMode;
        slotstream::engine::MtpOptions {
            mode: match self.mtp {
                MtpFlag::Auto => MtpMode::Auto,
                MtpFlag::On => MtpMode::On,
                MtpFlag::Off => MtpMode::Off,
            },
            weights: self.mtp_weights.clone(),
            draft_tokens: usize::from(self.draft_tokens.max(1)),
        }
    }
}

/// The memory a run is planned within (streaming commands and `plan`).
#[derive(Args, Clone, Debug)]
pub struct BudgetArgs {
    /// Plan the run within exactly this much memory (e.g. 8GiB), the experts streamed
    /// through the pool the other terms leave (see `slotstream plan`).
    #[arg(long, value_parser = slotstream::plan::parse_size, conflicts_with_all = ["memory_limit", "max_ram_percent"])]
    pub memory_budget: Option<u64>,
    /// An adaptive ceiling: plan as the machine allows (every record resident when the
    /// whole model fits, else streamed), but within this much memory (e.g. 16GiB).
    #[arg(long, value_parser = slotstream::plan::parse_size)]
    pub memory_limit: Option<u64>,
    /// The share of RAM (or of the cgroup's memory.max) a plan from the machine may take,
    /// at most what is available now.
    #[arg(long, default_value_t = DEFAULT_MAX_RAM_PERCENT, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub max_ram_percent: u8,
}

impl Default for BudgetArgs {
    /// As the flags' defaults: planned from the machine.
    fn default() -> Self {
        BudgetArgs {
            memory_budget: None,
            memory_limit: None,
            max_ram_percent: DEFAULT_MAX_RAM_PERCENT,
        }
    }
}

impl BudgetArgs {
    /// The target a run is planned within: `--memory-budget` (fixed), else the machine's
    /// ([`Target::from_machine`], within `--memory-limit`), else `--memory-limit` alone
    /// when the machine cannot be read; `None` when nothing gives one.
    pub fn target(&self) -> Option<Target> {
        if let Some(bytes) = self.memory_budget {
            return Some(Target::fixed(bytes));
        }
        match MachineMemory::probe() {
            Some(machine) => Some(Target::from_machine(
                machine,
                self.max_ram_percent,
                self.memory_limit,
            )),
            None => self.memory_limit.map(|bytes| Target {
                bytes,
                why: Bound::Limit,
                machine: None,
            }),
        }
    }
}

/// How expert records are read and where a GPU keeps them (streaming commands and bench).
#[derive(Args)]
pub struct IoArgs {
    /// The most tokens, prompt and output together, a sequence may hold (generation
    /// stops there; at most the model's max_position_embeddings), and what the memory
    /// plan reserves KV cache for; at least 2. Default: auto, the largest power of two
    /// from 4096 up to the model's max_position_embeddings whose KV cache and states take
    /// at most 10% of the memory budget and leave the pool its floor (`bench`: 4096).
    /// Also `-c`, `--ctx-size` (llama.cpp) and `--max-context` (the reference system).
    #[arg(short, long, visible_aliases = ["ctx-size", "max-context"], value_parser = parse_context)]
    pub context: Option<ContextSize>,
    /// Demand reads in flight at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..))]
    pub queue_depth: u16,
    /// direct (O_DIRECT / F_NOCACHE) or buffered reads.
    #[arg(long, default_value = "direct")]
    pub io: IoMode,
    /// Read the checkpoint shards even if a valid experts.pack is present.
    #[arg(long)]
    pub no_pack: bool,
    /// Where a GPU reads the slots: `unified` (host memory imported, read in place) or
    /// `device` (device-local arenas, copied on a miss). Default: unified on integrated
    /// and CPU adapters that support it, device on discrete GPUs.
    #[arg(long)]
    pub placement: Option<Placement>,
    /// A directory with a byte-identical copy of the checkpoint's files or of its
    /// experts.pack, on another disk (repeatable): each read of the pool goes to the copy
    /// expected to finish first, and a copy whose reads fail is dropped. Checked at start
    /// by sizes and headers; `--stats` gives each copy's bytes and GB/s.
    #[arg(long)]
    pub mirror: Vec<PathBuf>,
}

impl IoArgs {
    /// The library's options for these flags (no pool, lookahead on).
    /// `--context`'s tokens; `None` for auto.
    pub fn context(&self) -> Option<usize> {
        ContextSize::tokens(self.context)
    }

    pub fn source(&self) -> SourceOptions {
        SourceOptions {
            context: self.context().unwrap_or(slotstream::plan::MIN_AUTO_CONTEXT),
            queue_depth: self.queue_depth as usize,
            io: self.io,
            use_pack: !self.no_pack,
            placement: self.placement,
            mirrors: self.mirror.clone(),
            ..Default::default()
        }
    }
}

/// Sampling flags of `generate`, `chat` and `serve` (mlx-lm's sampler; see `sampling.rs`),
/// read as the server reads a request's fields ([`SamplingInput::apply`]).
#[derive(Args, Clone, Debug, Default)]
pub struct SamplingArgs {
    /// 0 is greedy (the default).
    #[arg(long, visible_alias = "temp", allow_negative_numbers = true)]
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
    #[arg(short, long, allow_negative_numbers = true)]
    seed: Option<i128>,
}

impl SamplingArgs {
    /// The sampling options the flags give. Errors name the flag out of range.
    pub fn options(&self) -> Result<SamplingOptions> {
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
pub enum OnOff {
    On,
    Off,
}

/// Token ids given on the command line as `1,2,3`.
#[derive(Clone, Debug)]
pub struct IdList(pub Vec<u32>);

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

impl StreamArgs {
    /// The library's options for these flags.
    pub fn source(&self) -> SourceOptions {
        SourceOptions {
            pool: match (
                self.pool_slots,
                self.experts_per_layer,
                self.budget.memory_budget,
            ) {
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

/// A time given in minutes, fractions allowed (`0.5` is 30 s); 0 means never
/// (`--idle-exit` of `serve` and `launch`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Minutes(f64);

impl Minutes {
    /// The time, or `None` for 0 (never).
    pub fn duration(self) -> Option<std::time::Duration> {
        (self.0 > 0.0).then(|| std::time::Duration::from_secs_f64(self.0 * 60.0))
    }
}

impl std::str::FromStr for Minutes {
    type Err = String;

    /// A non-negative number of minutes that fits a `Duration`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().parse::<f64>() {
            Ok(m) if m >= 0.0 && std::time::Duration::try_from_secs_f64(m * 60.0).is_ok() => {
                Ok(Minutes(m))
            }
            _ => Err(format!(
                "`{s}` is not a number of minutes (0 or more; 0: never)"
            )),
        }
    }
}

impl std::fmt::Display for Minutes {
    /// As given (`f64`'s shortest form, which parses back to the same value).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}
