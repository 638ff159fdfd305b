//! The whole Qwen3-Next / Qwen3.5-MoE forward pass on the GPU backend against mlx-lm's fixtures, with
//! experts from the mapped checkpoint and streamed through slot pools from the floor to
//! every record (mirrored into device arenas). Fails (never skips) without an adapter.

mod common;

use std::sync::Arc;

use common::*;
use slotstream::backend::gpu::{GpuBackend, Placement};
use slotstream::backend::Backend;
use slotstream::checkpoint::Checkpoint;
use slotstream::experts::{ExpertSource, MappedExperts};
use slotstream::io::IoMode;
use slotstream::model::{Logits, Model};
use slotstream::pool::{floor_slots, PoolExperts, SlotPool, StreamOptions};

fn greedy<E: ExpertSource>(
    model: &Model<GpuBackend>,
    g: &GpuBackend,
    experts: &E,
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    let mut state = model.new_state(g);
    let mut logits = model
        .forward(g, &mut state, prompt, experts, Logits::Last)
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = argmax(&logits);
        out.push(next);
        logits = model
            .forward(g, &mut state, &[next], experts, Logits::Last)
            .unwrap();
    }
    out
}

#[test]
fn gpu_forward_matches_mlx_lm_at_every_pool_size() {
    let g = gpu();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for name in FIXTURES {
        let r = reference(name);
        let ckpt = Arc::new(Checkpoint::open(&fixture_dir(name)).unwrap());
        let model = Model::load(&ckpt, &g).unwrap();
        let index = Arc::new(model.experts.clone());
        let mapped = MappedExperts::new(ckpt.clone(), index.clone());

        let s = slotstream::score::score(&model, &g, &mapped, &r.scored_ids).unwrap();
        let mut worst = 0.0f64;
        for t in 0..r.scored_ids.len() {
            let row = t * r.vocab..(t + 1) * r.vocab;
            let e = rel_err(&s.logits[row.clone()], &r.logits[row]);
            assert!(e <= 1e-3, "{name}: position {t}: relative logit error {e}");
            worst = worst.max(e);
        }
        let rel = (s.perplexity - r.perplexity).abs() / r.perplexity;
        assert!(
            rel < 5e-5,
            "{name}: perplexity {} vs mlx-lm {}",
            s.perplexity,
            r.perplexity
        );
        eprintln!(
            "{name} on {}: worst relative logit error {worst:.3e}, perplexity {:.6} vs mlx-lm {:.6} (relative {rel:.1e})",
            g.name(),
            s.perplexity,
            r.perplexity
        );
        assert_eq!(
            greedy(&model, &g, &mapped, &r.prompt_ids, r.greedy_ids.len()),
            r.greedy_ids,
            "{name}: mapped"
        );

        let floor = floor_slots(index.num_experts, 8);
        for placement in [Placement::Unified, Placement::Device] {
            // The floor twice: a second pool of the same shape must not reuse the first one's mirror.
            for slots in [
                floor,
                floor,
                (floor + index.records()) / 2,
                index.records().max(floor),
            ] {
                let mut options = StreamOptions::with_slots(slots);
                options.io = IoMode::Direct;
                let pool =
                    SlotPool::open(&ckpt, index.clone(), options, rt.handle().clone()).unwrap();
                g.place_pool(&pool, placement)
                    .unwrap_or_else(|e| panic!("{placement:?}: {e}"));
                let experts = PoolExperts::new(pool);
                let got = greedy(&model, &g, &experts, &r.prompt_ids, r.greedy_ids.len());
                assert_eq!(
                    got, r.greedy_ids,
                    "{name}: {placement:?} pool of {slots} slots"
                );
            }
        }
    }
}
