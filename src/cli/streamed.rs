//! A model loaded with the expert source the stream flags ask for (`generate`, `chat`,
//! `score`), and what a pool leaves behind when the run ends.

use std::sync::Arc;

use anyhow::{Context, Result};

use slotstream::backend::Backend;
use slotstream::checkpoint::Checkpoint;
use slotstream::experts::{open_source, OpenedSource};
use slotstream::model::Model;
use slotstream::pool::SlotPool;
use slotstream::prompt_cache::{PromptCache, PromptCacheOptions};
use slotstream::tools::cachesim;

use super::flags::{StreamArgs, TraceArgs};

/// A model and the expert source the stream flags ask for (the memory-mapped checkpoint,
/// or a slot pool attached to the backend, tracing if asked), its prompt cache, with the
/// runtime its reads run on. Fields drop in order: the pool before its runtime.
pub struct Streamed<B: Backend> {
    pub model: Model<B>,
    pub source: OpenedSource,
    pub cache: PromptCache<B>,
    pub _runtime: tokio::runtime::Runtime,
}

/// Loads as [`Streamed`] says; a memory budget sets `cache.memory` aside for the prompt
/// cache.
pub fn load_streamed<B: Backend>(
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
pub fn finish_pool(pool: &Option<Arc<SlotPool>>, trace: &TraceArgs, json: bool) -> Result<()> {
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
