//! `slotstream demo`: `generate` on a synthetic model made on first use.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use slotstream::io::IoMode;

use super::flags::{
    BudgetArgs, ContextSize, DraftArgs, IoArgs, OnOff, PrefillArgs, PromptCacheArgs, SamplingArgs,
    StreamArgs, TemplateArgs, TraceArgs, VisionFlag,
};
use super::generate::{run_generate, GenerateArgs};

#[derive(Args)]
pub struct DemoArgs {
    /// Where the demo model lives (default: $XDG_CACHE_HOME/slotstream/demo, else
    /// ~/.cache/slotstream/demo).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 48)]
    max_tokens: usize,
    /// Compute device: `cpu`, `gpu` (any GPU adapter), or part of an adapter's name.
    #[arg(long)]
    device: Option<String>,
    /// Print one JSON object (prompt and output ids, text, timings, the pool's counters)
    /// on stdout instead of the text and the summary.
    #[arg(long)]
    json: bool,
}

pub fn demo(args: DemoArgs) -> Result<()> {
    let dir = match args.dir {
        Some(d) => d,
        None => super::cache_dir().join("demo"),
    };
    let preset = slotstream::tools::synth::DEMO;
    if !dir.join("model.safetensors.index.json").exists() {
        eprintln!(
            "creating the demo model in {} (first run only, 236 MB)",
            dir.display()
        );
        slotstream::tools::synth::write_checkpoint(&dir, &preset, preset.layers, true)
            .with_context(|| format!("writing the demo model to {}", dir.display()))?;
    } else if slotstream::tools::synth::refresh_tokenizer(&dir, &preset)
        .with_context(|| format!("updating the demo model in {}", dir.display()))?
    {
        eprintln!(
            "updated the tokenizer of the demo model in {} (made by an older slotstream)",
            dir.display()
        );
    }
    let cfg = slotstream::config::ModelConfig::load(&dir)?;
    let (layers, experts) = (cfg.moe_layers().len(), cfg.num_experts);
    let records = layers * experts;
    let slots = (records / 3).max(slotstream::pool::floor_slots(
        experts,
        slotstream::pool::DEFAULT_SPECULATIVE_CAP,
    ));
    eprintln!(
        "demo: {layers} layers x {experts} experts = {records} records; pool of {slots} slots; weights are random, so the text is noise"
    );
    let args = GenerateArgs {
        model: dir,
        text: None,
        prompt: Some("Explain how experts are streamed from disk.".into()),
        prompt_file: None,
        prompt_ids: None,
        raw: false,
        images: Vec::new(),
        template: TemplateArgs::default(),
        max_tokens: args.max_tokens,
        sampling: SamplingArgs::default(),
        json_schema: None,
        grammar: None,
        json: args.json,
        device: args.device,
        prompt_cache: PromptCacheArgs::default(),
        stream: StreamArgs {
            pool_slots: Some(slots),
            experts_per_layer: None,
            budget: BudgetArgs::default(),
            io: IoArgs {
                context: Some(ContextSize::Tokens(4096)),
                queue_depth: 32,
                io: IoMode::Direct,
                no_pack: false,
                placement: None,
                mirror: Vec::new(),
            },
            stats: !args.json,
            lookahead: OnOff::On,
            draft: DraftArgs {
                draft_tokens: 1,
                ..DraftArgs::default()
            },
            vision: VisionFlag::Off,
        },
        trace: TraceArgs::default(),
        visible_controls: true,
        prefill: PrefillArgs::default(),
    };
    // The summary alone: the pool's counters as JSON come with --json.
    run_generate(args, false)
}
