//! `slotstream plan`: the plan a run would take (from the machine, or within
//! `--memory-budget`), and how its budget splits.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use slotstream::checkpoint::{Checkpoint, ExpertIndex};
use slotstream::plan::{AutoPlan, ContextCost, Footprint};

use super::flags::{BudgetArgs, CacheSize, ContextSize};

#[derive(Args)]
pub struct PlanArgs {
    /// Model directory (an MLX checkpoint).
    #[arg(short, long)]
    model: PathBuf,
    #[command(flatten)]
    budget: BudgetArgs,
    /// Context to reserve KV cache for, in tokens. Default: auto, as `generate` takes it.
    #[arg(short, long, visible_aliases = ["ctx-size", "max-context"], value_parser = super::flags::parse_context)]
    context: Option<ContextSize>,
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

pub fn plan(args: PlanArgs) -> Result<()> {
    let ckpt = Checkpoint::open(&args.model).context("opening the model")?;
    let index = ExpertIndex::build(&ckpt)?;
    let Some(target) = args.budget.target() else {
        bail!("the machine's memory could not be read: give --memory-budget or --memory-limit");
    };
    // As a run that drafts with the checkpoint's MTP head, when it has one.
    let fp = Footprint::new(
        &ckpt,
        &index,
        args.queue_depth,
        slotstream::backend::PREFILL_CHUNK,
    )
    .drafting(true, &ckpt.config);
    let context = match ContextSize::tokens(args.context) {
        Some(c) => slotstream::context::limit(c, &ckpt.config),
        None => ContextCost::of(&ckpt.config).auto_context(target.bytes),
    };
    let cache = CacheSize::term(
        Some(args.prompt_cache.unwrap_or(CacheSize::Bytes(0))),
        Some(target.bytes),
    )?;
    let plan = AutoPlan::choose(&fp, target, context, cache)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        println!("{}", plan.describe());
        if let Some(streamed) = &plan.streamed {
            print!("{}", streamed.table());
        }
    }
    Ok(())
}
