//! Greedy generation equals mlx-lm's ids for every combination of pool size (floor,
//! between, every record), queue depth (1, 32), lookahead (on, off) and I/O mode (direct,
//! buffered), on every fixture, on every backend ([`backend_tests!`]). On a GPU's portable
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
        let ckpt = Arc::new(Checkpoint::open(&fixture_dir(name)).unwrap());
        let model = Model::load(&ckpt, backend).unwrap();
        let index = Arc::new(model.experts.clone());
        let floor = floor_slots(index.num_experts, 8);
        let options = GenerateOptions {
            max_tokens: r.greedy_ids.len(),
            sampling: Default::default(),
            eos_ids: vec![509, 511],
            cancel: None,
            prefilled: None,
        };
        for slots in [floor, (floor + index.records()) / 2, index.records()] {
            for &qd in depths {
                for &lookahead in lookaheads {
                    for &io in ios {
                        let mut o = StreamOptions::with_slots(slots);
                        o.queue_depth = qd;
                        o.io = io;
                        let pool =
                            SlotPool::open(&ckpt, index.clone(), o, rt.handle().clone()).unwrap();
                        backend.attach_pool(&pool.memory(), None).unwrap();
                        let mut experts = PoolExperts::new(pool);
                        experts.lookahead = lookahead;
                        let mut state = model.new_state(backend);
                        let (got, _) = generate(
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
                            "{name} on {}: {slots} slots, qd {qd}, lookahead {lookahead}, {io:?}",
                            backend.name()
                        );
                    }
                }
            }
        }
    }
}
