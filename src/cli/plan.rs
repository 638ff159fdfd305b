//! `slotstream plan`: how a memory budget splits.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use slotstream::checkpoint::{Checkpoint, ExpertIndex};
use slotstream::plan::Plan;

use super::flags::CacheSize;

#[derive(Args)]
pub struct PlanArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Total memory for the run, e.g. 8GiB.
    #[arg(long, value_parser = slotstream::plan::parse_size)]
    memory_budget: u64,
    /// Context to reserve KV cache for, in tokens.
    #[arg(long, default_value_t = 4096)]
    context: usize,
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
    let plan = Plan::new(
        &ckpt,
        &index,
        args.memory_budget,
        args.context,
        args.queue_depth,
        slotstream::backend::PREFILL_CHUNK,
        CacheSize::bytes(
            Some(args.prompt_cache.unwrap_or(CacheSize::Bytes(0))),
            Some(args.memory_budget),
        )?,
    )?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", plan.table());
    }
    Ok(())
}
