//! `slotstream bench`: speed at several pool sizes beside its limits.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;

use slotstream::backend::gpu::GpuOptions;
use slotstream::backend::{open_compute, Compute};
use slotstream::checkpoint::Checkpoint;

use super::flags::{IoArgs, OnOff};

#[derive(Args)]
pub struct BenchArgs {
    /// Model directory (for example one written by `slotstream synth`).
    #[arg(short, long)]
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
    /// Replay drafter rows (a benchmark of the drafting mechanism, not a user feature):
    /// for each acceptance p, comma-separated, a row drafting with the checkpoint's MTP
    /// head whose drafts are replaced by the plain row's tokens with probability p (a wrong
    /// token otherwise), between two plain rows. Needs a head (`synth --mtp-head`).
    #[arg(long, value_delimiter = ',', value_name = "P")]
    replay: Vec<f64>,
    /// Drafts per step of the replay rows, comma-separated (1 to 4).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    draft_tokens: Vec<usize>,
    /// After each budget's first plain row, time N rounds of a decode step and a verify
    /// pass of 2 to 5 positions, alternately from the same state (the cost of drafting's
    /// verify pass in plain steps).
    #[arg(long, value_name = "N", default_value_t = 0)]
    verify_cost: usize,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also draw the report as an SVG chart here: decode tok/s and hit rate against the
    /// pool's memory, with each row's limit (SVG only: a PNG needs system fonts).
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Compute device: `cpu`, `gpu` (any GPU adapter), or part of an adapter's name.
    #[arg(long)]
    device: Option<String>,
    #[command(flatten)]
    io: IoArgs,
}

pub fn bench(args: BenchArgs) -> Result<()> {
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
        replay: args.replay.clone(),
        draft_tokens: args.draft_tokens.clone(),
        verify_cost: args.verify_cost,
    };
    if args.prompt_len == 0 {
        bail!("--prompt-len must be at least 1");
    }
    if let Some(path) = &args.plot {
        slotstream::atomic_file::check_writable(path)
            .with_context(|| format!("--plot {}", path.display()))?;
    }
    let runtime = tokio::runtime::Runtime::new().context("starting the I/O runtime")?;
    let drafted = 2 * options.replay.len() * options.draft_tokens.len();
    let steps = (options.budgets.len() * options.lookahead.len() * (1 + drafted)) as u64 + 2;
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
    if let Some(path) = &args.plot {
        slotstream::tools::plot::bench(path, &report)
            .with_context(|| format!("--plot {}", path.display()))?;
        eprintln!("chart written to {}", path.display());
    }
    Ok(())
}
