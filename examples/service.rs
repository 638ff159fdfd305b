//! Embedding slotstream in a tokio service: one `Engine`, shared by several tasks that
//! each stream a reply. Requests run one at a time, in arrival order.
//!
//! `cargo run --release --example service -- [MODEL_DIR]` (default: the demo model, made
//! on first use as `slotstream demo` does).

use futures::StreamExt;
use slotstream::engine::{Engine, EngineOptions, Event, Request};
use slotstream::experts::{PoolSize, SourceOptions};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = match std::env::args().nth(1) {
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
    let engine = Engine::load(
        &dir,
        EngineOptions {
            source: SourceOptions {
                pool: Some(PoolSize::Slots(200)),
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
