//! `slotstream pack`: every expert record in one aligned file.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use slotstream::checkpoint::Checkpoint;

#[derive(Args)]
pub struct PackArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Output directory (default: the model directory, where the engine looks for it).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn pack(args: PackArgs) -> Result<()> {
    let ckpt = Checkpoint::open(&args.model).context("opening the model")?;
    let index = slotstream::checkpoint::ExpertIndex::build(&ckpt)?;
    let out = args.out.unwrap_or_else(|| args.model.clone());
    let m = slotstream::pack::pack(&ckpt, &index, &out, true)
        .with_context(|| format!("packing into {}", out.display()))?;
    println!(
        "packed {} records of {} bytes ({} layers x {} experts) into {}",
        index.records(),
        m.record_bytes,
        m.moe_layers.len(),
        m.experts,
        out.join(slotstream::pack::PACK_FILE).display()
    );
    Ok(())
}
