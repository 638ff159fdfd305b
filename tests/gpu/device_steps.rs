//! What only a GPU does with the whole forward pass: with every record resident, steps
//! route on the device and wait once per step (at every placement and arena size, and with
//! a routing model's ids), a decode step's dispatches stay within today's counts, and a
//! prefill chunk's dispatches do not grow with its tokens.
//! Parity with the fixtures' oracles on every backend is tests/integration/parity.rs.
//! Fails (never skips) without an adapter.

use std::sync::Arc;

use crate::common::*;
use slotstream::backend::gpu::Placement;
use slotstream::checkpoint::Checkpoint;
use slotstream::experts::MappedExperts;
use slotstream::io::IoMode;
use slotstream::model::{Logits, Model};
use slotstream::pool::{PoolExperts, SlotPool, StreamOptions};
use slotstream::records::ExpertSource;

/// With every record resident (loaded before the first step), steps route on the device,
/// a long prompt's (its routes grouped by record on the device, in tiles) as well as short
/// ones: the top-k ids never come back per layer, only once per step with the logits
/// (one wait per step), and the logits equal the mapped path's. The lookups are still
/// counted (all hits, one trace event each) and every pin is released after each step.
/// The decode steps' dispatches (one arena) are checked against [`DECODE_DISPATCHES`].
#[test]
fn gpu_steps_with_every_record_resident_route_on_the_device() {
    let g = gpu();
    let rt = runtime();
    for name in FIXTURES {
        let r = reference(name);
        let ckpt = Arc::new(Checkpoint::open(&fixture_dir(name)).unwrap());
        let model = Model::load(&ckpt, &g).unwrap();
        let index = Arc::new(model.experts.clone());
        let mapped = MappedExperts::new(ckpt.clone(), index.clone());
        // A long prompt of fresh random ids (300 tokens: about 75 routes an expert, top-4
        // of 16, so an expert's routes fill more than one tile of 64), a middle one (72
        // tokens: about 18 routes an expert, in narrow tiles of 16), a short one (the last
        // tokens of the fixture's), then its greedy ids one by one. A model with a QSA
        // indexer skips the first two: past the indexer's budget of keys, QSA reads its
        // keys back (waits of its own), which this test does not count.
        let random_ids = |n: usize| -> Vec<u32> {
            let qsa = model
                .config
                .flash_next
                .as_ref()
                .and_then(|f| f.indexer.as_ref());
            match qsa {
                None => (0..n)
                    .map(|_| rand::random_range(0..model.config.vocab_size as u32))
                    .collect(),
                Some(_) => Vec::new(),
            }
        };
        let (long, middle) = (random_ids(300), random_ids(72));
        let prompt = &r.prompt_ids[r.prompt_ids.len() - 5..];
        let decode_steps = 12;
        let steps: Vec<&[u32]> = [long.as_slice(), middle.as_slice(), prompt]
            .into_iter()
            .filter(|ids| !ids.is_empty())
            .chain(r.greedy_ids[..decode_steps].chunks(1))
            .collect();
        let mut state = model.new_state(&g);
        let want: Vec<Vec<f32>> = steps
            .iter()
            .map(|ids| {
                model
                    .forward(&g, &mut state, ids, &mapped, Logits::Last)
                    .unwrap()
            })
            .collect();
        // One arena, then arenas of 7 slots: a layer's records then lie in several arenas
        // (as a large pool's do on a GPU), and each projection runs once per arena.
        // Device placement copies slots from the pool's imported memory, or (last) through
        // staging memory. A limit of a layer and a half holds one layer per arena (arenas
        // hold whole layers where they can), so steps dispatch as with one arena.
        let layer = index.num_experts;
        assert!(layer > 7, "{name}: a layer must straddle arenas of 7 slots");
        let mut one_arena_dispatches = Vec::new();
        for (placement, arena_slots, host_copies) in [
            (Placement::Unified, 0, true),
            (Placement::Device, 0, true),
            (Placement::Unified, 7, true),
            (Placement::Device, 7, true),
            (Placement::Device, 7, false),
            (Placement::Device, layer + layer / 2, true),
        ] {
            let mut options = StreamOptions::with_slots(index.records());
            options.io = IoMode::Direct;
            let pool = SlotPool::open(&ckpt, index.clone(), options, rt.handle().clone()).unwrap();
            g.gpu.limit_arenas((arena_slots * pool.stride()) as u64);
            g.gpu.set_host_copies(host_copies);
            g.place_pool(&pool.memory(), placement).unwrap();
            g.gpu.limit_arenas(0);
            g.gpu.set_host_copies(true);
            let experts = PoolExperts::new(pool.clone());
            let all: Vec<u32> = (0..index.num_experts as u32).collect();
            for &layer in &index.moe_layers {
                drop(experts.fetch(layer, &all).unwrap());
            }
            pool.reset_stats();
            pool.enable_trace();
            let mut state = model.new_state(&g);
            for (i, (ids, want)) in steps.iter().zip(&want).enumerate() {
                let before = g.gpu.counters();
                let got = model
                    .forward(&g, &mut state, ids, &experts, Logits::Last)
                    .unwrap();
                let counted = g.gpu.counters() - before;
                let waits = counted.waits;
                match (placement, arena_slots) {
                    (Placement::Device, 0) => one_arena_dispatches.push(counted.dispatches),
                    (Placement::Device, n) if n > layer => assert_eq!(
                        counted.dispatches, one_arena_dispatches[i],
                        "{name}: arenas of {n} slots: step {i} dispatches"
                    ),
                    _ => {}
                }
                assert_eq!(
                    waits, 1,
                    "{name}: {placement:?}, arenas of {arena_slots}: step {i} waited {waits} times"
                );
                let e = rel_err(&got, want);
                assert!(e <= 1e-6, "{name}: {placement:?}, arenas of {arena_slots}: step {i}: relative logit error {e}");
                assert_eq!(
                    pool.pinned_slots(),
                    0,
                    "{name}: {placement:?}: pins left after step {i}"
                );
            }
            if (placement, arena_slots) == (Placement::Device, 0) {
                check_decode_dispatches(name, &one_arena_dispatches[steps.len() - decode_steps..]);
            }
            let st = pool.stats();
            let trace = pool.take_trace();
            assert_eq!(st.misses, 0, "{name}: {placement:?}");
            assert_eq!(st.hits as usize, trace.len(), "{name}: {placement:?}");
            let k = model.config.num_experts_per_tok;
            // Each step routes k distinct experts per token and MoE layer.
            let least = steps.len() * index.moe_layers.len() * k;
            assert!(
                trace.len() >= least,
                "{name}: {placement:?}: {} lookups, fewer than {least}",
                trace.len()
            );
            assert!(trace
                .iter()
                .all(|t| (t.expert as usize) < index.num_experts));
        }
    }
}

/// Dispatches a decode step issues with every record resident in one arena, by fixture
/// (4 layers each): today's counts, so a change that adds dispatches to a step fails here
/// and one that removes them lowers these. Issue 18 asks for at most 6 a layer plus a
/// constant; Qwen3-Next takes about 12 a layer today (the MoE combine also adds the
/// residual and norms it), Flash-Next (hyper-connections, PLE) about 30.
const DECODE_DISPATCHES: [(&str, u64); 4] = [
    ("qwen3-next-bf16", 53),
    ("qwen3-next-f32-sharded", 53),
    ("qwen3_5-moe-bf16", 61),
    ("qwen4-exp-bf16", 129),
];

/// Asserts that every decode step of fixture `name` (`counts`, one token each) issues the
/// same number of dispatches, at most its [`DECODE_DISPATCHES`].
fn check_decode_dispatches(name: &str, counts: &[u64]) {
    let (_, most) = DECODE_DISPATCHES
        .iter()
        .find(|(fixture, _)| *fixture == name)
        .unwrap_or_else(|| panic!("{name}: no decode dispatch count"));
    eprintln!("{name}: {counts:?} dispatches a decode step");
    assert!(
        counts.iter().all(|&c| c == counts[0]),
        "{name}: decode steps issue {counts:?} dispatches"
    );
    assert!(
        counts[0] <= *most,
        "{name}: a decode step issues {} dispatches, over {most}",
        counts[0]
    );
}

/// The same with a synthetic routing model (as `slotstream bench` runs): its ids go to the
/// device with the layer's step, and the logits equal the mapped path's.
#[test]
fn gpu_steps_with_every_record_resident_take_a_routing_models_ids() {
    use slotstream::routing_model::RoutingParams;
    use slotstream::tools::synth::write_checkpoint_with;
    let g = gpu();
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let params = RoutingParams {
        seed: rand::random(),
        ..RoutingParams::calibrated()
    };
    write_checkpoint_with(dir.path(), &TINY, TINY.layers, false, Some(&params)).unwrap();
    let ckpt = Arc::new(Checkpoint::open(dir.path()).unwrap());
    let model = Model::load(&ckpt, &g).unwrap();
    assert!(model.routes.synthetic().is_some());
    let index = Arc::new(model.experts.clone());
    let mapped = MappedExperts::new(ckpt.clone(), index.clone());
    for placement in [Placement::Unified, Placement::Device] {
        let pool = SlotPool::open(
            &ckpt,
            index.clone(),
            StreamOptions::with_slots(index.records()),
            rt.handle().clone(),
        )
        .unwrap();
        g.place_pool(&pool.memory(), placement).unwrap();
        let experts = PoolExperts::new(pool.clone());
        let all: Vec<u32> = (0..TINY.experts as u32).collect();
        for &layer in &index.moe_layers {
            drop(experts.fetch(layer, &all).unwrap());
        }
        pool.reset_stats();
        let (mut s1, mut s2) = (model.new_state(&g), model.new_state(&g));
        let steps: Vec<Vec<u32>> = std::iter::once(vec![10, 200, 33, 33, 7])
            .chain((0..8).map(|i| vec![i * 41 % 300]))
            .collect();
        for (i, ids) in steps.iter().enumerate() {
            let before = g.gpu.counters();
            let a = model
                .forward(&g, &mut s1, ids, &experts, Logits::Last)
                .unwrap();
            assert_eq!(
                (g.gpu.counters() - before).waits,
                1,
                "{placement:?}: step {i}"
            );
            let b = model
                .forward(&g, &mut s2, ids, &mapped, Logits::Last)
                .unwrap();
            let e = rel_err(&a, &b);
            assert!(
                e <= 1e-6,
                "seed {}: {placement:?}: step {i}: relative logit error {e}",
                params.seed
            );
        }
        assert_eq!(pool.stats().misses, 0);
        assert_eq!(pool.pinned_slots(), 0);
    }
}

/// A prefill chunk's dispatches do not grow with its tokens: every matmul, the grouped
/// expert GEMM, the gated delta recurrence and attention take a whole chunk per dispatch,
/// so 32 tokens (the fewest that prefill as a chunk rather than token by token) and 256
/// tokens issue the same number, on each fixture.
#[test]
fn prefill_dispatches_do_not_grow_with_the_chunk() {
    use rand::Rng;
    let g = gpu();
    let mut rng = rand::rng();
    for name in FIXTURES {
        let ckpt = Arc::new(Checkpoint::open(&fixture_dir(name)).unwrap());
        let model = Model::load(&ckpt, &g).unwrap();
        assert!(model.prefill_chunk(&g, Logits::Last) >= 256, "{name}");
        let mapped = MappedExperts::new(ckpt.clone(), Arc::new(model.experts.clone()));
        let vocab = model.config.vocab_size as u32;
        let mut dispatches = |n: usize| {
            let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
            let mut state = model.new_state(&g);
            let before = g.gpu.counters();
            model
                .forward(&g, &mut state, &ids, &mapped, Logits::Last)
                .unwrap();
            (g.gpu.counters() - before).dispatches
        };
        // The first pass also compiles the kernels; counts come from the second.
        dispatches(slotstream::model::SWEEP_MIN_TOKENS);
        let short = dispatches(slotstream::model::SWEEP_MIN_TOKENS);
        let long = dispatches(256);
        assert_eq!(
            short, long,
            "{name}: {short} dispatches for 32 tokens, {long} for 256"
        );
        eprintln!("{name}: {short} dispatches for a chunk of 32 or 256 tokens");
    }
}
