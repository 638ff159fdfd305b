//! `slotstream synth`: a synthetic checkpoint of a preset.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args)]
pub struct SynthArgs {
    /// demo, qwen3-next-80b-a3b, qwen3.5-35b-a3b or qwen3.8-flash-next.
    #[arg(long)]
    preset: String,
    /// Keep this many layers (every per-layer shape is kept), for small disks. At least 2
    /// for qwen3.8-flash-next, whose layer 1 holds the PLE block and the n-gram table.
    #[arg(long)]
    layers: Option<usize>,
    /// qwen3.8-flash-next only: about N rows for each of the n-gram table's 16 heads
    /// (`ngram_vocab_size_base`, 1 to 20000000) instead of the released 20000000 (32 GB):
    /// a table of about N x 1.6 KB, for small disks and tests. NOT the released shape.
    #[arg(long)]
    ngram_rows: Option<u64>,
    /// The vision tower of qwen3.5-35b-a3b and qwen3.8-flash-next: `released` (27 blocks,
    /// 0.9 GB), `small` (2 blocks of width 64, for tests: NOT the released shape) or `none`
    /// (a text-only checkpoint).
    #[arg(long, value_enum, default_value = "released")]
    vision: SynthVision,
    /// Also write an MTP draft head (`mtp.*`, one full-attention + MoE layer; Qwen3-Next
    /// and Qwen3.5-MoE presets), which `generate --mtp` drafts with.
    #[arg(long)]
    mtp_head: bool,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// `synthetic`: write the calibrated routing model (synthetic_routing.json),
    /// which replaces the random router's expert ids with realistic ones; `router`: keep
    /// the checkpoint's random router (routing almost uniform).
    #[arg(long, value_enum, default_value = "synthetic")]
    routing: SynthRouting,
}

/// Which vision tower a synthetic checkpoint of a multimodal preset carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum SynthVision {
    Released,
    Small,
    None,
}

/// How a synthetic checkpoint routes (see `slotstream::routing_model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum SynthRouting {
    Synthetic,
    Router,
}

pub fn synth(args: SynthArgs) -> Result<()> {
    use slotstream::routing_model::RoutingParams;
    let mut preset = slotstream::tools::synth::preset(&args.preset)?;
    let layers = args.layers.unwrap_or(preset.layers);
    if layers < preset.min_layers() {
        bail!(
            "--layers must be at least {} for {}",
            preset.min_layers(),
            preset.name
        );
    }
    if let Some(rows) = args.ngram_rows {
        preset = preset
            .with_ngram_rows(rows)
            .map_err(|e| anyhow::anyhow!("--ngram-rows {rows}: {e}"))?;
    }
    preset.vision = match (args.vision, preset.vision) {
        (SynthVision::None, _) => None,
        (SynthVision::Released, v) => v,
        (SynthVision::Small, Some(_)) => Some(slotstream::tools::synth::SMALL_VISION_SHAPE),
        (SynthVision::Small, None) => bail!("--vision small: {} has no vision tower", preset.name),
    };
    preset.mtp = args.mtp_head;
    let routing = (args.routing == SynthRouting::Synthetic).then(RoutingParams::calibrated);
    slotstream::tools::synth::write_checkpoint_with(
        &args.out,
        &preset,
        layers,
        true,
        routing.as_ref(),
    )
    .with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "wrote {} ({} layers, {:.2} GB) to {}",
        preset.name,
        layers,
        preset.checkpoint_bytes(layers) as f64 / 1e9,
        args.out.display()
    );
    Ok(())
}
