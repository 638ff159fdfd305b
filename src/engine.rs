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

use std::path::Path;
use std::sync::Arc;

use futures::stream::{BoxStream, StreamExt};
use tokio::sync::mpsc;

use crate::backend::{open_compute, Backend, Compute};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::experts::{AnyExperts, MappedExperts};
use crate::generate::{GenerateOptions, GenerateStats};
use crate::io::IoMode;
use crate::model::Model;
use crate::pool::{PoolExperts, PoolStats, SlotPool, StreamOptions};
use crate::sampling::SamplingOptions;
use crate::tokenizer::{eos_ids, ChatTemplate, Message, StreamDecoder, Tokenizer};

/// How to load a model.
#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// Stream experts through a pool of this many slots (`None`: read them from the
    /// memory-mapped checkpoint).
    pub pool_slots: Option<usize>,
    /// As the CLI's `--device` (see [`crate::backend::open_compute`]).
    pub device: Option<String>,
    /// Direct (default) or buffered reads.
    pub io: Option<IoMode>,
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// Chat messages, rendered with the model's chat template, or raw token ids.
    pub input: Input,
    pub max_tokens: usize,
    pub sampling: SamplingOptions,
}

/// What a request starts from.
#[derive(Clone, Debug)]
pub enum Input {
    Messages(Vec<Message>),
    Ids(Vec<u32>),
}

impl Request {
    /// A single user message, greedy, up to 256 tokens.
    pub fn prompt(text: &str) -> Self {
        Request {
            input: Input::Messages(vec![Message {
                role: "user".into(),
                content: text.into(),
            }]),
            max_tokens: 256,
            sampling: SamplingOptions::default(),
        }
    }
}

/// What a request's stream yields.
#[derive(Clone, Debug)]
pub enum Event {
    /// A new token and the text it completes (possibly empty while a character is split
    /// across tokens).
    Token { id: u32, text: String },
    /// The end: all output ids, text still held back at the end (an incomplete
    /// character; usually empty), generation statistics and the pool's counters.
    Done {
        output_ids: Vec<u32>,
        tail: String,
        stats: GenerateStats,
        pool: Option<PoolStats>,
    },
}

/// A loaded model, shareable across tasks.
#[derive(Clone)]
pub struct Engine {
    runner: Arc<tokio::sync::Mutex<Box<dyn Runner>>>,
}

/// Runs one request to completion, sending events; object-safe so the engine can hold
/// either backend.
trait Runner: Send + Sync {
    fn run(&self, request: Request, events: &mpsc::UnboundedSender<Result<Event>>) -> Result<()>;
}

struct Loaded<B: Backend> {
    backend: B,
    model: Model<B>,
    experts: AnyExperts,
    pool: Option<Arc<SlotPool>>,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    eos: Vec<u32>,
}

impl Engine {
    /// Loads the model in `dir` (on a blocking thread, so the caller's runtime keeps
    /// serving). Errors: everything [`Checkpoint::open`] and [`Model::load`] report, a
    /// missing tokenizer, a pool below its floor, a GPU that was asked for and is absent.
    pub async fn load(dir: &Path, options: EngineOptions) -> Result<Self> {
        let dir = dir.to_path_buf();
        // The pool's reads run on the caller's runtime.
        let handle = tokio::runtime::Handle::current();
        let runner = tokio::task::spawn_blocking(move || -> Result<Box<dyn Runner>> {
            Ok(match open_compute(options.device.as_deref())? {
                Compute::Cpu(b) => Box::new(load_on(b, &dir, &options, &handle)?),
                Compute::Gpu(b) => Box::new(load_on(*b, &dir, &options, &handle)?),
            })
        })
        .await
        .map_err(|e| Error::InvalidInput(format!("loading task failed: {e}")))??;
        Ok(Engine {
            runner: Arc::new(tokio::sync::Mutex::new(runner)),
        })
    }

    /// Starts `request`; its events arrive on the returned stream once earlier requests
    /// are done. Dropping the stream cancels the request.
    pub fn generate(&self, request: Request) -> BoxStream<'static, Result<Event>> {
        // Unbounded: a request's events are bounded by its max_tokens, and a slow reader
        // must not hold the engine (and every request behind it) hostage.
        let (tx, rx) = mpsc::unbounded_channel();
        let runner = self.runner.clone();
        tokio::spawn(async move {
            let guard = runner.lock_owned().await;
            if tx.is_closed() {
                return; // cancelled while queued
            }
            let tx2 = tx.clone();
            let outcome = tokio::task::spawn_blocking(move || guard.run(request, &tx2)).await;
            let err = match outcome {
                Ok(Ok(())) => return,
                Ok(Err(e)) => e,
                Err(e) => Error::InvalidInput(format!("generation task failed: {e}")),
            };
            let _ = tx.send(Err(err));
        });
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) }).boxed()
    }
}

fn load_on<B: Backend + 'static>(
    backend: B,
    dir: &Path,
    options: &EngineOptions,
    runtime: &tokio::runtime::Handle,
) -> Result<Loaded<B>> {
    let ckpt = Arc::new(Checkpoint::open(dir)?);
    let model = Model::load(&ckpt, &backend)?;
    let index = Arc::new(model.experts.clone());
    let (experts, pool) = match options.pool_slots {
        None => (AnyExperts::Mapped(MappedExperts::new(ckpt.clone(), index)), None),
        Some(slots) => {
            let mut stream = StreamOptions::with_slots(slots);
            if let Some(io) = options.io {
                stream.io = io;
            }
            let pool = SlotPool::open(&ckpt, index, stream, runtime.clone())?;
            backend.attach_pool(&pool, None)?;
            (AnyExperts::Pool(PoolExperts::new(pool.clone())), Some(pool))
        }
    };
    let tokenizer = Tokenizer::load(dir)?;
    Ok(Loaded {
        template: ChatTemplate::load(dir)?,
        eos: eos_ids(dir, &ckpt.config.eos_token_ids, &tokenizer, ckpt.config.vocab_size)?,
        tokenizer,
        backend,
        model,
        experts,
        pool,
    })
}

impl<B: Backend> Runner for Loaded<B> {
    fn run(&self, request: Request, events: &mpsc::UnboundedSender<Result<Event>>) -> Result<()> {
        let prompt = match request.input {
            Input::Ids(ids) => ids,
            Input::Messages(messages) => {
                let text = match &self.template {
                    Some(t) => t.render(&messages)?,
                    None => messages.into_iter().map(|m| m.content).collect::<Vec<_>>().join("\n"),
                };
                self.tokenizer.encode(&text)?
            }
        };
        if prompt.is_empty() {
            return Err(Error::InvalidInput("the prompt is empty".into()));
        }
        let options = GenerateOptions {
            max_tokens: request.max_tokens,
            sampling: request.sampling,
            eos_ids: self.eos.clone(),
        };
        let mut state = self.model.new_state(&self.backend);
        let mut decoder = StreamDecoder::new();
        if let Some(pool) = &self.pool {
            pool.reset_stats();
        }
        let (output_ids, stats) = crate::generate::generate(
            &self.model,
            &self.backend,
            &self.experts,
            &mut state,
            &prompt,
            &options,
            |id| {
                let text = decoder.push(&self.tokenizer, id)?;
                // A closed channel means the caller dropped the stream: stop.
                Ok(events.send(Ok(Event::Token { id, text })).is_ok())
            },
        )?;
        let tail = decoder.finish(&self.tokenizer)?;
        let _ = events.send(Ok(Event::Done {
            output_ids,
            tail,
            stats,
            pool: self.pool.as_ref().map(|p| p.stats()),
        }));
        Ok(())
    }
}
