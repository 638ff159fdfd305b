//! Embedding slotstream in a tokio service: one `Engine`, shared by several tasks that
//! each stream a reply. Requests run one at a time, in arrival order.
//!
//! `cargo run --release --example service -- [MODEL_DIR [BUDGET]]`: any model directory
//! (default: the demo model, made on first use as `slotstream demo` does), its pool sized
//! by a memory budget such as `8GiB` (default: planned from the machine, as the
//! `slotstream` command plans it: every record resident when the model fits, else the
//! pool the budget leaves).

use futures::StreamExt;
use slotstream::engine::{Engine, EngineOptions, Event, Request};
use slotstream::experts::{PoolSize, SourceOptions};
use slotstream::machine::MachineMemory;
use slotstream::plan::{parse_size, Target, DEFAULT_MAX_RAM_PERCENT};
use slotstream::prompt_cache::PromptCacheOptions;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = match args.next() {
        Some(d) => std::path::PathBuf::from(d),
        None => {
            let dir = std::env::temp_dir().join("slotstream-example-demo");
            if !dir.join("model.safetensors.index.json").exists() {
                let p = slotstream::tools::synth::DEMO;
                slotstream::tools::synth::write_checkpoint(&dir, &p, p.layers, true)?;
            }
            dir
        }
    };
    let target = match args.next() {
        Some(budget) => Target::fixed(parse_size(&budget).map_err(anyhow::Error::msg)?),
        None => {
            let machine = MachineMemory::probe().ok_or_else(|| {
                anyhow::anyhow!("the machine's memory could not be read: give a BUDGET")
            })?;
            Target::from_machine(machine, DEFAULT_MAX_RAM_PERCENT, None)
        }
    };
    let engine = Engine::load(
        &dir,
        EngineOptions {
            source: SourceOptions {
                pool: Some(PoolSize::Auto(target)),
                // The context the budget affords, as the command chooses it.
                context_budget: Some(target.bytes),
                ..Default::default()
            },
            // Prompt-reuse snapshots take a tenth of the budget, as the command's default.
            prompt_cache: PromptCacheOptions {
                memory: target.bytes / 10,
                ..Default::default()
            },
            device: Some("cpu".into()),
            ..Default::default()
        },
    )
    .await?;
    let mut tasks = Vec::new();
    for (i, question) in ["What is a slot pool?", "Why stream experts?", "Say hi."]
        .into_iter()
        .enumerate()
    {
        let engine = engine.clone();
        tasks.push(tokio::spawn(async move {
            let mut request = Request::prompt(question);
            request.max_tokens = 16;
            let mut events = engine.generate(request);
            let mut text = String::new();
            while let Some(event) = events.next().await {
                match event? {
                    Event::Token { text: piece, .. } => text.push_str(&piece),
                    Event::Done {
                        tail, stats, pool, ..
                    } => {
                        text.push_str(&tail);
                        let hit_rate = pool.map(|p| p.hit_rate).unwrap_or(1.0);
                        println!(
                            "task {i}: {} tokens at {:.1} tok/s, hit rate {:.2}: {:?}",
                            stats.generated_tokens, stats.decode_tps, hit_rate, text
                        );
                    }
                }
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}
