//! The elastic pool, through an injected memory probe: a scripted squeeze gives exact slot
//! counts, returns the retired slots' pages to the OS (their pages leave the process, by
//! `mincore`) and keeps every record that stays correct; an engine whose pool shrinks and
//! grows while it generates gives the same ids as a fixed pool and as mlx-lm.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use slotstream::backend::cpu::CpuBackend;
use slotstream::checkpoint::{Checkpoint, ExpertIndex};
use slotstream::engine::{Engine, EngineOptions, Event};
use slotstream::experts::{Elastic, PoolSize, SourceOptions};
use slotstream::machine::{MachineMemory, MemoryProbe, MemoryReading};
use slotstream::plan::{Bound, Footprint, Target};
use slotstream::pool::{ElasticOptions, SlotPool, StreamOptions, Watcher};
use slotstream::prompt_cache::PromptCacheOptions;

use crate::common::{fixture_dir, reference, runtime, FIXTURES};

/// Readings in order; `cycle` starts again from the first after the last, else the last
/// repeats.
struct Script {
    readings: Mutex<VecDeque<MemoryReading>>,
    cycle: bool,
}

impl Script {
    fn new(readings: impl IntoIterator<Item = MemoryReading>, cycle: bool) -> Arc<Self> {
        Arc::new(Script {
            readings: Mutex::new(readings.into_iter().collect()),
            cycle,
        })
    }
}

impl MemoryProbe for Script {
    fn read(&self) -> Option<MemoryReading> {
        let mut r = self.readings.lock().unwrap();
        let next = if self.cycle || r.len() > 1 {
            r.pop_front()?
        } else {
            *r.front()?
        };
        if self.cycle {
            r.push_back(next);
        }
        Some(next)
    }
}

/// A machine with `room` bytes left, and PSI pressure when given.
fn reading(room: u64, pressure: Option<f64>) -> MemoryReading {
    MemoryReading {
        memory: MachineMemory {
            total: 1 << 40,
            available: room,
            ..Default::default()
        },
        pressure,
    }
}

/// Pages of `bytes` resident in memory now (`mincore`).
fn resident_pages(bytes: &[u8]) -> usize {
    let page = 4096;
    let pages = bytes.len().div_ceil(page);
    let mut vec = vec![0u8; pages];
    // SAFETY: the range is a live allocation (page-aligned: the pool's memory is), and
    // `vec` has one byte per page.
    let rc = unsafe {
        libc::mincore(
            bytes.as_ptr() as *mut libc::c_void,
            bytes.len(),
            vec.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().filter(|&&v| v & 1 == 1).count()
}

/// A full pool (64 slots, 4 layers of 16 experts, floor 24) squeezed by a scripted probe:
/// every reading's slot count is exact, records retired from use leave the pool's memory
/// (by `mincore`), slots brought back and retired before any read return nothing, and
/// what stays reads back the checkpoint's bytes.
#[test]
fn a_scripted_squeeze_gives_exact_slot_counts_and_returns_the_pages() {
    let dir = fixture_dir(FIXTURES[0]);
    let ckpt = Arc::new(Checkpoint::open(&dir).unwrap());
    let index = Arc::new(ExpertIndex::build(&ckpt).unwrap());
    let rt = runtime();
    let mut options = StreamOptions::with_slots(64);
    options.use_pack = false;
    let pool = SlotPool::open(&ckpt, index.clone(), options, rt.handle().clone()).unwrap();
    assert_eq!((pool.slots(), pool.floor()), (64, 24));
    let all: Vec<u32> = (0..16).collect();
    let fill = |pool: &Arc<SlotPool>| {
        for &layer in &index.moe_layers {
            let records = rt.block_on(pool.ensure(layer, &all)).unwrap();
            for (r, &e) in records.iter().zip(&all) {
                let mut want = vec![0u8; index.layout.record_bytes];
                index
                    .copy_record(&ckpt, layer, e as usize, &mut want)
                    .unwrap();
                assert!(r[..] == want[..], "layer {layer} expert {e}");
            }
        }
    };
    fill(&pool);
    let s = pool.stride() as u64;
    let memory = pool.memory().memory;
    let slot_pages = |slots: u64| (slots * s / 4096) as usize;
    let resident = || resident_pages(&memory.as_slice()[..64 * s as usize]);
    assert_eq!(resident(), slot_pages(64));
    // Rooms in slots; (room, pressure) and the slots after each reading, one a second.
    let script = [
        (30, None, 64),       // above the high-water mark, but the pool is at its plan
        (5, None, 54),        // short: shed to the band's middle (15 slots' worth)
        (12, None, 54),       // in the band
        (0, None, 39),        // short again
        (16, Some(50.0), 38), // pressure: an eighth of the slots above the floor
        (100, None, 38),      // plenty: the hold (2 s) starts
        (100, None, 38),
        (30, None, 53), // held 2 s: grow to the band's middle
        (30, None, 53), // the 15 empty slots will take 15 slots' worth: in the band
        (9, None, 38),  // short: the 15 empty slots go first, and return nothing
        (0, None, 24),  // down to the floor
        (0, None, 24),
    ];
    let probe = Script::new(
        script.iter().map(|&(room, p, _)| reading(room * s, p)),
        false,
    );
    let elastic = ElasticOptions {
        low_water: 10 * s,
        high_water: 20 * s,
        hold: Duration::from_secs(2),
        interval: Duration::from_secs(1),
        pressure: 10.0,
    };
    let mut watcher = Watcher::new(&pool, probe, elastic);
    let got: Vec<usize> = (0..script.len() as u64)
        .map(|t| watcher.step(Duration::from_secs(t)).unwrap())
        .collect();
    let want: Vec<usize> = script.iter().map(|w| w.2).collect();
    assert_eq!(got, want);
    let e = pool.stats().elastic.unwrap();
    assert_eq!((e.max_slots, e.floor), (64, 24));
    assert_eq!((e.shrinks, e.grows), (5, 1));
    assert_eq!(
        (e.slots_retired, e.slots_restored),
        (10 + 15 + 1 + 15 + 14, 15)
    );
    // Retired with their records: 10 + 15 + 1 + 14 slots; the 15 brought back were
    // retired before anything was read into them.
    assert_eq!(e.bytes_returned, 40 * s);
    assert!(!e.memory_kept);
    assert_eq!(pool.stats().slots, 24);
    // Transparent huge pages for every mapping may refill up to one huge page around a
    // boundary between a retired and a used slot.
    let thp_always = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|t| t.contains("[always]"));
    let pages = resident();
    if thp_always {
        assert!(pages <= slot_pages(24) + 40 * 512, "{pages} pages resident");
    } else {
        assert_eq!(pages, slot_pages(24));
    }
    // What stays is correct, and a whole layer still fits at the floor.
    fill(&pool);
    assert_eq!(pool.resize(64), 64);
    fill(&pool);
    assert_eq!(pool.unbacked_slots(), 0);
    assert_eq!(pool.stats().elastic.unwrap().grows, 2);
}

/// The ids of a greedy request and the pool's slots when it ended.
async fn run(engine: &Engine, prompt: Vec<u32>, max_tokens: usize) -> (Vec<u32>, usize) {
    match crate::engine::run_to_done(engine, prompt, max_tokens).await {
        Event::Done {
            output_ids, pool, ..
        } => (output_ids, pool.unwrap().slots),
        _ => unreachable!("run_to_done returns a Done event"),
    }
}

/// An engine planned within a ceiling (as `--memory-limit` plans one) whose probe swings
/// between no memory left and plenty every millisecond: the pool shrinks to its floor and
/// grows back to its plan while it generates, and the ids are a fixed pool's and mlx-lm's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_shrinks_and_grows_while_generating_gives_the_same_ids() {
    let name = FIXTURES[0];
    let r = reference(name);
    let dir = fixture_dir(name);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let index = ExpertIndex::build(&ckpt).unwrap();
    let chunk = slotstream::backend::prefill_chunk(&CpuBackend, &ckpt.config, false);
    let fp = Footprint::new(&ckpt, &index, 32, chunk);
    // A ceiling that leaves 40 slots (the whole model would need more).
    // The context the run needs: this tiny model's records are fewer bytes than a long
    // prompt's hidden states (the plan's `prompt_states`).
    let needed = r.prompt_ids.len() + r.greedy_ids.len();
    let context = slotstream::context::limit(needed, &ckpt.config);
    // A streamed plan also holds a prompt's hidden states (layer-major prefill).
    let budget = fp.resident_need(context, 0).unwrap() - fp.record_bytes
        + fp.prompt_states(context).unwrap()
        + 40 * fp.slot_bytes;
    assert!(budget < fp.resident_need(context, 0).unwrap());
    let s = fp.slot_bytes;
    let probe = Script::new([0, 0, 100, 100].map(|room| reading(room * s, None)), true);
    let options = |pool, elastic| EngineOptions {
        source: SourceOptions {
            pool: Some(pool),
            context,
            elastic,
            ..Default::default()
        },
        device: Some("cpu".into()),
        prompt_cache: PromptCacheOptions {
            memory: 0,
            ..Default::default()
        },
        ..Default::default()
    };
    let elastic = Elastic {
        probe,
        options: ElasticOptions {
            low_water: 10 * s,
            high_water: 20 * s,
            hold: Duration::ZERO,
            interval: Duration::from_millis(1),
            pressure: 10.0,
        },
    };
    let target = Target {
        bytes: budget,
        why: Bound::Limit,
        machine: None,
    };
    let engine = Engine::load(&dir, options(PoolSize::Auto(target), Some(elastic)))
        .await
        .unwrap();
    assert_eq!(engine.plan().unwrap().slots, 40);
    let fixed = Engine::load(&dir, options(PoolSize::Slots(40), None))
        .await
        .unwrap();
    let n = r.greedy_ids.len();
    let (want, fixed_slots) = run(&fixed, r.prompt_ids.clone(), n).await;
    assert_eq!(fixed_slots, 40);
    assert!(fixed.pool_stats().unwrap().elastic.is_none());
    let mlx: Vec<u32> = r
        .greedy_ids
        .iter()
        .copied()
        .take_while(|t| ![509u32, 511].contains(t))
        .collect();
    assert_eq!(want, mlx);
    // Runs until the pool has shrunk and grown at least twice each (a run takes longer
    // than a few readings, so this takes one or two).
    for attempt in 0.. {
        let (got, slots) = run(&engine, r.prompt_ids.clone(), n).await;
        assert_eq!(got, want, "run {attempt}");
        assert!((24..=40).contains(&slots));
        let e = engine.pool_stats().unwrap().elastic.unwrap();
        assert_eq!((e.max_slots, e.floor), (40, 24));
        if e.shrinks >= 2 && e.grows >= 2 {
            break;
        }
        assert!(attempt < 50, "{e:?}");
    }
    assert_eq!(engine.pinned_slots(), 0);
}
