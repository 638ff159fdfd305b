//! The one load path of `generate`, `chat`, `score` and `serve`: an [`Engine`] opened
//! ([`open`]: the prompt is checked then) and loaded with the options their flags give,
//! the runtime it runs on, and what a pool leaves behind when the run ends.

use std::future::Future;
use std::path::Path;

use anyhow::{bail, Context, Result};

use futures::StreamExt;
use slotstream::backend::gpu::GpuOptions;

use slotstream::engine::{Engine, EngineOptions, Event, Generation, Prepared, Request};
use slotstream::experts::{Elastic, PoolSize};
use slotstream::generate::GenerateStats;
use slotstream::pool::PoolStats;
use slotstream::prompt_cache::PromptCacheOptions;
use slotstream::tools::cachesim;

use super::flags::{StreamArgs, TraceArgs};

/// The engine's options from the flags: `device` (`--device`), the stream flags (pool,
/// I/O, lookahead, context), the pool's trace when `trace`, the prompt cache
/// (`prompt_cache` given the memory budget its share is of: `--memory-budget` or the one
/// planned from the machine); the GPU's options from the environment
/// ([`GpuOptions::from_env`]). Without a pool flag the run is planned from the machine
/// ([`PoolSize::Auto`]), with an elastic pool ([`Elastic::os`]) that follows the machine's
/// memory within the plan, and without `--context` the context is chosen for the budget.
/// `prompt_cache` also gives the share of the budget the snapshots take, when they take
/// one (the plan's advice counts it: [`slotstream::plan::smallest_budget`]).
/// Errors: `prompt_cache`'s.
pub fn engine_options(
    device: Option<String>,
    stream: &StreamArgs,
    trace: bool,
    prompt_cache: impl FnOnce(Option<u64>) -> Result<(PromptCacheOptions, Option<f64>)>,
) -> Result<EngineOptions> {
    let mut source = stream.source();
    source.trace = trace;
    let target = stream.budget.target();
    let explicit_slots = matches!(
        source.pool,
        Some(PoolSize::Slots(_) | PoolSize::PerLayer(_))
    );
    match (&source.pool, target) {
        (None, Some(target)) => {
            source.pool = Some(PoolSize::Auto(target));
            source.elastic = target.machine.map(|m| Elastic::os(m.ram()));
        }
        (None, None) => tracing::warn!(
            "the machine's memory could not be read: every record stays mapped, with a context of {} tokens (--memory-budget or --memory-limit plans a run)",
            source.context
        ),
        _ => {}
    }
    if stream.io.context().is_none() {
        source.context_budget = target.map(|t| t.bytes);
    }
    let (prompt_cache, share) = prompt_cache(target.filter(|_| !explicit_slots).map(|t| t.bytes))?;
    source.prompt_cache_share = share;
    Ok(EngineOptions {
        device,
        gpu: GpuOptions::from_env(),
        source,
        prompt_cache,
        mtp: stream.draft.options(),
        vision: stream.vision.mode(),
    })
}

/// Opens the model in `dir` without its weights ([`Engine::open`]), for the prompt to be
/// checked before [`Loaded::load`]. Errors: what the engine reports (after "loading the
/// model"; its errors name the file or directory at fault).
pub fn open(dir: &Path, options: EngineOptions) -> Result<Prepared> {
    Engine::open(dir, options).context("loading the model")
}

/// An engine and the runtime it runs on (the pool's reads, the requests). Fields drop in
/// order: the runtime, whose threads made GPU calls for the engine, ends before the
/// engine's device is destroyed (see [`Engine`]'s note on dropping it).
pub struct Loaded {
    runtime: tokio::runtime::Runtime,
    /// The loaded model.
    pub engine: Engine,
}

impl Loaded {
    /// Starts a runtime and loads the opened model on it ([`Prepared::load`]). Errors: a
    /// runtime that does not start, what the engine reports (after "loading the weights
    /// of DIR": not every error of a weight names the checkpoint).
    pub fn load(prepared: Prepared) -> Result<Self> {
        let runtime = tokio::runtime::Runtime::new().context("starting the runtime")?;
        let dir = prepared.dir().to_path_buf();
        let engine = runtime
            .block_on(prepared.load())
            .with_context(|| format!("loading the weights of {}", dir.display()))?;
        Ok(Loaded { runtime, engine })
    }

    /// Runs `future` (a request on the engine) to completion on the engine's runtime.
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    /// Starts `request` on the engine's runtime ([`Engine::generate`]); its events come
    /// through [`Loaded::block_on`].
    pub fn generate(&self, request: Request) -> Generation {
        let _runtime = self.runtime.enter();
        self.engine.generate(request)
    }

    /// Says on stderr how many tokens `prompt_tokens` is and how long its prefill is
    /// expected to take ([`Engine::prefill_estimate`]). Errors: an estimate over
    /// `max_wait` seconds (`--max-prefill-wait`), with the numbers.
    pub fn announce_prefill(&self, prompt_tokens: usize, max_wait: Option<f64>) -> Result<()> {
        match self.engine.prefill_estimate(prompt_tokens) {
            Some(estimate) => {
                if let Some(why) = max_wait.and_then(|max| estimate.exceeds(max)) {
                    bail!("{why} (--max-prefill-wait)");
                }
                eprintln!(
                    "prompt: {prompt_tokens} tokens; prefill {}",
                    estimate.describe()
                );
            }
            // The estimate comes from a memory plan's reads: none when every record is
            // resident, or when the pool was sized in slots rather than planned.
            None => {
                let why = match self.engine.plan() {
                    Some(_) => "every record is resident",
                    None => {
                        "no memory plan: the pool's size was given, or every record is resident"
                    }
                };
                eprintln!(
                    "prompt: {prompt_tokens} tokens (no prefill estimate before a prompt is measured: {why})"
                )
            }
        }
        Ok(())
    }

    /// Runs `generation` of a prompt of `prompt_tokens` to the end of its stream, passing
    /// each piece of text (and the tail held back at the end) to `on_text` as it comes;
    /// a long prefill shows a progress bar on a terminal ([`PrefillBar`]). The end of the stream, not
    /// only its `Done`: the engine's prompt-cache counters then count the snapshots saved
    /// after the reply. Errors: the request's.
    pub fn finish_generation(
        &self,
        mut generation: Generation,
        prompt_tokens: usize,
        mut on_text: impl FnMut(&str),
    ) -> Result<Reply> {
        let mut text = String::new();
        let mut done = None;
        let mut bar = PrefillBar::start(&generation, prompt_tokens);
        while let Some(event) = self.block_on(generation.next()) {
            // The first event ends the prefill.
            bar.take();
            match event? {
                Event::Token { text: piece, .. } => {
                    on_text(&piece);
                    text.push_str(&piece);
                }
                Event::Done {
                    output_ids,
                    tail,
                    reused_tokens,
                    stats,
                    pool,
                } => {
                    on_text(&tail);
                    text.push_str(&tail);
                    done = Some((output_ids, reused_tokens, stats, pool));
                }
            }
        }
        let (output_ids, reused_tokens, stats, pool) =
            done.context("the engine ended the generation without its summary")?;
        Ok(Reply {
            text,
            output_ids,
            reused_tokens,
            stats,
            pool,
        })
    }

    /// Writes the pool's trace where `--trace` asks, and prints the pool's statistics of
    /// the last request as JSON on stderr when `json` (`--stats`); nothing without a
    /// pool. Errors: the trace file cannot be written.
    pub fn finish(&self, trace: &TraceArgs, json: bool) -> Result<()> {
        self.finish_with(trace, json.then(|| self.engine.pool_stats()).flatten())
    }

    /// [`Loaded::finish`], printing `stats` (a chat's turns added up: the engine counts
    /// each request apart) when given.
    pub fn finish_with(&self, trace: &TraceArgs, stats: Option<PoolStats>) -> Result<()> {
        if self.engine.pool_stats().is_none() {
            return Ok(());
        }
        if let Some(path) = &trace.trace {
            cachesim::write_trace(path, &self.engine.take_trace())
                .with_context(|| format!("writing trace {}", path.display()))?;
        }
        if let Some(stats) = stats {
            eprintln!("{}", serde_json::to_string_pretty(&stats)?);
        }
        Ok(())
    }
}

/// A progress bar on stderr while a long prompt prefills (more than [`BAR_MIN_TOKENS`]
/// tokens, stderr a terminal), fed from the request's [`slotstream::engine::PrefillProgress`]; it goes when
/// dropped.
struct PrefillBar {
    stop: std::sync::mpsc::Sender<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Prompts shorter than this prefill in a moment: no bar.
const BAR_MIN_TOKENS: usize = 1024;

impl PrefillBar {
    fn start(generation: &Generation, prompt_tokens: usize) -> Option<Self> {
        use std::io::IsTerminal;
        if prompt_tokens < BAR_MIN_TOKENS || !std::io::stderr().is_terminal() {
            return None;
        }
        let progress = generation.progress();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let bar = indicatif::ProgressBar::new(prompt_tokens as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "prefill [{bar:40}] {pos}/{len} tokens, {per_sec}, {eta} left",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            // Polled: the engine stores the count after each chunk.
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(std::time::Duration::from_millis(200))
            {
                bar.set_position(progress.tokens() as u64);
            }
            bar.finish_and_clear();
        });
        Some(PrefillBar {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for PrefillBar {
    fn drop(&mut self) {
        let _ = self.stop.send(());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A finished generation ([`Loaded::finish_generation`]).
pub struct Reply {
    /// The text, tail included.
    pub text: String,
    /// The generated ids (the EOS that ended the reply left out).
    pub output_ids: Vec<u32>,
    /// Prompt tokens taken from a snapshot instead of being run.
    pub reused_tokens: usize,
    /// Token counts, rates and the finish reason.
    pub stats: GenerateStats,
    /// The pool's counters for the request, with a pool.
    pub pool: Option<PoolStats>,
}

/// `--image` files as images before a message's text, in order (decoded later, by the
/// engine). Errors: a file that cannot be read, named.
pub fn read_images(
    paths: &[std::path::PathBuf],
) -> Result<Vec<slotstream::chat_template::ChatImage>> {
    (paths.iter())
        .map(|path| {
            let bytes =
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            Ok(slotstream::chat_template::ChatImage {
                at: 0,
                bytes: bytes.into(),
            })
        })
        .collect()
}
