//! A prompt longer than a prefill chunk, through a pool smaller than the records, runs
//! layer by layer (`Model::forward`): every chunk through one layer before the next, each
//! layer's routed records read once for the whole prompt. The logits and the greedy
//! continuation are exactly those of the same prompt run chunk by chunk (one forward call
//! per chunk, each of which runs every layer), for the router, a synthetic routing model
//! and Flash-Next's PLE layer (its n-gram rows are per chunk); and the pool reads each
//! record the prompt routes to once, where chunk by chunk reads them once per chunk.

use std::sync::Arc;

use rand::Rng;

use crate::common::{fixture_dir, runtime, QWEN4_EXP, TINY};

use slotstream::backend::cpu::CpuBackend;
use slotstream::backend::PREFILL_CHUNK;
use slotstream::checkpoint::Checkpoint;
use slotstream::model::{Logits, Model};
use slotstream::pool::{PoolExperts, PoolStats, SlotPool, StreamOptions};
use slotstream::records::ExpertSource;
use slotstream::routing_model::RoutingParams;
use slotstream::tools::synth::write_checkpoint_with;

/// What one run of a prompt gave: every position's logits, the greedy tokens after it,
/// and the pool's counters at the end of the prefill.
struct Run {
    logits: Vec<f32>,
    greedy: Vec<u32>,
    prefill: PoolStats,
}

/// Greedy tokens after the prompt.
const GREEDY: usize = 4;

/// `ids` through a fresh pool of `slots` slots: in one forward call (layer by layer, the
/// pool streaming), or one call per chunk (each chunk through every layer); then
/// [`GREEDY`] greedy steps.
fn run(
    ckpt: &Arc<Checkpoint>,
    model: &Model<CpuBackend>,
    slots: usize,
    ids: &[u32],
    layer_major: bool,
) -> Run {
    let rt = runtime();
    let index = Arc::new(model.experts.clone());
    let options = StreamOptions::with_slots(slots);
    let pool = SlotPool::open(ckpt, index.clone(), options, rt.handle().clone()).unwrap();
    let experts = PoolExperts::new(pool.clone());
    assert!(
        experts.streams(),
        "{slots} slots of {} records",
        index.records()
    );
    let b = CpuBackend;
    let mut state = model.new_state(&b);
    let chunk = model.prefill_chunk(&b, Logits::All);
    assert_eq!(chunk, PREFILL_CHUNK);
    let logits = if layer_major {
        // Progress comes after each layer, in tokens' worth of work.
        let mut told = Vec::new();
        let logits = model
            .forward_with_progress(&b, &mut state, ids, &experts, Logits::All, &mut |n| {
                told.push(n)
            })
            .unwrap();
        let layers = model.config.num_hidden_layers;
        let want: Vec<usize> = (1..=layers).map(|l| ids.len() * l / layers).collect();
        assert_eq!(told, want);
        logits
    } else {
        let mut logits = Vec::new();
        for piece in ids.chunks(chunk) {
            logits.extend(
                model
                    .forward(&b, &mut state, piece, &experts, Logits::All)
                    .unwrap(),
            );
        }
        logits
    };
    let prefill = pool.stats();
    experts.end_prefill(true);
    let vocab = model.config.vocab_size;
    let mut last = logits[logits.len() - vocab..].to_vec();
    let mut greedy = Vec::new();
    for _ in 0..GREEDY {
        let next = argmax(&last);
        greedy.push(next);
        last = model
            .forward(&b, &mut state, &[next], &experts, Logits::Last)
            .unwrap();
    }
    Run {
        logits,
        greedy,
        prefill,
    }
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best }) as u32
}

/// Records the pool read for the prefill: sweeps, demand misses and lookahead reads.
fn records_read(st: &PoolStats) -> u64 {
    (st.sweep_bytes + st.demand_bytes + st.speculative_bytes) / st.record_bytes as u64
}

/// Two chunks and a part (fresh random ids below `vocab`), so the last chunk is short.
fn prompt(vocab: usize) -> Vec<u32> {
    let mut rng = rand::rng();
    (0..2 * PREFILL_CHUNK + 45)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect()
}

/// `a` equals `b` bit for bit; the message names the first position that differs.
fn assert_same(a: &Run, b: &Run, vocab: usize, what: &str) {
    assert_eq!(a.logits.len(), b.logits.len(), "{what}");
    if let Some(at) = (0..a.logits.len()).find(|&i| a.logits[i].to_bits() != b.logits[i].to_bits())
    {
        panic!(
            "{what}: logits differ first at position {} (vocab entry {}): {} against {}",
            at / vocab,
            at % vocab,
            a.logits[at],
            b.logits[at]
        );
    }
    assert_eq!(a.greedy, b.greedy, "{what}");
}

/// The tiny synthetic Qwen3-Next (4 MoE layers of 32 experts, top-4) through a pool of
/// 48 slots (of 128 records), routed by its router and by a synthetic routing model:
/// layer by layer gives chunk by chunk's logits and tokens exactly, and reads each
/// routed record once (the records a sweep read ahead for the next layer that no token
/// routed to aside, counted as unused), against once per chunk.
#[test]
fn a_layer_major_prefill_equals_chunk_by_chunk_and_reads_each_record_once() {
    let seed: u64 = rand::random();
    for synthetic in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let routing = RoutingParams {
            seed,
            ..RoutingParams::calibrated()
        };
        write_checkpoint_with(
            dir.path(),
            &TINY,
            TINY.layers,
            false,
            synthetic.then_some(&routing),
        )
        .unwrap();
        let ckpt = Arc::new(Checkpoint::open(dir.path()).unwrap());
        let model = Model::load(&ckpt, &CpuBackend).unwrap();
        assert_eq!(model.routes.synthetic().is_some(), synthetic);
        let ids = prompt(TINY.vocab);
        let what = format!("synthetic routing {synthetic}, seed {seed}, ids {ids:?}");
        let layer_major = run(&ckpt, &model, 48, &ids, true);
        let chunk_major = run(&ckpt, &model, 48, &ids, false);
        assert_same(&layer_major, &chunk_major, TINY.vocab, &what);

        // What the prompt routes to, counted from the routing: the synthetic model's ids
        // (token by token over the whole prompt), or with the router every expert of every
        // layer (hundreds of tokens, top-4 of 32: the last chunk alone touches nearly all).
        let index = &model.experts;
        let routed: u64 = match model.routes.synthetic() {
            Some(m) => {
                let mut state = m.new_state();
                (index.moe_layers.iter())
                    .map(|&l| {
                        let mut e = m.route_chunk(&mut state, l, 0, &ids, false).unwrap().ids;
                        e.sort_unstable();
                        e.dedup();
                        e.len() as u64
                    })
                    .sum()
            }
            None => index.records() as u64,
        };
        let st = &layer_major.prefill;
        assert_eq!(records_read(st) - st.sweep_unused, routed, "{what}: {st:?}");
        assert!(
            st.sweep_unused <= index.records() as u64 - routed,
            "{what}: {st:?}"
        );
        // Chunk by chunk, each chunk reads what it routes to that is not in a slot.
        let old = &chunk_major.prefill;
        assert!(records_read(old) > records_read(st), "{what}: {old:?}");
    }
}

/// Flash-Next (hyper-connections, QSA attention, a PLE layer whose n-gram rows each chunk
/// reads after its own history) through a pool of half its records: layer by layer gives
/// chunk by chunk's logits and tokens exactly.
#[test]
fn a_layer_major_prefill_of_flash_next_equals_chunk_by_chunk() {
    let ckpt = Arc::new(Checkpoint::open(&fixture_dir(QWEN4_EXP)).unwrap());
    let model = Model::load(&ckpt, &CpuBackend).unwrap();
    assert_eq!(model.ngram_tables().len(), 1, "one PLE layer");
    let vocab = model.config.vocab_size;
    let ids = prompt(vocab);
    let slots = model.experts.records() / 2;
    let layer_major = run(&ckpt, &model, slots, &ids, true);
    let chunk_major = run(&ckpt, &model, slots, &ids, false);
    assert_same(&layer_major, &chunk_major, vocab, &format!("ids {ids:?}"));
}
