//! Greedy generation equals mlx-lm's ids for every combination of pool size (floor,
//! between, every record), queue depth (1, 32), lookahead (on, off) and I/O mode (direct,
//! buffered), on every fixture, on every backend ([`backend_tests!`]); on the fixtures
//! with an MTP head, also with 1, 2 and 4 drafts verified per step (one run per pool size). On a GPU's portable
//! paths, whose numbers the parity tests check in full, only the pool sizes run (queue
//! depth 32, lookahead on, direct reads): the rest of the matrix is the pool's, not the
//! backend's, and the whole of it there would add minutes on lavapipe.

use std::sync::Arc;

use crate::common::*;
use slotstream::checkpoint::Checkpoint;
use slotstream::generate::{generate, GenerateOptions};
use slotstream::io::IoMode;
use slotstream::model::Model;
use slotstream::pool::{floor_slots, PoolExperts, SlotPool, StreamOptions};

backend_tests!(every_combination_matches_mlx_lm);

fn every_combination_matches_mlx_lm<B: TestBackend>(backend: &B) {
    let rt = runtime();
    let portable = backend.is_portable();
    let (depths, lookaheads, ios): (&[usize], &[bool], &[IoMode]) = if portable {
        (&[32], &[true], &[IoMode::Direct])
    } else {
        (
            &[1, 32],
            &[true, false],
            &[IoMode::Direct, IoMode::Buffered],
        )
    };
    for name in FIXTURES {
        let r = reference(name);
        let want: Vec<u32> = r
            .greedy_ids
            .iter()
            .copied()
            .take_while(|t| ![509, 511].contains(t))
            .collect();
        // A fixture with an MTP head (tools/make_mtp_fixture.py) also runs with drafts.
        let dir = fixture_dir(name);
        let mut ckpt = Checkpoint::open(&dir).unwrap();
        let head = dir.join("mtp.safetensors");
        if head.exists() {
            ckpt.add_file(&head).unwrap();
        }
        let ckpt = Arc::new(ckpt);
        let mut model = Model::load(&ckpt, backend).unwrap();
        if head.exists() {
            model.load_mtp(&ckpt, backend).unwrap();
        }
        let index = Arc::new(model.experts.clone());
        let floor = floor_slots(index.num_experts, 8);
        let plain = GenerateOptions {
            max_tokens: r.greedy_ids.len(),
            sampling: Default::default(),
            eos_ids: vec![509, 511],
            cancel: None,
            prefilled: None,
            draft_tokens: 0,
            logprobs: None,
            constraint: None,
        };
        let sizes = [floor, (floor + index.records()) / 2, index.records()];
        for (n, slots) in sizes.into_iter().enumerate() {
            // (queue depth, lookahead, I/O, drafts): the matrix without drafts, and one
            // run with 1, 2 or 4 drafts per pool size where the fixture has a head.
            let mut runs = Vec::new();
            for &qd in depths {
                for &lookahead in lookaheads {
                    for &io in ios {
                        runs.push((qd, lookahead, io, 0));
                    }
                }
            }
            if model.drafts() {
                runs.push((32, true, IoMode::Direct, [1, 2, 4][n]));
            }
            for (qd, lookahead, io, drafts) in runs {
                let mut o = StreamOptions::with_slots(slots);
                o.queue_depth = qd;
                o.io = io;
                let pool = SlotPool::open(&ckpt, index.clone(), o, rt.handle().clone()).unwrap();
                backend.attach_pool(&pool.memory(), None).unwrap();
                let mut experts = PoolExperts::new(pool);
                experts.lookahead = lookahead;
                let mut state = model.new_state(backend);
                let options = GenerateOptions {
                    draft_tokens: drafts,
                    ..plain.clone()
                };
                let (got, stats) = generate(
                    &model,
                    backend,
                    &experts,
                    &mut state,
                    &r.prompt_ids,
                    &options,
                    |_| Ok(true),
                )
                .unwrap();
                assert_eq!(
                    got,
                    want,
                    "{name} on {}: {slots} slots, qd {qd}, lookahead {lookahead}, {io:?}, {drafts} drafts",
                    backend.name()
                );
                assert_eq!(stats.verify_passes > 0, drafts > 0, "{name}: {stats:?}");
            }
        }
    }
}
