//! `slotstream score`: teacher-forced log-likelihood and perplexity.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;

use slotstream::backend::gpu::GpuOptions;
use slotstream::backend::{open_compute, Backend, Compute};
use slotstream::checkpoint::Checkpoint;
use slotstream::prompt_cache::PromptCacheOptions;
use slotstream::score::Score;
use slotstream::tokenizer::Tokenizer;

use super::flags::{IdList, StreamArgs, TraceArgs};
use super::streamed::{finish_pool, load_streamed};

#[derive(Args)]
pub struct ScoreArgs {
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

pub fn score(args: ScoreArgs) -> Result<()> {
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
