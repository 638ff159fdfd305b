//! Synthetic routing end to end: a synthetic checkpoint that carries a routing model routes
//! by it (the pool sees its ids), gives the same logits through the pool as from the
//! mapped checkpoint with lookahead on or off, can opt out, and refuses a malformed
//! routing file with a message that names it. The calibration itself is a unit test of
//! `slotstream::routing_model`.

use std::path::Path;
use std::sync::Arc;

use crate::common::{runtime, TINY};

use slotstream::backend::cpu::CpuBackend;
use slotstream::checkpoint::Checkpoint;
use slotstream::experts::MappedExperts;
use slotstream::model::{Logits, Model};
use slotstream::pool::{PoolExperts, SlotPool, StreamOptions};
use slotstream::routing_model::{RoutingModel, RoutingParams, ROUTING_FILE};
use slotstream::tools::synth::write_checkpoint_with;

fn write(dir: &Path, routing: Option<&RoutingParams>) -> (Arc<Checkpoint>, Model<CpuBackend>) {
    write_checkpoint_with(dir, &TINY, TINY.layers, false, routing).unwrap();
    let ckpt = Arc::new(Checkpoint::open(dir).unwrap());
    let model = Model::load(&ckpt, &CpuBackend).unwrap();
    (ckpt, model)
}

fn params(seed: u64) -> RoutingParams {
    RoutingParams {
        seed,
        ..RoutingParams::calibrated()
    }
}

const PROMPT: [u32; 5] = [10, 200, 33, 33, 7];

#[test]
fn pool_sees_the_routing_models_ids_and_logits_match_the_mapped_checkpoint() {
    let seed: u64 = rand::random();
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, model) = write(dir.path(), Some(&params(seed)));
    let routing = model
        .routes
        .synthetic()
        .expect("the routing file is picked up");
    assert_eq!(routing.params.seed, seed);
    let mapped = MappedExperts::new(ckpt.clone(), Arc::new(model.experts.clone()));
    let rt = runtime();
    // The floor: one layer's experts plus the speculative reads.
    let slots = TINY.experts + 8;
    for lookahead in [false, true] {
        let pool = SlotPool::open(
            &ckpt,
            Arc::new(model.experts.clone()),
            StreamOptions::with_slots(slots),
            rt.handle().clone(),
        )
        .unwrap();
        pool.enable_trace();
        let mut pooled = PoolExperts::new(pool.clone());
        pooled.lookahead = lookahead;
        // A short prompt (its lookups go through the pool), then decode steps.
        let (mut s1, mut s2) = (model.new_state(&CpuBackend), model.new_state(&CpuBackend));
        let a = model
            .forward(&CpuBackend, &mut s1, &PROMPT, &pooled, Logits::All)
            .unwrap();
        let b = model
            .forward(&CpuBackend, &mut s2, &PROMPT, &mapped, Logits::All)
            .unwrap();
        assert!(
            a == b,
            "seed {seed}, lookahead {lookahead}: prompt logits differ"
        );
        let decode: Vec<u32> = (0..12).map(|i| (i * 37 % 300) as u32).collect();
        for &id in &decode {
            let a = model
                .forward(&CpuBackend, &mut s1, &[id], &pooled, Logits::Last)
                .unwrap();
            let b = model
                .forward(&CpuBackend, &mut s2, &[id], &mapped, Logits::Last)
                .unwrap();
            assert!(
                a == b,
                "seed {seed}, lookahead {lookahead}: decode logits differ"
            );
        }
        // The decode steps' lookups are exactly the routing model's ids.
        let mut state = routing.new_state();
        for (t, &id) in PROMPT.iter().enumerate() {
            for l in 0..TINY.layers {
                routing.route(&mut state, l, t as u64, id).unwrap();
            }
        }
        let trace = pool.take_trace();
        let steps: std::collections::BTreeSet<u64> = trace.iter().map(|e| e.token).collect();
        let decode_steps: Vec<u64> = steps.into_iter().skip(1).collect();
        assert_eq!(decode_steps.len(), decode.len(), "seed {seed}");
        for (i, (&step, &id)) in decode_steps.iter().zip(&decode).enumerate() {
            for l in 0..TINY.layers {
                let mut want = routing
                    .route(&mut state, l, (PROMPT.len() + i) as u64, id)
                    .unwrap();
                want.sort_unstable();
                let mut got: Vec<u32> = trace
                    .iter()
                    .filter(|e| e.token == step && e.layer as usize == l)
                    .map(|e| e.expert)
                    .collect();
                got.sort_unstable();
                assert_eq!(
                    got, want,
                    "seed {seed}, lookahead {lookahead}: step {i}, layer {l}"
                );
            }
        }
        let stats = pool.stats();
        if lookahead {
            assert!(
                stats.prefetches_used > 0,
                "seed {seed}: the forecast prefetched nothing useful: {stats:?}"
            );
        } else {
            assert_eq!(stats.speculative_reads, 0, "seed {seed}");
        }
    }
}

#[test]
fn opting_out_keeps_the_router_and_removes_a_stale_file() {
    let dir = tempfile::tempdir().unwrap();
    let (_, model) = write(dir.path(), Some(&params(1)));
    assert!(model.routes.synthetic().is_some());
    let (_, model) = write(dir.path(), None);
    assert!(model.routes.synthetic().is_none());
    assert!(!dir.path().join(ROUTING_FILE).exists());
}

#[test]
fn a_malformed_routing_file_is_refused_naming_the_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint_with(dir.path(), &TINY, TINY.layers, false, Some(&params(1))).unwrap();
    let path = dir.path().join(ROUTING_FILE);
    let load = || match Model::load(&Checkpoint::open(dir.path()).unwrap(), &CpuBackend) {
        Ok(_) => panic!("a malformed routing file was accepted"),
        Err(e) => e.to_string(),
    };
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("\"active_fraction\": 0.42", "\"active_fraction\": 0"),
    )
    .unwrap();
    let e = load();
    assert!(
        e.contains(ROUTING_FILE) && e.contains("active_fraction"),
        "{e}"
    );
    std::fs::write(&path, text.replace("\"seed\"", "\"sead\"")).unwrap();
    let e = load();
    assert!(e.contains(ROUTING_FILE) && e.contains("sead"), "{e}");
    std::fs::write(&path, "not json").unwrap();
    let e = load();
    assert!(e.contains(ROUTING_FILE), "{e}");
}

#[test]
fn calibration_command_reports_the_figures() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.csv");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .args([
            "routing-calibration",
            "--preset",
            "demo",
            "--steps",
            "40",
            "--json",
            "--trace",
        ])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let f = &v["figures"];
    assert!(
        f["touched"].as_u64().unwrap() > 0
            && f["belady"].as_f64().unwrap() >= f["lru"].as_f64().unwrap(),
        "{v}"
    );
    // The trace replays in cachesim to the same numbers.
    let requests = slotstream::tools::cachesim::read_trace(&trace).unwrap();
    let model = RoutingModel::new(RoutingParams::calibrated(), 8, 64, 4).unwrap();
    assert_eq!(
        requests,
        model.trace(&(0..8).collect::<Vec<_>>(), 40).unwrap()
    );
}

/// With every record resident (loaded before the first step), steps route through
/// `ExpertSource::resident_layer` (no per-layer lookups): the logits still equal the mapped
/// checkpoint's and the trace still shows exactly the routing model's ids, all hits.
#[test]
fn every_record_resident_counts_the_routing_models_ids() {
    use slotstream::records::ExpertSource;
    let seed: u64 = rand::random();
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, model) = write(dir.path(), Some(&params(seed)));
    let routing = model.routes.synthetic().unwrap();
    let mapped = MappedExperts::new(ckpt.clone(), Arc::new(model.experts.clone()));
    let rt = runtime();
    let index = Arc::new(model.experts.clone());
    let pool = SlotPool::open(
        &ckpt,
        index.clone(),
        StreamOptions::with_slots(index.records()),
        rt.handle().clone(),
    )
    .unwrap();
    let pooled = PoolExperts::new(pool.clone());
    let all: Vec<u32> = (0..TINY.experts as u32).collect();
    for &layer in &index.moe_layers {
        drop(pooled.fetch(layer, &all).unwrap());
    }
    pool.reset_stats();
    pool.enable_trace();
    let (mut s1, mut s2) = (model.new_state(&CpuBackend), model.new_state(&CpuBackend));
    let mut want_ids = Vec::new();
    let mut state = routing.new_state();
    let steps: Vec<Vec<u32>> = std::iter::once(PROMPT.to_vec())
        .chain((0..8).map(|i| vec![(i * 41 % 300) as u32]))
        .collect();
    let mut pos = 0u64;
    for ids in &steps {
        let a = model
            .forward(&CpuBackend, &mut s1, ids, &pooled, Logits::Last)
            .unwrap();
        let b = model
            .forward(&CpuBackend, &mut s2, ids, &mapped, Logits::Last)
            .unwrap();
        assert!(a == b, "seed {seed}: logits differ");
        // The routing model routes position by position, layer by layer within a position.
        let mut per_layer = vec![std::collections::BTreeSet::new(); TINY.layers];
        for (t, &id) in ids.iter().enumerate() {
            for (l, set) in per_layer.iter_mut().enumerate() {
                set.extend(routing.route(&mut state, l, pos + t as u64, id).unwrap());
            }
        }
        pos += ids.len() as u64;
        want_ids.push(per_layer);
    }
    let trace = pool.take_trace();
    assert!(trace
        .iter()
        .all(|e| e.outcome == slotstream::pool::Outcome::Hit));
    let tokens: std::collections::BTreeSet<u64> = trace.iter().map(|e| e.token).collect();
    assert_eq!(tokens.len(), steps.len(), "seed {seed}");
    for (step, (token, want)) in tokens.iter().zip(&want_ids).enumerate() {
        for (l, want) in want.iter().enumerate() {
            let got: std::collections::BTreeSet<u32> = trace
                .iter()
                .filter(|e| e.token == *token && e.layer as usize == l)
                .map(|e| e.expert)
                .collect();
            assert_eq!(&got, want, "seed {seed}: step {step}, layer {l}");
        }
    }
    assert_eq!(pool.stats().misses, 0);
    assert_eq!(pool.pinned_slots(), 0);
}

/// Whole-layer routing on the backend is for pools that hold every record: a streaming
/// pool that happens to hold all of a layer's experts still serves them one lookup at a
/// time (otherwise it would pin the whole layer for each step).
#[test]
fn only_a_pool_of_every_record_offers_resident_layers() {
    use slotstream::records::ExpertSource;
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, model) = write(dir.path(), None);
    let rt = runtime();
    let index = Arc::new(model.experts.clone());
    let all: Vec<u32> = (0..TINY.experts as u32).collect();
    let layer = index.moe_layers[0];
    for (slots, offered) in [(index.records() - 1, false), (index.records(), true)] {
        let pool = SlotPool::open(
            &ckpt,
            index.clone(),
            StreamOptions::with_slots(slots),
            rt.handle().clone(),
        )
        .unwrap();
        let pooled = PoolExperts::new(pool.clone());
        drop(pooled.fetch(layer, &all).unwrap());
        assert_eq!(
            pooled.resident_layer(layer).is_some(),
            offered,
            "{slots} slots of {} records",
            index.records()
        );
        assert_eq!(pool.pinned_slots(), 0);
    }
}
