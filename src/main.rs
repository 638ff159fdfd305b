//! The `slotstream` command line.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use slotstream::backend::cpu::CpuBackend;
use slotstream::checkpoint::Checkpoint;
use slotstream::experts::MappedExperts;
use slotstream::model::Model;
use slotstream::tokenizer::Tokenizer;

#[derive(Parser)]
#[command(name = "slotstream", version, about = "Run Mixture-of-Experts models larger than memory")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Teacher-forced log-likelihood and perplexity of a token sequence.
    Score(ScoreArgs),
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
            part.parse::<u32>()
                .map_err(|_| format!("entry {} (`{part}`) is not a token id (a non-negative integer)", i + 1))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(IdList(ids))
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "slotstream=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Score(args) => score(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn score(args: ScoreArgs) -> Result<()> {
    let ckpt = Arc::new(
        Checkpoint::open(&args.model).with_context(|| format!("opening model {}", args.model.display()))?,
    );
    let ids = match (&args.ids, &args.text) {
        (Some(ids), None) => ids.0.clone(),
        (None, Some(text)) => Tokenizer::load(&args.model)?.encode(text)?,
        _ => bail!("give exactly one of --ids or --text"),
    };
    let backend = CpuBackend;
    let model = Model::load(&ckpt, &backend).context("loading weights")?;
    let experts = MappedExperts::new(ckpt.clone(), Arc::new(model.experts.clone()));
    let s = slotstream::score::score(&model, &backend, &experts, &ids)?;
    println!("tokens: {}", s.tokens);
    println!("mean_nll: {:.6}", s.mean_nll);
    println!("perplexity: {:.6}", s.perplexity);
    if let Some(path) = &args.logits_out {
        slotstream::score::write_npy(path, &s.logits, s.tokens, s.vocab)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("logits: {} [{}, {}] float32", path.display(), s.tokens, s.vocab);
    }
    Ok(())
}
