//! `slotstream score`: teacher-forced log-likelihood and perplexity.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use slotstream::prompt_cache::PromptCacheOptions;

use super::flags::{IdList, StreamArgs, TraceArgs};
use super::load::{engine_options, open, Loaded};

#[derive(Args)]
pub struct ScoreArgs {
    /// Model directory (config.json, safetensors shards, tokenizer.json).
    #[arg(short, long)]
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
    let text = match (&args.ids, &args.text) {
        (Some(_), None) => None,
        (None, Some(text)) => Some(text),
        _ => bail!("give exactly one of --ids or --text"),
    };
    for path in [&args.logits_out, &args.trace.trace].into_iter().flatten() {
        slotstream::atomic_file::check_writable(path)
            .with_context(|| format!("output {}", path.display()))?;
    }
    // A fresh sequence: no snapshots to take or reuse.
    let off = PromptCacheOptions {
        memory: 0,
        ..Default::default()
    };
    let options = engine_options(
        args.device.clone(),
        &args.stream,
        args.trace.trace.is_some(),
        |_| Ok((off, None)),
    )?;
    // The text is tokenized before the weights load; ids need no tokenizer.json.
    let prepared = open(&args.model, options)?;
    let ids = match (text, &args.ids) {
        (Some(text), _) => prepared.tokenizer()?.encode(text)?,
        (None, ids) => ids.as_ref().map_or_else(Vec::new, |ids| ids.0.clone()),
    };
    let loaded = Loaded::load(prepared)?;
    let s = loaded.block_on(loaded.engine.score(ids))?;
    loaded.finish(&args.trace, args.stream.stats)?;
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
