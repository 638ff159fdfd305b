//! Greedy generation equals mlx-lm's ids for every combination of pool size (floor,
//! between, every record), queue depth (1, 32), lookahead (on, off), I/O mode (direct,
//! buffered) and backend (CPU, first GPU adapter), on both fixtures.

use std::sync::Arc;

use crate::common::*;
use slotstream::backend::cpu::CpuBackend;
use slotstream::backend::Backend;
use slotstream::checkpoint::Checkpoint;
use slotstream::generate::{generate, GenerateOptions};
use slotstream::io::IoMode;
use slotstream::model::Model;
use slotstream::pool::{floor_slots, PoolExperts, SlotPool, StreamOptions};

fn matrix<B: Backend>(backend: &B, rt: &tokio::runtime::Runtime) {
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
        };
        for slots in [floor, (floor + index.records()) / 2, index.records()] {
            for qd in [1, 32] {
                for lookahead in [true, false] {
                    for io in [IoMode::Direct, IoMode::Buffered] {
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

#[test]
fn every_combination_matches_mlx_lm_on_the_cpu() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    matrix(&CpuBackend, &rt);
}

#[test]
fn every_combination_matches_mlx_lm_on_the_gpu() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    matrix(&gpu(), &rt);
}
