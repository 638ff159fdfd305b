//! The library API for async services: load a model once, generate from many tasks.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use futures::StreamExt;
//! use slotstream::engine::{Engine, EngineOptions, Event, Request};
//! let engine = Engine::load("path/to/model".as_ref(), EngineOptions::default()).await?;
//! let mut events = engine.generate(Request::prompt("Why is the sky blue?"));
//! while let Some(event) = events.next().await {
//!     match event? {
//!         Event::Token { text, .. } => print!("{text}"),
//!         Event::Done { tail, stats, .. } => println!("{tail}\n{:.1} tok/s", stats.decode_tps),
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! `Engine` is `Send + Sync` and cheap to clone; requests run one at a time in arrival
//! order (the model's state and the slot pool serve one sequence at a time). Dropping the
//! event stream cancels its request at the next token and releases its pins.
//!
//! Prompt reuse: the engine keeps snapshots of its sequences' states at prefix boundaries
//! ([`crate::prompt_cache`]); a request continues from the longest snapshot whose tokens
//! start its prompt and runs only the rest.
//!
//! Besides generation the engine scores token sequences ([`Engine::score`]), and it is
//! the one load path of the binary's `generate`, `chat`, `score` and `serve`.
//!
//! Loading has two phases: [`Engine::open`] reads what prompts need (config.json, the
//! tokenizer, the chat template) in well under a second, so a bad prompt is refused
//! ([`Prepared::encode`]) before [`Prepared::load`] maps the weights and fills the pool,
//! which takes tens of seconds for a large model. [`Engine::load`] does both.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use futures::stream::{BoxStream, Stream, StreamExt};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::backend::gpu::GpuOptions;
use crate::backend::{open_compute, Backend, Compute};
use crate::chat_template::{chat_prompt, Chat, ChatPrompt, ChatTemplate, Message};
use crate::checkpoint::{open_config, Checkpoint};
use crate::constraint::{Constraint, Grammar, Vocabulary};
use crate::error::{Error, Result};
use crate::experts::{open_source, AnyExperts, SourceOptions};
use crate::generate::{GenerateOptions, GenerateStats};
use crate::image_processor::{decode as decode_image, ImageProcessor};
use crate::model::{ImageEmbedding, Logits, Model, VisionTower};
use crate::ngram::{NgramCounts, NgramTable};
use crate::plan::{ContextCost, Plan};
use crate::pool::{PoolStats, ResidentSet, SlotPool, TraceEvent};
use crate::prompt_cache::{PromptCache, PromptCacheOptions, PromptCacheStats};
use crate::sampling::{SamplingOptions, TokenLogprobs};
use crate::score::Score;
use crate::tokenizer::{eos_ids, StreamDecoder, Tokenizer};

/// How to load a model.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// As the CLI's `--device` (see [`crate::backend::open_compute`]).
    pub device: Option<String>,
    /// How a GPU backend is driven (the CLI's come from the environment,
    /// [`GpuOptions::from_env`]).
    pub gpu: GpuOptions,
    /// Where experts come from (pool size, I/O, lookahead, the pool's trace:
    /// [`Engine::take_trace`]); `source.context` is also the most tokens (prompt and
    /// generated) one sequence may hold, at most the model's `max_position_embeddings`
    /// ([`crate::context`]).
    pub source: SourceOptions,
    /// Snapshots kept for prompt reuse (in memory, and on disk with a directory); a
    /// memory plan counts their bound (`source.prompt_cache` is set from it).
    pub prompt_cache: PromptCacheOptions,
    /// The MTP draft head: whether it is loaded, from where, and drafts per step.
    pub mtp: MtpOptions,
    /// Whether images are taken (the CLI's `--vision`): the vision tower is loaded on
    /// the first image, never by a text-only run.
    pub vision: VisionMode,
}

/// Whether the engine takes images (the CLI's `--vision`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VisionMode {
    /// The vision tower is loaded on the first image of a model that has one; a model
    /// without one refuses images with a clear error.
    #[default]
    Auto,
    /// Images are refused (the tower is never loaded).
    Off,
}

/// The most pixels an image may have before it is resized (50 megapixels: a decoded
/// image then takes at most about 800 MB while it is read); larger ones are refused
/// from their header.
pub const MAX_IMAGE_PIXELS: u64 = 50_000_000;

/// Whether the engine loads the checkpoint's MTP head and drafts with it (the CLI's
/// `--mtp`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MtpMode {
    /// When the checkpoint has a head and every routed expert is resident (its experts
    /// are read from the mapped checkpoint, which a streamed run's plan does not count).
    #[default]
    Auto,
    /// Always; a checkpoint without a head is an error.
    On,
    Off,
}

/// The MTP head's options ([`EngineOptions::mtp`]).
#[derive(Clone, Debug)]
pub struct MtpOptions {
    pub mode: MtpMode,
    /// A safetensors file holding the head's `mtp.*` tensors (the reference system's
    /// `mtp.safetensors`), added to the checkpoint's ([`Checkpoint::add_file`]).
    pub weights: Option<PathBuf>,
    /// Draft tokens per decode step ([`GenerateOptions::draft_tokens`]).
    pub draft_tokens: usize,
}

impl Default for MtpOptions {
    /// Auto, the checkpoint's own head, one draft per step.
    fn default() -> Self {
        MtpOptions {
            mode: MtpMode::Auto,
            weights: None,
            draft_tokens: 1,
        }
    }
}

impl Default for EngineOptions {
    /// The default device, experts read from the memory-mapped checkpoint, a context of
    /// 4096 tokens and the default prompt cache ([`PromptCacheOptions::default`]).
    fn default() -> Self {
        EngineOptions {
            device: None,
            gpu: GpuOptions::default(),
            source: SourceOptions::default(),
            prompt_cache: PromptCacheOptions::default(),
            mtp: MtpOptions::default(),
            vision: VisionMode::default(),
        }
    }
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// What the prompt is (a chat, a text or ids: [`Engine::encode`]).
    pub input: Input,
    /// At most this many new tokens (fewer if the context fills first: finish reason
    /// "length").
    pub max_tokens: usize,
    /// How each token is picked (greedy by default); checked when the request starts.
    pub sampling: SamplingOptions,
    /// When set, each token's event carries its log-probability and this many of the most
    /// probable tokens' ([`Event::Token`]).
    pub logprobs: Option<usize>,
    /// When set, tokens are sampled among those this grammar allows
    /// ([`Engine::constrain`]).
    pub constraint: Option<Constraint>,
}

/// What a request starts from.
#[derive(Clone, Debug)]
pub enum Input {
    /// A conversation, rendered with the model's chat template (the messages joined by
    /// newlines when the model has none); control tokens come only from the template's
    /// markup ([`crate::chat_template`]).
    Chat(Chat),
    /// Text tokenized as is, special-token texts included (a raw prompt).
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// Token ids whose image placeholders (`<|image_pad|>`, one an image, as a chat
    /// template renders them: [`Engine::encode_chat`]) stand for these encoded images, in
    /// order (the server's and the CLI's chats with images).
    IdsWithImages(Vec<u32>, Vec<Arc<[u8]>>),
}

impl Request {
    /// A single user message, greedy, up to 256 tokens.
    pub fn prompt(text: &str) -> Self {
        Request {
            input: Input::Chat(Chat::new(vec![Message::new("user", text)])),
            max_tokens: 256,
            sampling: SamplingOptions::default(),
            logprobs: None,
            constraint: None,
        }
    }
}

/// What a request's stream yields.
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)] // one `Done` per request: not worth a box
pub enum Event {
    /// A new token and the text it completes (possibly empty while a character is split
    /// across tokens), with its log-probabilities when the request asked
    /// ([`Request::logprobs`]).
    Token {
        id: u32,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    /// The end: all output ids, text still held back at the end (an incomplete
    /// character; usually empty), generation statistics and the pool's counters for
    /// this request.
    Done {
        output_ids: Vec<u32>,
        tail: String,
        /// Prompt tokens taken from a snapshot instead of being run
        /// (`stats.prompt_tokens` counts those that were run).
        reused_tokens: usize,
        stats: GenerateStats,
        pool: Option<PoolStats>,
    },
}

/// The engine's counters since it was loaded.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EngineStats {
    /// Requests that ran (completed, stopped or failed after starting): generations and
    /// scorings.
    pub requests: u64,
    /// Prompt reuse: snapshot hits and misses, reused tokens, bytes in memory and on disk
    /// (as of the end of the last request).
    pub prompt_cache: PromptCacheStats,
    /// Prompt tokens per second of the last prefill that ran at least one chunk: what
    /// [`Engine::prefill_estimate`] goes by once it is known.
    pub prefill_rate: Option<f64>,
    /// Draft tokens the MTP head proposed, drafts accepted, and verify passes, over all
    /// requests ([`GenerateStats`]).
    pub drafted: u64,
    pub accepted: u64,
    pub verify_passes: u64,
}

/// How long a prefill is expected to take ([`Engine::prefill_estimate`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PrefillEstimate {
    /// Prompt tokens.
    pub tokens: usize,
    /// Prompt tokens per second.
    pub rate: f64,
    /// `tokens / rate`.
    pub seconds: f64,
    /// Whether `rate` was measured on this engine's last prompt (else it is the plan's
    /// read-bound rate, [`Plan::read_bound_prefill_rate`], which leaves out the compute:
    /// `seconds` is then a lower bound).
    pub measured: bool,
}

impl PrefillEstimate {
    /// "about 12.5 s at 40.0 tokens/s (measured on the last prompt)", or, from the plan,
    /// "at least 3.1 s (...)": the plan's rate counts the reads alone, not the compute.
    pub fn describe(&self) -> String {
        if self.measured {
            format!(
                "about {:.1} s at {:.1} tokens/s (measured on the last prompt)",
                self.seconds, self.rate
            )
        } else {
            format!(
                "at least {:.1} s (the plan's reads alone, at 2 GB/s: {:.1} tokens/s)",
                self.seconds, self.rate
            )
        }
    }

    /// Why a prompt is refused when its prefill would take longer than `max_seconds`;
    /// `None` when it would not.
    pub fn exceeds(&self, max_seconds: f64) -> Option<String> {
        (self.seconds > max_seconds).then(|| {
            format!(
                "the prompt's {} tokens would take {} to prefill, more than the {max_seconds} s allowed",
                self.tokens,
                self.describe()
            )
        })
    }
}

/// A loaded model, shareable across tasks.
///
/// Dropping it on a GPU: end the threads that ran its requests (the tokio runtime they
/// ran on) before the last clone drops. The GPU device is destroyed with the engine, and
/// NVIDIA's Vulkan driver faults (a segmentation fault, seen on an H200 with driver
/// 580.159.04) when a thread that made calls on a device exits after that device was
/// destroyed; the CLI drops its runtime first.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
}

/// What requests use without waiting for the model: tokenizing, limits, counters.
struct Shared {
    runner: Arc<tokio::sync::Mutex<Box<dyn Runner>>>,
    front: Front,
    pool: Option<Arc<SlotPool>>,
    /// The memory plan that sized the pool, when a budget sized it.
    plan: Option<Plan>,
    /// The model's n-gram tables, for their counters.
    ngram: Vec<Arc<NgramTable>>,
    stats: Mutex<EngineStats>,
    /// Prompt tokens per second the plan expects of a prefill before one is measured.
    planned_prefill_rate: Option<f64>,
    /// Decoder-layer indices with routed experts, and experts per layer: the shape of
    /// [`Engine::resident_experts`] when every record is mapped.
    moe_layers: Vec<usize>,
    num_experts: usize,
    /// Draft tokens per step when the MTP head is loaded, else 0.
    draft_tokens: usize,
    /// Requests started and not yet running (queued behind the runner's lock): a request
    /// drafts only when none waits as it starts ([`Engine::generate`]).
    waiting: AtomicUsize,
}

/// Runs one request to completion, sending events; object-safe so the engine can hold
/// either backend.
trait Runner: Send + Sync {
    /// Generates from `prompt`, whose image placeholders (one each, as the template
    /// renders them) stand for `images` (encoded), in order.
    fn run(
        &self,
        prompt: &[u32],
        images: &[Arc<[u8]>],
        options: &GenerateOptions,
        shared: &Shared,
        events: &mpsc::UnboundedSender<Result<Event>>,
    ) -> Result<()>;

    /// Scores `ids` on a fresh sequence ([`crate::score::score`]).
    fn score(&self, ids: &[u32]) -> Result<Score>;

    /// Whether the model's MTP head is loaded.
    fn drafts(&self) -> bool;

    /// The model's n-gram tables ([`Model::ngram_tables`]).
    fn ngram_tables(&self) -> Vec<Arc<NgramTable>>;

    /// The prompt cache's counters.
    fn prompt_cache_stats(&self) -> PromptCacheStats;

    /// Tokens per prefill pass of a long prompt (`Model::prefill_chunk`).
    fn prefill_chunk(&self) -> usize;
}

struct Loaded<B: Backend> {
    backend: B,
    model: Model<B>,
    experts: AnyExperts,
    cache: Mutex<PromptCache<B>>,
    vision: Vision,
}

/// The vision tower and its image processor, loaded on the first image
/// ([`EngineOptions::vision`]).
struct Vision {
    ckpt: Arc<Checkpoint>,
    mode: VisionMode,
    tower: OnceLock<std::result::Result<Arc<(VisionTower, ImageProcessor)>, String>>,
    /// The last images' rows (by [`ImageEmbedding::key`]): a conversation sends its
    /// images again every turn, and the tower need not run on them again.
    recent: Mutex<Vec<ImageEmbedding>>,
}

/// Images' rows [`Vision`] keeps for later turns.
const RECENT_IMAGES: usize = 8;

impl Vision {
    /// Whether images can be taken. Errors: images are off, the model has no tower.
    fn available(&self) -> Result<()> {
        if self.mode == VisionMode::Off {
            return Err(Error::InvalidInput(
                "images are turned off (--vision off)".into(),
            ));
        }
        if self.ckpt.config.vision.is_none() {
            return Err(Error::InvalidInput(
                "this model has no vision tower (no vision_config): it takes no images".into(),
            ));
        }
        Ok(())
    }

    /// The tower's rows of each encoded image: decoded (at most [`MAX_IMAGE_PIXELS`]),
    /// resized and cut into patches as the model's processor does, through the tower
    /// (loaded now if it is not yet). Errors: [`Error::Image`] for an image that cannot be
    /// used, [`Error::InvalidInput`] when images are off or the model has no tower.
    fn embed(&self, images: &[Arc<[u8]>]) -> Result<Vec<ImageEmbedding>> {
        self.available()?;
        let loaded = self.tower.get_or_init(|| {
            let start = std::time::Instant::now();
            let tower = VisionTower::load(&self.ckpt).map_err(|e| e.to_string())?;
            let processor = ImageProcessor::from_dir(&self.ckpt.dir, tower.config())
                .map_err(|e| e.to_string())?;
            tracing::info!(
                seconds = start.elapsed().as_secs_f64(),
                "vision tower loaded (first image)"
            );
            Ok(Arc::new((tower, processor)))
        });
        let (tower, processor) = &**loaded
            .as_ref()
            .map_err(|e| Error::InvalidInput(e.clone()))?;
        images
            .iter()
            .map(|bytes| {
                let patches = processor.preprocess(&decode_image(bytes, MAX_IMAGE_PIXELS)?)?;
                let key = patches.key();
                let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(i) = recent.iter().position(|e| e.key == key) {
                    let e = recent.remove(i);
                    recent.push(e.clone());
                    return Ok(e);
                }
                let e = tower.embed(&patches)?;
                if recent.len() == RECENT_IMAGES {
                    recent.remove(0);
                }
                recent.push(e.clone());
                Ok(e)
            })
            .collect()
    }
}

/// `prompt` with each image placeholder (`image_token`) repeated for its image's tokens
/// (transformers' processor expands `<|image_pad|>` so). Errors: as many placeholders as
/// images are needed.
fn expand_placeholders(
    prompt: &[u32],
    image_token: u32,
    images: &[ImageEmbedding],
) -> Result<Vec<u32>> {
    let found = prompt.iter().filter(|&&t| t == image_token).count();
    if found != images.len() {
        return Err(Error::InvalidInput(format!(
            "the prompt has {found} image placeholders for {} images",
            images.len()
        )));
    }
    let extra: usize = images.iter().map(|i| i.tokens() - 1).sum();
    let mut out = Vec::with_capacity(prompt.len() + extra);
    let mut next = images.iter();
    for &t in prompt {
        match (t == image_token).then(|| next.next()).flatten() {
            Some(image) => out.extend(std::iter::repeat_n(t, image.tokens())),
            None => out.push(t),
        }
    }
    Ok(out)
}

/// What prompts need, read before the weights ([`Engine::open`]): the tokenizer, the chat
/// template, the EOS ids and the limits. Shared by [`Prepared`] and [`Engine`].
struct Front {
    dir: PathBuf,
    /// `None` when the directory has no tokenizer.json: ids only (scoring).
    tokenizer: Option<Tokenizer>,
    /// The chat template, or why it could not be read (the file and the message): kept
    /// rather than failing the open, so a model whose template is malformed still
    /// generates from raw text and ids and scores; only a chat needs it.
    template: std::result::Result<Option<ChatTemplate>, (PathBuf, String)>,
    /// Empty without a tokenizer (nothing is generated then).
    eos: Vec<u32>,
    context: usize,
    vocab: usize,
    /// llguidance's view of the vocabulary, built on first use (constraints, token bytes).
    vocabulary: OnceLock<std::result::Result<Arc<Vocabulary>, String>>,
}

impl Front {
    /// The tokenizer. Errors: the model has no tokenizer.json (the error
    /// [`Tokenizer::load`] gives).
    fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| {
            Error::io(
                self.dir.join("tokenizer.json"),
                std::io::Error::new(std::io::ErrorKind::NotFound, "not found"),
            )
        })
    }

    /// The chat template (`None`: the model has none). Errors: it could not be read.
    fn template(&self) -> Result<Option<&ChatTemplate>> {
        match &self.template {
            Ok(template) => Ok(template.as_ref()),
            Err((path, message)) => Err(Error::Template {
                path: path.clone(),
                message: message.clone(),
            }),
        }
    }

    /// The vocabulary as llguidance reads it, built from tokenizer.json on first use.
    /// Errors: no tokenizer, one llguidance cannot read, a model without an end of
    /// sequence (kept: the next call gives the same error at once).
    fn vocabulary(&self) -> Result<Arc<Vocabulary>> {
        let path = self.tokenizer()?.path().to_path_buf();
        let built = self.vocabulary.get_or_init(|| {
            let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            Vocabulary::from_tokenizer_json(&bytes, &path, self.vocab, &self.eos)
                .map(Arc::new)
                .map_err(|e| e.to_string())
        });
        built
            .clone()
            .map_err(|message| Error::Tokenizer { path, message })
    }

    /// [`Engine::constrain`].
    fn constrain(&self, grammar: &Grammar, thinking_open: bool, field: &str) -> Result<Constraint> {
        let vocabulary = self.vocabulary()?;
        let after = match thinking_open {
            true => match self.tokenizer()?.encode_plain("</think>")?.as_slice() {
                [id] => Some(*id),
                _ => None,
            },
            false => None,
        };
        vocabulary.constrain(grammar, after, field)
    }

    fn encode(&self, input: &Input) -> Result<Vec<u32>> {
        let ids = match input {
            Input::Ids(ids) | Input::IdsWithImages(ids, _) => {
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= self.vocab) {
                    return Err(Error::InvalidInput(format!(
                        "token id {bad} is out of range for a vocabulary of {} tokens",
                        self.vocab
                    )));
                }
                ids.clone()
            }
            Input::Text(text) => self.tokenizer()?.encode(text)?,
            Input::Chat(chat) => return Ok(self.encode_chat(chat)?.ids),
        };
        self.check_prompt(&ids)?;
        Ok(ids)
    }

    fn encode_chat(&self, chat: &Chat) -> Result<ChatPrompt> {
        let prompt = chat_prompt(self.tokenizer()?, self.template()?, chat)?;
        self.check_prompt(&prompt.ids)?;
        Ok(prompt)
    }

    /// Refuses an empty prompt or one that leaves no room in the context.
    fn check_prompt(&self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(Error::InvalidInput("the prompt is empty".into()));
        }
        crate::context::room(ids.len(), self.context)?;
        Ok(())
    }
}

/// A model opened but not loaded ([`Engine::open`]): prompts can be encoded and checked
/// before [`Prepared::load`] reads the weights.
pub struct Prepared {
    front: Front,
    /// With `source.context` limited to the model's.
    options: EngineOptions,
}

impl Prepared {
    /// The model's directory.
    pub fn dir(&self) -> &Path {
        &self.front.dir
    }

    /// The most tokens (prompt and generated) one sequence may hold, as the engine will
    /// have it ([`Engine::context`]; an automatic one may yet shrink at load, to leave the
    /// pool its floor: [`crate::plan::AutoPlan::choose_context`]).
    pub fn context(&self) -> usize {
        self.front.context
    }

    /// As [`Engine::encode`], before the weights load.
    pub fn encode(&self, input: &Input) -> Result<Vec<u32>> {
        self.front.encode(input)
    }

    /// As [`Engine::encode_chat`], before the weights load.
    pub fn encode_chat(&self, chat: &Chat) -> Result<ChatPrompt> {
        self.front.encode_chat(chat)
    }

    /// As [`Engine::constrain`], before the weights load.
    pub fn constrain(
        &self,
        grammar: &Grammar,
        thinking_open: bool,
        field: &str,
    ) -> Result<Constraint> {
        self.front.constrain(grammar, thinking_open, field)
    }

    /// As [`Engine::tokenizer`]. Errors: the model has no tokenizer.json.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.front.tokenizer()
    }

    /// As [`Engine::template`].
    pub fn template(&self) -> Result<Option<&ChatTemplate>> {
        self.front.template()
    }

    /// Loads the weights and the expert source (on a blocking thread, so the caller's
    /// runtime keeps serving). Without a tokenizer the engine scores ids
    /// ([`Engine::score`]) and refuses everything else. Errors: everything
    /// [`Checkpoint::open`] and [`Model::load`] report, a pool below its floor, a GPU that
    /// was asked for and is absent.
    pub async fn load(self) -> Result<Engine> {
        let Prepared { mut front, options } = self;
        // The pool's reads run on the caller's runtime.
        let handle = tokio::runtime::Handle::current();
        let shared = tokio::task::spawn_blocking(move || -> Result<Shared> {
            let mut ckpt = Checkpoint::open(&front.dir)?;
            if let Some(file) = &options.mtp.weights {
                ckpt.add_file(file)?;
            }
            let ckpt = Arc::new(ckpt);
            let (moe_layers, num_experts) = (ckpt.config.moe_layers(), ckpt.config.num_experts);
            let (runner, pool, plan, context): (Box<dyn Runner>, _, _, _) =
                match open_compute(options.device.as_deref(), &options.gpu)? {
                    Compute::Cpu(b) => {
                        let o = load_on(b, &ckpt, &options, handle)?;
                        (Box::new(o.loaded), o.pool, o.plan, o.context)
                    }
                    Compute::Gpu(b) => {
                        let o = load_on(*b, &ckpt, &options, handle)?;
                        (Box::new(o.loaded), o.pool, o.plan, o.context)
                    }
                };
            let draft_tokens = if runner.drafts() {
                options.mtp.draft_tokens
            } else {
                0
            };
            // Prompts are checked against the context the plan kept.
            front.context = context;
            let ngram = runner.ngram_tables();
            let stats = EngineStats {
                prompt_cache: runner.prompt_cache_stats(),
                ..EngineStats::default()
            };
            // A streamed prompt reads the records not in slots once per stretch between
            // snapshots (every `every` tokens; the whole prompt, at most the context,
            // without them), and at least once per chunk.
            let piece = match options.prompt_cache.every {
                0 => context,
                every => every,
            };
            let planned_prefill_rate = plan
                .as_ref()
                .and_then(|p| p.read_bound_prefill_rate(piece.max(runner.prefill_chunk())));
            Ok(Shared {
                runner: Arc::new(tokio::sync::Mutex::new(runner)),
                front,
                pool,
                plan,
                ngram,
                stats: Mutex::new(stats),
                planned_prefill_rate,
                moe_layers,
                num_experts,
                draft_tokens,
                waiting: AtomicUsize::new(0),
            })
        })
        .await
        .map_err(|e| Error::Internal(format!("loading task failed: {e}")))??;
        Ok(Engine {
            shared: Arc::new(shared),
        })
    }
}

impl Engine {
    /// Opens the model in `dir` without loading its weights: reads config.json, the
    /// tokenizer (when tokenizer.json is present), the EOS ids and the chat template, and
    /// limits `options.source.context` to the model's (or, with
    /// `options.source.context_budget`, chooses it: [`ContextCost::auto_context`]). Blocking (file reads and parsing,
    /// well under a second); async callers run it on a blocking thread. Errors: a missing
    /// directory or config.json, every config error of [`crate::config::ModelConfig::load`],
    /// a malformed tokenizer or generation_config.json (a malformed chat template fails
    /// only the chats, see [`Engine::template`]).
    pub fn open(dir: &Path, options: EngineOptions) -> Result<Prepared> {
        let config = open_config(dir)?;
        let mut options = options;
        options.source.context = match options.source.context_budget {
            Some(budget) => {
                let context = ContextCost::of(&config).auto_context(budget);
                tracing::debug!(context, budget = %crate::plan::human(budget), "context (auto: KV cache and states within 10% of the budget)");
                context
            }
            None => crate::context::limit(options.source.context, &config),
        };
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Tokenizer::load(dir)?)
        } else {
            None
        };
        let eos = match &tokenizer {
            Some(t) => eos_ids(dir, &config.eos_token_ids, t, config.vocab_size)?,
            None => Vec::new(),
        };
        let front = Front {
            dir: dir.to_path_buf(),
            tokenizer,
            template: ChatTemplate::load(dir).map_err(|e| match e {
                Error::Template { path, message } | Error::Json { path, message } => {
                    (path, message)
                }
                Error::Io { path, io } => (path, io.to_string()),
                other => (dir.join("tokenizer_config.json"), other.to_string()),
            }),
            eos,
            context: options.source.context,
            vocab: config.vocab_size,
            vocabulary: OnceLock::new(),
        };
        Ok(Prepared { front, options })
    }

    /// Opens ([`Engine::open`], on a blocking thread) and loads ([`Prepared::load`]) the
    /// model in `dir`. Errors: what those report, and a missing tokenizer.
    pub async fn load(dir: &Path, options: EngineOptions) -> Result<Self> {
        let dir = dir.to_path_buf();
        let prepared = tokio::task::spawn_blocking(move || Engine::open(&dir, options))
            .await
            .map_err(|e| Error::Internal(format!("opening task failed: {e}")))??;
        prepared.tokenizer()?;
        prepared.load().await
    }

    /// The most tokens (prompt and generated) one sequence may hold.
    pub fn context(&self) -> usize {
        self.shared.front.context
    }

    /// The model's directory.
    pub fn dir(&self) -> &Path {
        &self.shared.front.dir
    }

    /// The prompt ids `input` stands for: a chat rendered with the template and tokenized
    /// ([`Engine::encode_chat`]), text tokenized, ids checked against the vocabulary. Runs
    /// without waiting for the model. Errors: a template or tokenizer failure (no
    /// tokenizer for a text or chat), an id out of range, an empty prompt, a prompt that
    /// leaves no room in the context.
    pub fn encode(&self, input: &Input) -> Result<Vec<u32>> {
        self.shared.front.encode(input)
    }

    /// A chat's prompt ([`chat_prompt`]): its ids and how the reply starts (the opening
    /// of a required tool call, an open `<think>` block). Errors: as [`Engine::encode`].
    pub fn encode_chat(&self, chat: &Chat) -> Result<ChatPrompt> {
        self.shared.front.encode_chat(chat)
    }

    /// A constraint to `grammar` for one request ([`Request::constraint`]); with
    /// `thinking_open` (the prompt opened a `<think>` block: [`ChatPrompt::thinking_open`])
    /// it starts after the reply's `</think>` token, when the tokenizer has one. The
    /// vocabulary is read from tokenizer.json on the first call. Errors:
    /// [`Error::Grammar`] naming `field` for a grammar llguidance refuses; a tokenizer
    /// llguidance cannot read or a model without an end-of-sequence id
    /// ([`Error::Tokenizer`]).
    pub fn constrain(
        &self,
        grammar: &Grammar,
        thinking_open: bool,
        field: &str,
    ) -> Result<Constraint> {
        self.shared.front.constrain(grammar, thinking_open, field)
    }

    /// Token `id`'s bytes (a special token's text), as llguidance reads tokenizer.json (for
    /// log-probabilities' `bytes`). Errors: as [`Engine::constrain`]'s vocabulary.
    pub fn token_bytes(&self, ids: &[u32]) -> Result<Vec<Vec<u8>>> {
        let vocabulary = self.shared.front.vocabulary()?;
        Ok(ids.iter().map(|&id| vocabulary.token_bytes(id)).collect())
    }

    /// Decodes ids to text (special tokens left out, [`Tokenizer::decode`]).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.shared.front.tokenizer()?.decode(ids)
    }

    /// The model's tokenizer (for what [`Engine::encode`] does not do: tokenizing a text
    /// to score, a conversation's next turn with [`crate::chat::Conversation`]). Errors:
    /// the model has no tokenizer.json (an engine from [`Prepared::load`]).
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.shared.front.tokenizer()
    }

    /// The model's chat template; `None` when it has none (chats are then the messages
    /// joined by newlines). Errors: the template could not be read (a malformed
    /// tokenizer_config.json or template), which fails only what needs it.
    pub fn template(&self) -> Result<Option<&ChatTemplate>> {
        self.shared.front.template()
    }

    /// The memory plan that sized the pool (`source.pool` a
    /// [`crate::experts::PoolSize::Budget`]); `None` otherwise.
    pub fn plan(&self) -> Option<&Plan> {
        self.shared.plan.as_ref()
    }

    /// How long a prefill of `tokens` prompt tokens is expected to take (the whole
    /// prompt: what a snapshot may spare is not known before the request runs): at the
    /// rate measured on the last prompt of at least one chunk, else at the rate the plan
    /// expects of its reads ([`Plan::read_bound_prefill_rate`]). `None` before a prompt
    /// has been measured when every record is resident (nothing is read; the compute
    /// bounds it, at a rate the plan does not know).
    pub fn prefill_estimate(&self, tokens: usize) -> Option<PrefillEstimate> {
        let measured = self
            .shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .prefill_rate;
        let (rate, measured) = match (measured, self.shared.planned_prefill_rate) {
            (Some(rate), _) => (rate, true),
            (None, Some(rate)) => (rate, false),
            (None, None) => return None,
        };
        Some(PrefillEstimate {
            tokens,
            rate,
            seconds: tokens as f64 / rate,
            measured,
        })
    }

    /// The pool's lookups recorded since the load or the last call (`source.trace`);
    /// empty without a pool or without tracing. Best taken between requests.
    pub fn take_trace(&self) -> Vec<TraceEvent> {
        self.shared
            .pool
            .as_ref()
            .map(|p| p.take_trace())
            .unwrap_or_default()
    }

    /// The engine's counters.
    pub fn stats(&self) -> EngineStats {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The pool's counters now (since the start of the current or last request), if
    /// experts stream through a pool.
    pub fn pool_stats(&self) -> Option<PoolStats> {
        self.shared.pool.as_ref().map(|p| p.stats())
    }

    /// Which records are resident now: those in the pool's slots
    /// ([`SlotPool::resident_set`]), or every one when the checkpoint is mapped (no pool;
    /// `streamed` false). Cheap enough to take several times a second.
    pub fn resident_experts(&self) -> ResidentSet {
        match &self.shared.pool {
            Some(pool) => pool.resident_set(),
            None => ResidentSet::all(self.shared.moe_layers.clone(), self.shared.num_experts),
        }
    }

    /// The n-gram table's row lookups and reads since the model was loaded; `None` for a
    /// model without one.
    pub fn ngram_counts(&self) -> Option<NgramCounts> {
        crate::ngram::total(&self.shared.ngram)
    }

    /// Slots pinned now (0 between requests).
    pub fn pinned_slots(&self) -> usize {
        self.shared.pool.as_ref().map_or(0, |p| p.pinned_slots())
    }

    /// Teacher-forced scoring: runs `ids` through a fresh sequence (not the prompt cache)
    /// once earlier requests are done, and scores each next token
    /// ([`crate::score::score`]: the mean negative log-likelihood, the perplexity, all
    /// logits as `[ids.len(), vocab]`). The pool's counters ([`Engine::pool_stats`]) start
    /// again at zero, as for a generation. The context does not bound it. Errors: fewer
    /// than two ids, an id outside the vocabulary, a forward-pass error.
    pub async fn score(&self, ids: Vec<u32>) -> Result<Score> {
        let shared = self.shared.clone();
        let guard = shared.runner.clone().lock_owned().await;
        tokio::task::spawn_blocking(move || {
            if let Some(pool) = &shared.pool {
                pool.reset_stats();
            }
            let score = guard.score(&ids);
            shared
                .stats
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .requests += 1;
            score
        })
        .await
        .map_err(|e| Error::Internal(format!("scoring task failed: {e}")))?
    }

    /// Starts `request`; its events arrive on the returned stream once earlier requests
    /// are done. Dropping the stream cancels the request. The first event is an error
    /// when [`Engine::encode`] rejects the input, the sampling options are invalid or the
    /// model has no tokenizer.
    pub fn generate(&self, request: Request) -> Generation {
        // Unbounded: a request's events are bounded by its max_tokens, and a slow reader
        // must not hold the engine (and every request behind it) hostage.
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let prefilled = Arc::new(AtomicUsize::new(0));
        let images: Vec<Arc<[u8]>> = match &request.input {
            Input::Chat(chat) => chat.images().map(|i| i.bytes.clone()).collect(),
            Input::IdsWithImages(_, images) => images.clone(),
            Input::Text(_) | Input::Ids(_) => Vec::new(),
        };
        let prepared = self.encode(&request.input).and_then(|prompt| {
            request.sampling.validate()?;
            // The tokens are decoded as they come.
            self.shared.front.tokenizer()?;
            let options = GenerateOptions {
                // Generation itself stops at the context.
                max_tokens: request.max_tokens,
                sampling: request.sampling,
                eos_ids: self.shared.front.eos.clone(),
                cancel: Some(cancel.clone()),
                prefilled: Some(prefilled.clone()),
                draft_tokens: 0,
                logprobs: request.logprobs,
                constraint: request.constraint,
            };
            Ok((prompt, options))
        });
        match prepared {
            Err(e) => {
                let _ = tx.send(Err(e));
            }
            Ok((prompt, mut options)) => {
                let shared = self.shared.clone();
                shared.waiting.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let guard = shared.runner.clone().lock_owned().await;
                    // Drafts for a lone request: one that starts with others queued decodes
                    // plainly (each verify pass reads more experts, which queued requests'
                    // records compete with in the pool).
                    let others = shared.waiting.fetch_sub(1, Ordering::SeqCst) - 1;
                    if others == 0 {
                        options.draft_tokens = shared.draft_tokens;
                    }
                    if tx.is_closed() {
                        return; // cancelled while queued
                    }
                    let tx2 = tx.clone();
                    let outcome = tokio::task::spawn_blocking(move || {
                        guard.run(&prompt, &images, &options, &shared, &tx2)
                    })
                    .await;
                    let err = match outcome {
                        Ok(Ok(())) => return,
                        Ok(Err(e)) => e,
                        Err(e) => Error::Internal(format!("generation task failed: {e}")),
                    };
                    let _ = tx.send(Err(err));
                });
            }
        }
        Generation {
            events: futures::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|e| (e, rx))
            })
            .boxed(),
            cancel,
            prefilled,
        }
    }
}

/// The events of one request ([`Engine::generate`]): a stream of [`Event`]s ending with
/// [`Event::Done`] or an error.
pub struct Generation {
    events: BoxStream<'static, Result<Event>>,
    cancel: Arc<AtomicBool>,
    prefilled: Arc<AtomicUsize>,
}

impl Generation {
    /// Stops generating at the next token (or prompt chunk, during prefill); the stream
    /// still ends with [`Event::Done`] (finish reason "stopped") and its statistics.
    /// Dropping the stream also stops the request, without the `Done` event.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// A handle that cancels this request as [`Generation::cancel`] does, from anywhere
    /// (a Ctrl-C handler) and for as long as it is kept.
    pub fn cancel_handle(&self) -> CancelHandle {
        CancelHandle(self.cancel.clone())
    }

    /// A handle that reads how far this request's prefill has come.
    pub fn progress(&self) -> PrefillProgress {
        PrefillProgress(self.prefilled.clone())
    }
}

/// How far a request's prefill has come ([`Generation::progress`]); cheap to clone,
/// `Send + Sync`.
#[derive(Clone, Debug)]
pub struct PrefillProgress(Arc<AtomicUsize>);

impl PrefillProgress {
    /// Prompt tokens run so far (updated after each chunk; tokens reused from a snapshot
    /// are not run).
    pub fn tokens(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// Cancels one request ([`Generation::cancel_handle`]); cheap to clone, `Send + Sync`.
#[derive(Clone, Debug)]
pub struct CancelHandle(Arc<AtomicBool>);

impl CancelHandle {
    /// As [`Generation::cancel`]; no effect once the request has ended.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.cancel();
    }
}

impl Stream for Generation {
    type Item = Result<Event>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.events.poll_next_unpin(cx)
    }
}

/// A model loaded on one backend ([`load_on`]), with its pool and the plan that sized it.
struct Opened<B: Backend> {
    loaded: Loaded<B>,
    pool: Option<Arc<SlotPool>>,
    plan: Option<Plan>,
    /// The context in effect (an automatic one may have shrunk to fit the plan).
    context: usize,
}

fn load_on<B: Backend + 'static>(
    backend: B,
    ckpt: &Arc<Checkpoint>,
    options: &EngineOptions,
    runtime: tokio::runtime::Handle,
) -> Result<Opened<B>> {
    let mut model = Model::load(ckpt, &backend)?;
    let has_head = Model::<B>::has_mtp(ckpt);
    // Whether the head will draft, so that a memory plan counts it.
    let drafting = match options.mtp.mode {
        MtpMode::On => true,
        MtpMode::Auto => has_head && backend.multi_position_passes_pay(),
        MtpMode::Off => false,
    };
    let source = open_source(
        &backend,
        ckpt,
        Arc::new(model.experts.clone()),
        &SourceOptions {
            prompt_cache: options.prompt_cache.memory,
            vision: options.vision == VisionMode::Auto,
            mtp: drafting,
            ..options.source.clone()
        },
        runtime,
    )?;
    let context = model.set_context(source.context);
    match options.mtp.mode {
        MtpMode::On if !has_head => {
            return Err(Error::InvalidInput(format!(
                "--mtp on: {} has no MTP head (no {} tensor); give its weights with --mtp-weights",
                ckpt.dir.display(),
                ckpt.config.name("mtp.fc.weight")
            )))
        }
        MtpMode::On => model.load_mtp(ckpt, &backend)?,
        MtpMode::Auto if has_head && !backend.multi_position_passes_pay() => tracing::info!(
            "MTP head not used: on this backend a verify pass costs about as many decode steps as it has positions, so drafts slow decoding (BENCHMARKS.md; --mtp on uses it)"
        ),
        // The plan, when there is one, has counted the head.
        MtpMode::Auto if has_head => model.load_mtp(ckpt, &backend)?,
        MtpMode::Auto | MtpMode::Off => {}
    }
    if model.drafts() {
        tracing::info!(
            draft_tokens = options.mtp.draft_tokens,
            "MTP head loaded: decoding drafts and verifies"
        );
    }
    let cache = PromptCache::open(ckpt, &model, &backend, &options.prompt_cache)?;
    let loaded = Loaded {
        backend,
        model,
        experts: source.experts,
        cache: Mutex::new(cache),
        vision: Vision {
            ckpt: ckpt.clone(),
            mode: options.vision,
            tower: OnceLock::new(),
            recent: Mutex::new(Vec::new()),
        },
    };
    Ok(Opened {
        loaded,
        pool: source.pool,
        plan: source.plan,
        context,
    })
}

impl<B: Backend> Runner for Loaded<B> {
    fn ngram_tables(&self) -> Vec<Arc<NgramTable>> {
        self.model.ngram_tables()
    }

    fn score(&self, ids: &[u32]) -> Result<Score> {
        crate::score::score(&self.model, &self.backend, &self.experts, ids)
    }

    fn drafts(&self) -> bool {
        self.model.drafts()
    }

    fn prompt_cache_stats(&self) -> PromptCacheStats {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).stats()
    }

    fn prefill_chunk(&self) -> usize {
        self.model.prefill_chunk(&self.backend, Logits::Last)
    }

    fn run(
        &self,
        prompt: &[u32],
        images: &[Arc<[u8]>],
        options: &GenerateOptions,
        shared: &Shared,
        events: &mpsc::UnboundedSender<Result<Event>>,
    ) -> Result<()> {
        let image_token = (self.model.config.vision.as_ref()).map(|v| v.image_token_id);
        let placeholders = image_token.map_or(0, |t| prompt.iter().filter(|&&p| p == t).count());
        let (expanded, images) = match (images, placeholders) {
            ([], 0) => (None, Vec::new()),
            // Checked before the tower runs (or loads): a placeholder without its image
            // would run as the plain token embedding, a silent wrong answer.
            (images, found) if images.len() != found => {
                if !images.is_empty() {
                    self.vision.available()?;
                }
                return Err(Error::InvalidInput(format!(
                    "the prompt has {found} image placeholders for {} images",
                    images.len()
                )));
            }
            (images, _) => {
                let images = self.vision.embed(images)?;
                let image_token = image_token.unwrap_or(u32::MAX);
                let expanded = expand_placeholders(prompt, image_token, &images)?;
                crate::context::room(expanded.len(), shared.front.context)?;
                (Some(expanded), images)
            }
        };
        let prompt = expanded.as_deref().unwrap_or(prompt);
        // Requests run one at a time (the engine's runner lock): this never waits.
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pool) = &shared.pool {
            pool.reset_stats();
        }
        let tokenizer = shared.front.tokenizer()?;
        let mut decoder = StreamDecoder::new();
        let generated = cache.generate_with_images(
            &self.model,
            &self.backend,
            &self.experts,
            prompt,
            &images,
            options,
            |sampled| {
                let text = decoder.push(tokenizer, sampled.id)?;
                let token = Event::Token {
                    id: sampled.id,
                    text,
                    logprobs: sampled.logprobs.clone(),
                };
                // A closed channel means the caller dropped the stream: stop.
                Ok(events.send(Ok(token)).is_ok())
            },
        );
        {
            let mut s = shared.stats.lock().unwrap_or_else(|e| e.into_inner());
            s.requests += 1;
            s.prompt_cache = cache.stats();
            // A prompt shorter than a chunk says little of a long one's rate.
            if let Ok(g) = &generated {
                s.drafted += g.stats.drafted as u64;
                s.accepted += g.stats.accepted as u64;
                s.verify_passes += g.stats.verify_passes as u64;
                if g.stats.prompt_tokens >= self.prefill_chunk() && g.stats.prefill_tps > 0.0 {
                    s.prefill_rate = Some(g.stats.prefill_tps);
                }
            }
        }
        let generated = generated?;
        let tail = decoder.finish(tokenizer)?;
        let _ = events.send(Ok(Event::Done {
            output_ids: generated.output_ids,
            tail,
            reused_tokens: generated.reused_tokens,
            stats: generated.stats,
            pool: shared.pool.as_ref().map(|p| p.stats()),
        }));
        // After the reply: a client does not wait for the disk.
        cache.save(&self.model, &self.backend);
        shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .prompt_cache = cache.stats();
        Ok(())
    }
}
