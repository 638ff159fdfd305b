//! The slot pool: concurrent property test of its invariants, fault injection through
//! custom `ReadAt` files, the pack round trip and its fallbacks, the floor, and the
//! model's logits through the pool against the mapped checkpoint (bit-exact).
//!
//! Every test that writes (packs, corruption, truncation) works on a copy of a fixture in
//! a temporary directory; nothing is written under tests/fixtures.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use slotstream::backend::cpu::CpuBackend;
use slotstream::checkpoint::{Checkpoint, ExpertIndex};
use slotstream::io::{DiskFile, IoMode, ReadAt, Reader};
use slotstream::model::Logits;
use slotstream::pack::{pack, MANIFEST_FILE, PACK_FILE};
use slotstream::pool::{
    floor_slots, PoolExperts, PoolOptions, PoolStats, RecordFiles, SlotPool, StreamOptions,
};

use crate::common::{copy_fixture, runtime};

const BF16: &str = "qwen3-next-bf16";
const SHARDED: &str = "qwen3-next-f32-sharded";
const QWEN35: &str = crate::common::QWEN35;
const MODES: [IoMode; 2] = [IoMode::Direct, IoMode::Buffered];

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

fn open(dir: &Path) -> (Arc<Checkpoint>, Arc<ExpertIndex>) {
    let ckpt = Arc::new(Checkpoint::open(dir).unwrap());
    let index = Arc::new(ExpertIndex::build(&ckpt).unwrap());
    (ckpt, index)
}

/// The record of `(layer, expert)` copied out of the mapped checkpoint.
fn expected(ckpt: &Checkpoint, index: &ExpertIndex, layer: usize, expert: u32) -> Vec<u8> {
    let mut buf = vec![0u8; index.layout.record_bytes];
    index
        .copy_record(ckpt, layer, expert as usize, &mut buf)
        .unwrap();
    buf
}

fn all_keys(index: &ExpertIndex) -> Vec<(usize, u32)> {
    index
        .moe_layers
        .iter()
        .flat_map(|&l| (0..index.num_experts as u32).map(move |e| (l, e)))
        .collect()
}

fn shard_paths(ckpt: &Checkpoint) -> Vec<PathBuf> {
    ckpt.shards().iter().map(|s| s.path.clone()).collect()
}

/// A fixture opened read-only, with every record's expected bytes.
struct Fixture {
    ckpt: Arc<Checkpoint>,
    index: Arc<ExpertIndex>,
    records: HashMap<(u32, u32), Vec<u8>>,
}

fn fixture(name: &str) -> &'static Fixture {
    static BF: OnceLock<Fixture> = OnceLock::new();
    static SH: OnceLock<Fixture> = OnceLock::new();
    let cell = match name {
        BF16 => &BF,
        SHARDED => &SH,
        _ => unreachable!(),
    };
    cell.get_or_init(|| {
        let (ckpt, index) = open(&crate::common::fixture_dir(name));
        let records = all_keys(&index)
            .into_iter()
            .map(|(l, e)| ((l as u32, e), expected(&ckpt, &index, l, e)))
            .collect();
        Fixture {
            ckpt,
            index,
            records,
        }
    })
}

/// Asserts that every record of `layer`/`experts` ensured through `pool` equals the
/// checkpoint's bytes.
fn check_layer(
    rt: &tokio::runtime::Runtime,
    pool: &Arc<SlotPool>,
    ckpt: &Checkpoint,
    index: &ExpertIndex,
    layer: usize,
    experts: &[u32],
) {
    let recs = rt
        .block_on(pool.ensure(layer, experts))
        .unwrap_or_else(|e| panic!("ensure layer {layer}: {e}"));
    assert_eq!(recs.len(), experts.len());
    for (r, &e) in recs.iter().zip(experts) {
        assert!(
            r[..] == expected(ckpt, index, layer, e)[..],
            "layer {layer} expert {e}: wrong bytes"
        );
    }
}

fn check_all(
    rt: &tokio::runtime::Runtime,
    pool: &Arc<SlotPool>,
    ckpt: &Checkpoint,
    index: &ExpertIndex,
) {
    let experts: Vec<u32> = (0..index.num_experts as u32).collect();
    for &layer in &index.moe_layers {
        check_layer(rt, pool, ckpt, index, layer, &experts);
    }
}

fn pool_err(r: slotstream::Result<Arc<SlotPool>>) -> slotstream::Error {
    match r {
        Ok(_) => panic!("expected an error building the pool"),
        Err(e) => e,
    }
}

/// A `ReadAt` around a real file that can misbehave: short reads, spurious EINTR, EIO on
/// a byte range (switchable), and a delay per call. Counts calls and the bytes returned.
struct Faulty {
    inner: DiskFile,
    /// Return at most this many bytes per call.
    max_chunk: Option<usize>,
    /// Every other call fails with `ErrorKind::Interrupted`.
    eintr: bool,
    /// Calls whose range overlaps this fail with EIO while `fail_on` is set.
    fail: Option<Range<u64>>,
    fail_on: AtomicBool,
    /// Offsets of the calls that failed with EIO.
    failed_at: Mutex<Vec<u64>>,
    delay: Option<Duration>,
    calls: AtomicU64,
    bytes: AtomicU64,
    /// Calls running now, and the most that ever ran at once (shared by the files of a
    /// checkpoint where a test gives them one gauge).
    active: Arc<[AtomicU64; 2]>,
}

impl Faulty {
    fn new(path: &Path, mode: IoMode) -> Self {
        Faulty {
            inner: DiskFile::open(path, mode).unwrap(),
            max_chunk: None,
            eintr: false,
            fail: None,
            fail_on: AtomicBool::new(false),
            failed_at: Mutex::new(Vec::new()),
            delay: None,
            calls: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            active: Arc::default(),
        }
    }
}

impl ReadAt for Faulty {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let now = self.active[0].fetch_add(1, Ordering::SeqCst) + 1;
        self.active[1].fetch_max(now, Ordering::SeqCst);
        if let Some(d) = self.delay {
            std::thread::sleep(d);
        }
        let result = self.read_now(buf, offset, call);
        self.active[0].fetch_sub(1, Ordering::SeqCst);
        result
    }
    fn path(&self) -> &Path {
        self.inner.path()
    }
    fn direct(&self) -> bool {
        self.inner.direct()
    }
    fn check_unchanged(&self) -> std::io::Result<()> {
        self.inner.check_unchanged()
    }
}

impl Faulty {
    /// `read_at` after its delay: the injected faults, else the file's bytes.
    fn read_now(&self, buf: &mut [u8], offset: u64, call: u64) -> std::io::Result<usize> {
        if self.eintr && call.is_multiple_of(2) {
            return Err(std::io::Error::from(std::io::ErrorKind::Interrupted));
        }
        if let Some(r) = &self.fail {
            let end = offset + buf.len() as u64;
            if self.fail_on.load(Ordering::SeqCst) && offset < r.end && r.start < end {
                self.failed_at.lock().unwrap().push(offset);
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
        }
        let n = self.max_chunk.map_or(buf.len(), |m| m.min(buf.len()));
        let n = self.inner.read_at(&mut buf[..n], offset)?;
        self.bytes.fetch_add(n as u64, Ordering::SeqCst);
        Ok(n)
    }
}

fn shards_pool(
    index: &Arc<ExpertIndex>,
    files: Vec<Arc<dyn ReadAt>>,
    qd: usize,
    slots: usize,
    cap: usize,
    rt: &tokio::runtime::Runtime,
) -> Arc<SlotPool> {
    SlotPool::new(
        index.clone(),
        RecordFiles::Shards,
        Reader::from_files(files, qd),
        PoolOptions {
            slots,
            speculative_cap: cap,
        },
        rt.handle().clone(),
    )
    .unwrap()
}

// ---------------------------------------------------------------------------------------
// 1. Concurrent property test
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Hold {
    Nothing,
    Yield(u8),
    SleepMicros(u16),
}

#[derive(Clone, Debug)]
enum Op {
    /// `layer` is a position among the MoE layers.
    Ensure {
        layer: usize,
        experts: Vec<u32>,
        hold: Hold,
    },
    Prefetch {
        layer: usize,
        experts: Vec<u32>,
    },
}

fn experts_strategy() -> impl Strategy<Value = Vec<u32>> {
    proptest::sample::subsequence((0..16u32).collect::<Vec<_>>(), 1..=16).prop_shuffle()
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let hold = prop_oneof![
        Just(Hold::Nothing),
        (1u8..4).prop_map(Hold::Yield),
        (1u16..1500).prop_map(Hold::SleepMicros),
    ];
    prop_oneof![
        3 => (0usize..4, experts_strategy(), hold).prop_map(|(layer, experts, hold)| Op::Ensure { layer, experts, hold }),
        1 => (0usize..4, experts_strategy()).prop_map(|(layer, experts)| Op::Prefetch { layer, experts }),
    ]
}

#[derive(Debug)]
struct Case {
    fixture: &'static str,
    cap: usize,
    extra_slots: usize,
    queue_depth: usize,
    io: IoMode,
    tasks: Vec<Vec<Op>>,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(BF16), Just(SHARDED)],
        1usize..=4,
        0usize..=47,
        1usize..=8,
        prop_oneof![Just(IoMode::Direct), Just(IoMode::Buffered)],
        proptest::collection::vec(proptest::collection::vec(op_strategy(), 1..10), 2..=4),
    )
        .prop_map(|(fixture, cap, extra_slots, queue_depth, io, tasks)| Case {
            fixture,
            cap,
            extra_slots,
            queue_depth,
            io,
            tasks,
        })
}

/// What the tasks saw.
#[derive(Default)]
struct Seen {
    /// Lookups counted by the pool: every expert of a successful ensure, and the experts
    /// before the failing one of an ensure that found no free slot.
    lookups: u64,
    /// `ensure` calls that found no free slot (must stay 0; see
    /// `prefetch_never_starves_a_demand_request_at_the_floor`).
    no_free_slot: u64,
    failures: Vec<String>,
}

/// Position in `experts` of the expert named by a "no free slot for layer L expert E"
/// error, i.e. how many lookups that call counted before failing.
fn counted_before_failure(msg: &str, experts: &[u32]) -> Option<u64> {
    let rest = msg.split(" expert ").nth(1)?;
    let e: u32 = rest
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    experts.iter().position(|&x| x == e).map(|p| p as u64)
}

fn run_case(case: &Case) -> Result<(), TestCaseError> {
    let fx = fixture(case.fixture);
    let index = &fx.index;
    let floor = floor_slots(index.num_experts, case.cap);
    let slots = (floor + case.extra_slots).min(index.records()).max(floor);
    let rt = runtime();
    let reader = Reader::open(&shard_paths(&fx.ckpt), case.io, case.queue_depth).unwrap();
    let pool = SlotPool::new(
        index.clone(),
        RecordFiles::Shards,
        reader,
        PoolOptions {
            slots,
            speculative_cap: case.cap,
        },
        rt.handle().clone(),
    )
    .unwrap();
    // Pins held at once never exceed what the floor promises: slots - speculative_cap.
    let budget = Arc::new(tokio::sync::Semaphore::new(slots - case.cap));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let layers = index.moe_layers.clone();

    let handles: Vec<_> = case
        .tasks
        .iter()
        .cloned()
        .enumerate()
        .map(|(t, ops)| {
            let pool = pool.clone();
            let budget = budget.clone();
            let seen = seen.clone();
            let layers = layers.clone();
            rt.spawn(async move {
                for (k, op) in ops.into_iter().enumerate() {
                    match op {
                        Op::Prefetch { layer, experts } => pool.prefetch(layers[layer], &experts),
                        Op::Ensure { layer, experts, hold } => {
                            let layer = layers[layer];
                            let _permits = budget.acquire_many(experts.len() as u32).await.unwrap();
                            match pool.ensure(layer, &experts).await {
                                Ok(recs) => {
                                    {
                                    let mut s = seen.lock().unwrap();
                                    s.lookups += experts.len() as u64;
                                    if recs.len() != experts.len() {
                                        s.failures.push(format!("task {t} op {k}: {} records for {} experts", recs.len(), experts.len()));
                                    }
                                    for (r, &e) in recs.iter().zip(&experts) {
                                        if r[..] != fx.records[&(layer as u32, e)][..] {
                                            s.failures.push(format!("task {t} op {k}: layer {layer} expert {e}: wrong bytes after ensure"));
                                        }
                                    }
                                    }
                                    match hold {
                                        Hold::Nothing => {}
                                        Hold::Yield(n) => {
                                            for _ in 0..n {
                                                tokio::task::yield_now().await;
                                            }
                                        }
                                        Hold::SleepMicros(us) => tokio::time::sleep(Duration::from_micros(us as u64)).await,
                                    }
                                    // Still pinned: the slots must not have been reused.
                                    {
                                    let mut s = seen.lock().unwrap();
                                    for (r, &e) in recs.iter().zip(&experts) {
                                        if r[..] != fx.records[&(layer as u32, e)][..] {
                                            s.failures.push(format!("task {t} op {k}: layer {layer} expert {e}: bytes changed while pinned"));
                                        }
                                    }
                                    let slots: HashSet<usize> = recs.iter().map(|r| r.slot()).collect();
                                    if slots.len() != recs.len() {
                                        s.failures.push(format!("task {t} op {k}: two experts share a slot"));
                                    }
                                    }
                                    drop(recs);
                                }
                                Err(e) => {
                                    let msg = e.to_string();
                                    let mut s = seen.lock().unwrap();
                                    match counted_before_failure(&msg, &experts) {
                                        Some(n) if msg.contains("no free slot") => {
                                            s.lookups += n;
                                            s.no_free_slot += 1;
                                        }
                                        _ => s.failures.push(format!("task {t} op {k}: ensure failed: {msg}")),
                                    }
                                }
                            }
                        }
                    }
                }
            })
        })
        .collect();
    rt.block_on(async {
        for h in handles {
            h.await.unwrap();
        }
    });

    let seen = std::mem::take(&mut *seen.lock().unwrap());
    prop_assert!(seen.failures.is_empty(), "{:#?}", seen.failures);
    // Speculation holds at most `speculative_cap` slots, so pins within
    // `slots - speculative_cap` always find a victim.
    prop_assert_eq!(seen.no_free_slot, 0, "an ensure found no free slot");

    // (e) counters, before any further lookup.
    let st = pool.stats();
    prop_assert_eq!(
        st.hits + st.misses,
        seen.lookups,
        "hits {} + misses {} != lookups",
        st.hits,
        st.misses
    );
    prop_assert_eq!(
        st.demand_bytes,
        st.misses * index.layout.record_bytes as u64
    );
    prop_assert!(
        st.prefetches_used + st.prefetches_wasted <= st.speculative_reads,
        "{:?}",
        st
    );
    prop_assert_eq!(st.per_layer.iter().map(|c| c.hits).sum::<u64>(), st.hits);
    prop_assert_eq!(
        st.per_layer.iter().map(|c| c.misses).sum::<u64>(),
        st.misses
    );
    prop_assert_eq!(st.slots, slots);

    // (c) no slot maps two keys (no claims happen now, so the snapshot is stable).
    let mut owner: HashMap<usize, (u32, u32)> = HashMap::new();
    for (l, e) in all_keys(index) {
        if let Some(s) = pool.resident((l as u32, e)) {
            prop_assert!(s < slots);
            if let Some(other) = owner.insert(s, (l as u32, e)) {
                prop_assert!(false, "slot {s} maps both {:?} and {:?}", other, (l, e));
            }
        }
    }
    // The live view's snapshot agrees with the per-record lookups, key by key.
    let set = pool.resident_set();
    prop_assert!(set.streamed);
    prop_assert_eq!(set.count(), owner.len());
    prop_assert!(set.count() <= slots);
    for (row, &l) in index.moe_layers.iter().enumerate() {
        for e in 0..index.num_experts {
            prop_assert_eq!(
                set.contains(row, e),
                pool.resident((l as u32, e as u32)).is_some(),
                "layer {} expert {}",
                l,
                e
            );
        }
    }

    // (d) nothing stays pinned: a full layer fits. Speculative reads may still be landing
    // (their slots are in flight, so not victims yet); retry briefly for those only.
    let all: Vec<u32> = (0..index.num_experts as u32).collect();
    for &layer in &layers {
        let deadline = Instant::now() + Duration::from_secs(3);
        let recs = loop {
            match rt.block_on(pool.ensure(layer, &all)) {
                Ok(r) => break r,
                Err(e) if Instant::now() < deadline && e.to_string().contains("no free slot") => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(e) => {
                    return Err(TestCaseError::fail(format!(
                        "full layer {layer} after the run: {e}"
                    )))
                }
            }
        };
        for (r, &e) in recs.iter().zip(&all) {
            prop_assert!(
                r[..] == fx.records[&(layer as u32, e)][..],
                "layer {layer} expert {e}: wrong bytes"
            );
        }
    }
    let st = pool.stats();
    prop_assert!(
        st.prefetches_used + st.prefetches_wasted <= st.speculative_reads,
        "{:?}",
        st
    );
    prop_assert_eq!(
        st.demand_bytes,
        st.misses * index.layout.record_bytes as u64
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        max_shrink_iters: 64,
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    #[test]
    fn concurrent_ensure_and_prefetch_keep_the_pool_consistent(case in case_strategy()) {
        run_case(&case)?;
    }
}

// ---------------------------------------------------------------------------------------
// Pool behaviour around reads in flight
// ---------------------------------------------------------------------------------------

/// The floor is `experts of one layer + speculative_cap`, and `prefetch` promises that
/// at most `speculative_cap` speculative reads wait or run at once, so a pool at the
/// floor must always serve one full layer, whatever was prefetched before.
#[test]
fn prefetch_never_starves_a_demand_request_at_the_floor() {
    let fx = fixture(BF16);
    let rt = runtime();
    let cap = 2;
    let floor = floor_slots(fx.index.num_experts, cap);
    let mut f = Faulty::new(&shard_paths(&fx.ckpt)[0], IoMode::Buffered);
    f.delay = Some(Duration::from_millis(20));
    let pool = shards_pool(&fx.index, vec![Arc::new(f)], 32, floor, cap, &rt);
    let all: Vec<u32> = (0..fx.index.num_experts as u32).collect();
    let (l0, l1) = (fx.index.moe_layers[0], fx.index.moe_layers[1]);
    pool.prefetch(l1, &all);
    let recs = rt.block_on(pool.ensure(l0, &all)).unwrap_or_else(|e| {
        panic!(
            "a full layer at the floor after a prefetch of {} experts: {e}",
            all.len()
        )
    });
    for (r, &e) in recs.iter().zip(&all) {
        assert!(r[..] == fx.records[&(l0 as u32, e)][..]);
    }
}

/// Two concurrent requests for the same missing record share one read.
#[test]
fn concurrent_requests_for_one_record_share_a_read() {
    let fx = fixture(BF16);
    let rt = runtime();
    let mut f = Faulty::new(&shard_paths(&fx.ckpt)[0], IoMode::Buffered);
    f.delay = Some(Duration::from_millis(10));
    let f = Arc::new(f);
    let pool = shards_pool(
        &fx.index,
        vec![f.clone() as Arc<dyn ReadAt>],
        32,
        24,
        2,
        &rt,
    );
    let layer = fx.index.moe_layers[2];
    let (a, b) =
        rt.block_on(async { futures::join!(pool.ensure(layer, &[5]), pool.ensure(layer, &[5])) });
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a[0].slot(), b[0].slot());
    assert!(a[0][..] == fx.records[&(layer as u32, 5)][..]);
    assert!(b[0][..] == fx.records[&(layer as u32, 5)][..]);
    let st = pool.stats();
    assert_eq!((st.hits, st.misses), (1, 1), "{st:?}");
    // One record is nine pieces: nine preads, not eighteen.
    assert_eq!(f.calls.load(Ordering::SeqCst), 9);
}

/// Dropping an `ensure` future before its reads land unpins what it pinned; the reads it
/// started still land and are adopted by the next request.
#[test]
fn dropped_ensure_future_leaks_no_pin() {
    let fx = fixture(BF16);
    let rt = runtime();
    let cap = 1;
    let floor = floor_slots(fx.index.num_experts, cap);
    let mut f = Faulty::new(&shard_paths(&fx.ckpt)[0], IoMode::Buffered);
    f.delay = Some(Duration::from_millis(2));
    let pool = shards_pool(&fx.index, vec![Arc::new(f)], 2, floor, cap, &rt);
    let all: Vec<u32> = (0..fx.index.num_experts as u32).collect();
    let l0 = fx.index.moe_layers[0];
    // 16 records x 9 preads x 2 ms at queue depth 2: far more than 1 ms.
    let r = rt.block_on(async {
        tokio::time::timeout(Duration::from_millis(1), pool.ensure(l0, &all)).await
    });
    assert!(r.is_err(), "the reads should not have landed within 1 ms");
    // Joins the reads in flight (no new demand read).
    check_layer(&rt, &pool, &fx.ckpt, &fx.index, l0, &all);
    let st = pool.stats();
    assert_eq!((st.misses, st.hits), (16, 16), "{st:?}");
    // At the floor, each full layer needs every pin of the previous one released.
    check_all(&rt, &pool, &fx.ckpt, &fx.index);
}

/// Counters of two periods with a reset between them, added ([`PoolStats::add`], as
/// `chat --stats` sums its turns), are the counters of the two periods counted at once.
#[test]
fn counters_of_periods_add_up_to_the_whole() {
    use rand::Rng;
    let fx = fixture(BF16);
    let rt = runtime();
    let n = fx.index.num_experts as u32;
    let mut rng = rand::rng();
    let mut period = || -> Vec<(usize, Vec<u32>)> {
        (0..6)
            .map(|_| {
                let layer = fx.index.moe_layers[rng.random_range(0..fx.index.moe_layers.len())];
                let mut ids: Vec<u32> = (0..rng.random_range(1..=4))
                    .map(|_| rng.random_range(0..n))
                    .collect();
                ids.sort_unstable();
                ids.dedup();
                (layer, ids)
            })
            .collect()
    };
    let (first, second) = (period(), period());
    let slots = 2 * fx.index.num_experts;
    let files = || {
        let f = Faulty::new(&shard_paths(&fx.ckpt)[0], IoMode::Buffered);
        vec![Arc::new(f) as Arc<dyn ReadAt>]
    };
    let run = |pool: &Arc<SlotPool>, ops: &[(usize, Vec<u32>)]| {
        for (layer, ids) in ops {
            rt.block_on(pool.ensure(*layer, ids)).unwrap();
        }
    };
    let whole = shards_pool(&fx.index, files(), 4, slots, 1, &rt);
    run(&whole, &first);
    run(&whole, &second);
    let parts = shards_pool(&fx.index, files(), 4, slots, 1, &rt);
    run(&parts, &first);
    let mut sum = parts.stats();
    parts.reset_stats();
    run(&parts, &second);
    sum.add(&parts.stats());
    let want = whole.stats();
    let counts = |s: &PoolStats| (s.hits, s.misses, s.demand_bytes, s.bytes_read, s.hit_rate);
    assert_eq!(counts(&sum), counts(&want), "{sum:?}\n{want:?}");
    let layers = |s: &PoolStats| -> Vec<(u64, u64)> {
        s.per_layer.iter().map(|l| (l.hits, l.misses)).collect()
    };
    assert_eq!(layers(&sum), layers(&want));
}

/// The records a step's kernels read stay pinned in the backend's `InFlight` guard
/// (ARCHITECTURE.md, "The pin rule"): while it holds them no miss can take their slots,
/// dropping the handle `keep` returned releases nothing, and only the guard's read-back
/// (which waits for the device) or its drop (which waits first) unpins them.
#[test]
fn records_held_in_flight_stay_pinned_until_the_read_back() {
    use slotstream::backend::{Backend, InFlight};
    use slotstream::records::ExpertSource;
    let fx = fixture(BF16);
    let rt = runtime();
    let n = fx.index.num_experts;
    let cap = 2;
    let floor = floor_slots(n, cap);
    let file = Faulty::new(&shard_paths(&fx.ckpt)[0], IoMode::Buffered);
    let pool = shards_pool(&fx.index, vec![Arc::new(file)], 32, floor, cap, &rt);
    let source = PoolExperts::new(pool.clone());
    let backend = CpuBackend;
    let all: Vec<u32> = (0..n as u32).collect();
    let layers = &fx.index.moe_layers;
    let (l0, l1, l2) = (layers[0], layers[1], layers[2]);

    // A step's two layers fill the pool; every slot is pinned through the guard.
    let mut in_flight = InFlight::new(&backend);
    let first = in_flight.keep(source.fetch(l0, &all).unwrap());
    in_flight.keep(source.fetch(l1, &all[..cap]).unwrap());
    drop(first);
    assert_eq!(in_flight.len(), 2);
    assert_eq!(pool.pinned_slots(), floor);
    // A miss finds no slot to reuse: none of the held records can be overwritten.
    let Err(e) = source.fetch(l2, &[0]) else {
        panic!("a miss took a slot the guard holds");
    };
    assert!(e.to_string().contains("no free slot"), "{e}");
    assert_eq!(pool.pinned_slots(), floor);

    // The read-back waits for the device; only then are the slots free again.
    let t = backend.upload(&[1.0, 2.0], 1, 2);
    assert_eq!(in_flight.read_back(&[&t]).unwrap(), vec![vec![1.0, 2.0]]);
    assert!(in_flight.is_empty());
    assert_eq!(pool.pinned_slots(), 0);
    let missed = source.fetch(l2, &[0]).unwrap();
    assert!(missed[0][..] == fx.records[&(l2 as u32, 0)][..]);

    // A guard dropped still holding records (a step that failed part-way) waits for the
    // device before it releases them.
    let mut in_flight = InFlight::new(&backend);
    in_flight.keep(missed);
    assert_eq!(pool.pinned_slots(), 1);
    drop(in_flight);
    assert_eq!(pool.pinned_slots(), 0);
}

// ---------------------------------------------------------------------------------------
// 2. Fault injection
// ---------------------------------------------------------------------------------------

#[test]
fn short_reads_and_eintr_still_give_correct_records() {
    for name in [BF16, SHARDED] {
        let fx = fixture(name);
        let rt = runtime();
        let files: Vec<Arc<dyn ReadAt>> = shard_paths(&fx.ckpt)
            .iter()
            .map(|p| {
                let mut f = Faulty::new(p, IoMode::Buffered);
                f.max_chunk = Some(7);
                f.eintr = true;
                Arc::new(f) as Arc<dyn ReadAt>
            })
            .collect();
        let pool = shards_pool(&fx.index, files, 4, 24, 4, &rt);
        check_layer(
            &rt,
            &pool,
            &fx.ckpt,
            &fx.index,
            fx.index.moe_layers[0],
            &[3, 0, 15, 7],
        );
        check_layer(
            &rt,
            &pool,
            &fx.ckpt,
            &fx.index,
            fx.index.moe_layers[3],
            &(0..16).collect::<Vec<_>>(),
        );
    }
}

/// EIO on the bytes of one record: the error names the file and the offset, the key is
/// never resident, and once the fault clears the record reads correctly.
#[test]
fn eio_fails_the_request_and_leaves_no_valid_slot() {
    let fx = fixture(BF16);
    for mode in MODES {
        let rt = runtime();
        let layer = fx.index.moe_layers[1];
        let bad = 9u32;
        let r = fx.index.ranges(layer, bad as usize).unwrap()[4];
        // Direct reads fetch whole 4096-byte blocks, so a record sharing a block with the
        // fault fails too (as with a real bad sector): pick one that shares none.
        let block = |o: u64| o / 4096;
        let good = (0..16u32)
            .find(|&e| {
                e != bad
                    && fx.index.ranges(layer, e as usize).unwrap().iter().all(|p| {
                        p.shard != r.shard
                            || block(p.offset + p.len - 1) < block(r.offset + 10)
                            || block(p.offset) > block(r.offset + 10)
                    })
            })
            .expect("a record away from the fault");
        let path = shard_paths(&fx.ckpt)[r.shard].clone();
        let mut f = Faulty::new(&path, mode);
        f.fail = Some(r.offset + 10..r.offset + 11);
        f.fail_on.store(true, Ordering::SeqCst);
        let f = Arc::new(f);
        let pool = shards_pool(&fx.index, vec![f.clone() as Arc<dyn ReadAt>], 8, 20, 4, &rt);

        let err = match rt.block_on(pool.ensure(layer, &[good, bad])) {
            Ok(_) => panic!("{mode:?}: ensure succeeded over an EIO"),
            Err(e) => e.to_string(),
        };
        let failed_at = f.failed_at.lock().unwrap().clone();
        assert!(!failed_at.is_empty());
        assert!(
            err.contains(&path.display().to_string()),
            "{mode:?}: error does not name the file: {err}"
        );
        assert!(
            failed_at
                .iter()
                .any(|o| err.contains(&format!("offset {o}"))),
            "{mode:?}: error does not name the offset (failed at {failed_at:?}): {err}"
        );
        assert_eq!(
            pool.resident((layer as u32, bad)),
            None,
            "{mode:?}: a failed record is resident"
        );
        // Retrying while the fault persists fails again, and still leaves nothing valid.
        assert!(rt.block_on(pool.ensure(layer, &[bad])).is_err());
        assert_eq!(pool.resident((layer as u32, bad)), None);
        // The good record of the same request is fine.
        check_layer(&rt, &pool, &fx.ckpt, &fx.index, layer, &[good]);

        f.fail_on.store(false, Ordering::SeqCst);
        check_layer(&rt, &pool, &fx.ckpt, &fx.index, layer, &[bad]);
        assert!(pool.resident((layer as u32, bad)).is_some());
        // No pin leaked by the failures: every layer still fits.
        check_all(&rt, &pool, &fx.ckpt, &fx.index);
    }
}

/// An EIO on a prefetched record never surfaces as valid data: the prefetch is wasted
/// and a later ensure reads it again once the fault is gone.
#[test]
fn failed_prefetch_is_not_resident_and_is_reread() {
    let fx = fixture(BF16);
    let rt = runtime();
    let layer = fx.index.moe_layers[2];
    let r = fx.index.ranges(layer, 4).unwrap()[0];
    let path = shard_paths(&fx.ckpt)[r.shard].clone();
    let mut f = Faulty::new(&path, IoMode::Buffered);
    f.fail = Some(r.offset..r.offset + 1);
    f.fail_on.store(true, Ordering::SeqCst);
    let f = Arc::new(f);
    let pool = shards_pool(&fx.index, vec![f.clone() as Arc<dyn ReadAt>], 8, 24, 4, &rt);
    pool.prefetch(layer, &[4]);
    let deadline = Instant::now() + Duration::from_secs(3);
    while pool.stats().prefetches_wasted == 0 {
        assert!(
            Instant::now() < deadline,
            "the failed prefetch was never accounted"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(pool.resident((layer as u32, 4)), None);
    f.fail_on.store(false, Ordering::SeqCst);
    check_layer(&rt, &pool, &fx.ckpt, &fx.index, layer, &[4]);
    let st = pool.stats();
    assert_eq!(
        (st.misses, st.prefetches_used, st.prefetches_wasted),
        (1, 0, 1),
        "{st:?}"
    );
}

/// A shard cut to half its length: every record with a byte past the cut fails with an
/// end-of-file error naming the file and is never resident; every other record reads
/// correctly.
#[test]
fn truncated_shard_is_an_end_of_file_error() {
    for name in [BF16, SHARDED] {
        let fx = fixture(name);
        let keys = all_keys(&fx.index);
        // The shard holding the most expert bytes.
        let mut bytes_in = vec![0u64; fx.ckpt.shards().len()];
        for &(l, e) in &keys {
            for r in fx.index.ranges(l, e as usize).unwrap() {
                bytes_in[r.shard] += r.len;
            }
        }
        let cut_shard = (0..bytes_in.len()).max_by_key(|&i| bytes_in[i]).unwrap();
        for mode in MODES {
            let tmp = copy_fixture(name);
            let paths: Vec<PathBuf> = fx
                .ckpt
                .shards()
                .iter()
                .map(|s| tmp.path().join(s.path.file_name().unwrap()))
                .collect();
            let shard = paths[cut_shard].clone();
            let half = fs::metadata(&shard).unwrap().len() / 2;
            fs::OpenOptions::new()
                .write(true)
                .open(&shard)
                .unwrap()
                .set_len(half)
                .unwrap();
            let crosses = |(l, e): (usize, u32)| {
                fx.index
                    .ranges(l, e as usize)
                    .unwrap()
                    .iter()
                    .any(|r| r.shard == cut_shard && r.offset + r.len > half)
            };
            assert!(
                keys.iter().any(|&k| crosses(k)),
                "{name}: no record past the cut"
            );

            let rt = runtime();
            let reader = Reader::open(&paths, mode, 4).unwrap();
            let pool = SlotPool::new(
                fx.index.clone(),
                RecordFiles::Shards,
                reader,
                PoolOptions {
                    slots: 20,
                    speculative_cap: 4,
                },
                rt.handle().clone(),
            )
            .unwrap();
            let (mut failed, mut read) = (0, 0);
            for &(l, e) in &keys {
                match rt.block_on(pool.ensure(l, &[e])) {
                    Ok(recs) => {
                        assert!(
                            !crosses((l, e)),
                            "{name} {mode:?}: layer {l} expert {e} read past the end of file"
                        );
                        assert!(
                            recs[0][..] == fx.records[&(l as u32, e)][..],
                            "{name} {mode:?}: layer {l} expert {e}"
                        );
                        read += 1;
                    }
                    Err(err) => {
                        let err = err.to_string();
                        assert!(
                            crosses((l, e)),
                            "{name} {mode:?}: layer {l} expert {e}: {err}"
                        );
                        assert!(err.contains("end of file"), "{name} {mode:?}: {err}");
                        assert!(
                            err.contains(&shard.display().to_string()),
                            "{name} {mode:?}: {err}"
                        );
                        assert_eq!(
                            pool.resident((l as u32, e)),
                            None,
                            "{name} {mode:?}: failed record resident"
                        );
                        failed += 1;
                    }
                }
            }
            eprintln!("{name} {mode:?}: {failed} records past the cut failed, {read} read");
            // The failures leaked no pin.
            let all: Vec<u32> = (0..16).collect();
            let ok_layer = fx
                .index
                .moe_layers
                .iter()
                .find(|&&l| all.iter().all(|&e| !crosses((l, e))));
            if let Some(&l) = ok_layer {
                check_layer(&rt, &pool, &fx.ckpt, &fx.index, l, &all);
            }
        }
    }
}

/// A shard replaced (rename over it) under a running pool: later reads fail, they never
/// return bytes of another file.
#[test]
fn replaced_shard_is_an_error_not_wrong_bytes() {
    for mode in MODES {
        let tmp = copy_fixture(BF16);
        let (ckpt, index) = open(tmp.path());
        let rt = runtime();
        let mut options = StreamOptions::with_slots(24);
        options.io = mode;
        options.use_pack = false;
        let pool = SlotPool::open(&ckpt, index.clone(), options, rt.handle().clone()).unwrap();
        let layer = index.moe_layers[0];
        let want = expected(&ckpt, &index, layer, 1);
        check_layer(&rt, &pool, &ckpt, &index, layer, &[0]);

        // A different file (the shard with its expert bytes inverted, one byte longer).
        let shard = ckpt.shards()[0].path.clone();
        let mut bytes = fs::read(&shard).unwrap();
        let quarter = bytes.len() / 4;
        for b in bytes.iter_mut().skip(quarter) {
            *b = !*b;
        }
        bytes.push(0);
        let new = tmp.path().join("replacement.tmp");
        fs::write(&new, &bytes).unwrap();
        fs::rename(&new, &shard).unwrap();

        match rt.block_on(pool.ensure(layer, &[1])) {
            Ok(recs) => panic!(
                "{mode:?}: read after the shard was replaced succeeded (bytes correct: {})",
                recs[0][..] == want[..]
            ),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(&shard.display().to_string()),
                    "{mode:?}: {msg}"
                );
                assert!(msg.contains("changed"), "{mode:?}: {msg}");
            }
        }
        assert_eq!(pool.resident((layer as u32, 1)), None);
    }
}

// ---------------------------------------------------------------------------------------
// 3. Pack round trip and fallbacks
// ---------------------------------------------------------------------------------------

fn pool_for(
    ckpt: &Checkpoint,
    index: &Arc<ExpertIndex>,
    mode: IoMode,
    rt: &tokio::runtime::Runtime,
) -> Arc<SlotPool> {
    pool_with(ckpt, index, mode, 40, rt)
}

fn pool_with(
    ckpt: &Checkpoint,
    index: &Arc<ExpertIndex>,
    mode: IoMode,
    slots: usize,
    rt: &tokio::runtime::Runtime,
) -> Arc<SlotPool> {
    let mut options = StreamOptions::with_slots(slots);
    options.io = mode;
    SlotPool::open(ckpt, index.clone(), options, rt.handle().clone()).unwrap()
}

#[test]
fn pack_round_trip_gives_the_shard_records() {
    for name in [BF16, SHARDED, QWEN35, crate::common::QWEN4_EXP] {
        let tmp = copy_fixture(name);
        let (ckpt, index) = open(tmp.path());
        let manifest = pack(&ckpt, &index, tmp.path(), false).unwrap();
        assert_eq!(manifest.record_bytes, index.layout.record_bytes);
        for mode in MODES {
            let rt = runtime();
            let pool = pool_for(&ckpt, &index, mode, &rt);
            assert!(pool.packed(), "{name} {mode:?}: pack not used");
            check_all(&rt, &pool, &ckpt, &index);
            let st = pool.stats();
            assert_eq!(st.pack_fallbacks, 0, "{name} {mode:?}");
            assert_eq!(st.misses as usize, index.records());
        }
    }
}

#[test]
fn pack_of_another_config_is_ignored() {
    let tmp = copy_fixture(BF16);
    let (ckpt, index) = open(tmp.path());
    pack(&ckpt, &index, tmp.path(), false).unwrap();
    drop(ckpt);
    let config = tmp.path().join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&config).unwrap()).unwrap();
    json["note"] = serde_json::json!(1);
    fs::write(&config, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
    let (ckpt, index) = open(tmp.path());
    for mode in MODES {
        let rt = runtime();
        let pool = pool_for(&ckpt, &index, mode, &rt);
        assert!(
            !pool.packed(),
            "{mode:?}: a pack made for another config.json was used"
        );
        check_all(&rt, &pool, &ckpt, &index);
    }
}

#[test]
fn corrupt_packed_record_falls_back_to_the_shards() {
    let tmp = copy_fixture(BF16);
    let (ckpt, index) = open(tmp.path());
    let manifest = pack(&ckpt, &index, tmp.path(), false).unwrap();
    let (layer, expert) = (index.moe_layers[2], 11u32);
    let pos = index.moe_position(layer).unwrap() * index.num_experts + expert as usize;
    let at = pos * manifest.stride;
    let path = tmp.path().join(PACK_FILE);
    let mut bytes = fs::read(&path).unwrap();
    for i in [
        0,
        100,
        index.layout.offsets[4] + 3,
        index.layout.record_bytes - 1,
    ] {
        bytes[at + i] ^= 0x5a;
    }
    // Same length: the manifest's length check passes and only the CRC can tell.
    fs::write(&path, &bytes).unwrap();
    for mode in MODES {
        let rt = runtime();
        // Room for every record, so none is read twice.
        let pool = pool_with(&ckpt, &index, mode, index.records(), &rt);
        assert!(pool.packed(), "{mode:?}");
        check_layer(&rt, &pool, &ckpt, &index, layer, &[expert]);
        assert!(
            pool.stats().pack_fallbacks >= 1,
            "{mode:?}: {:?}",
            pool.stats()
        );
        check_all(&rt, &pool, &ckpt, &index);
        assert_eq!(
            pool.stats().pack_fallbacks,
            1,
            "{mode:?}: only the corrupt record falls back"
        );
    }
}

#[test]
fn interrupted_pack_is_never_used() {
    // A stray temporary pack (killed before the rename).
    let tmp = copy_fixture(BF16);
    let (ckpt, index) = open(tmp.path());
    let manifest = pack(&ckpt, &index, tmp.path(), false).unwrap();
    let pack_bytes = fs::read(tmp.path().join(PACK_FILE)).unwrap();
    let json = fs::read(tmp.path().join(MANIFEST_FILE)).unwrap();
    fs::remove_file(tmp.path().join(PACK_FILE)).unwrap();
    fs::remove_file(tmp.path().join(MANIFEST_FILE)).unwrap();
    fs::write(
        tmp.path().join(".experts.pack.AbC123"),
        &pack_bytes[..pack_bytes.len() / 2],
    )
    .unwrap();
    let rt = runtime();
    for mode in MODES {
        let pool = pool_for(&ckpt, &index, mode, &rt);
        assert!(!pool.packed(), "{mode:?}: stray temporary file used");
        check_all(&rt, &pool, &ckpt, &index);
    }

    // The pack renamed into place but the manifest never written.
    fs::write(tmp.path().join(PACK_FILE), &pack_bytes).unwrap();
    for mode in MODES {
        let pool = pool_for(&ckpt, &index, mode, &rt);
        assert!(!pool.packed(), "{mode:?}: pack without a manifest used");
        check_all(&rt, &pool, &ckpt, &index);
    }

    // A manifest next to a pack cut short (a copy interrupted by hand).
    fs::write(tmp.path().join(MANIFEST_FILE), &json).unwrap();
    fs::write(
        tmp.path().join(PACK_FILE),
        &pack_bytes[..pack_bytes.len() - manifest.stride],
    )
    .unwrap();
    for mode in MODES {
        let pool = pool_for(&ckpt, &index, mode, &rt);
        assert!(!pool.packed(), "{mode:?}: short pack used");
        check_all(&rt, &pool, &ckpt, &index);
    }

    // Sanity: the complete pair is used.
    fs::write(tmp.path().join(PACK_FILE), &pack_bytes).unwrap();
    let pool = pool_for(&ckpt, &index, IoMode::Buffered, &rt);
    assert!(pool.packed());
}

// ---------------------------------------------------------------------------------------
// 4. Floor
// ---------------------------------------------------------------------------------------

#[test]
fn below_the_floor_is_refused_with_the_numbers() {
    let fx = fixture(BF16);
    let rt = runtime();
    for cap in [0, 1, 8] {
        let floor = floor_slots(fx.index.num_experts, cap);
        assert_eq!(floor, fx.index.num_experts + cap);
        let reader = Reader::open(&shard_paths(&fx.ckpt), IoMode::Buffered, 4).unwrap();
        let err = pool_err(SlotPool::new(
            fx.index.clone(),
            RecordFiles::Shards,
            reader,
            PoolOptions {
                slots: floor - 1,
                speculative_cap: cap,
            },
            rt.handle().clone(),
        ))
        .to_string();
        assert!(
            err.contains(&(floor - 1).to_string()) && err.contains(&floor.to_string()),
            "{err}"
        );
        let reader = Reader::open(&shard_paths(&fx.ckpt), IoMode::Buffered, 4).unwrap();
        let pool = SlotPool::new(
            fx.index.clone(),
            RecordFiles::Shards,
            reader,
            PoolOptions {
                slots: floor,
                speculative_cap: cap,
            },
            rt.handle().clone(),
        )
        .unwrap();
        assert_eq!(pool.floor(), floor);
        check_all(&rt, &pool, &fx.ckpt, &fx.index);
    }
    let mut options = StreamOptions::with_slots(fx.index.num_experts + 7);
    options.use_pack = false;
    let err = pool_err(SlotPool::open(
        &fx.ckpt,
        fx.index.clone(),
        options,
        rt.handle().clone(),
    ))
    .to_string();
    assert!(err.contains("23") && err.contains("24"), "{err}");
}

// ---------------------------------------------------------------------------------------
// 5. The model through the pool
// ---------------------------------------------------------------------------------------

#[test]
fn logits_through_the_pool_equal_the_mapped_checkpoint() {
    for name in [BF16, SHARDED, QWEN35, crate::common::QWEN4_EXP] {
        let r = crate::common::reference(name);
        let l = crate::common::load_cpu(name);
        let index = Arc::new(l.model.experts.clone());
        let mut state = l.model.new_state(&CpuBackend);
        let want = l
            .model
            .forward(
                &CpuBackend,
                &mut state,
                &r.scored_ids,
                &l.experts,
                Logits::All,
            )
            .unwrap();
        let rt = runtime();
        let floor = floor_slots(
            index.num_experts,
            StreamOptions::with_slots(0).pool.speculative_cap,
        );
        for slots in [floor, 40, 64] {
            for queue_depth in [1, 32] {
                for io in MODES {
                    let mut options = StreamOptions::with_slots(slots);
                    options.queue_depth = queue_depth;
                    options.io = io;
                    options.use_pack = false;
                    let pool = SlotPool::open(&l.ckpt, index.clone(), options, rt.handle().clone())
                        .unwrap();
                    let experts = PoolExperts::new(pool.clone());
                    let mut state = l.model.new_state(&CpuBackend);
                    // From the test thread: PoolExperts::fetch blocks on the runtime's reads.
                    let got = l
                        .model
                        .forward(
                            &CpuBackend,
                            &mut state,
                            &r.scored_ids,
                            &experts,
                            Logits::All,
                        )
                        .unwrap();
                    assert!(
                        got == want,
                        "{name}: {slots} slots, queue depth {queue_depth}, {io:?}: logits differ"
                    );
                    // Then decode-style steps, one token at a time, on the now-warm pool.
                    let mut s1 = l.model.new_state(&CpuBackend);
                    let mut s2 = l.model.new_state(&CpuBackend);
                    for &id in &r.scored_ids[..8] {
                        let a = l
                            .model
                            .forward(&CpuBackend, &mut s1, &[id], &experts, Logits::Last)
                            .unwrap();
                        let b = l
                            .model
                            .forward(&CpuBackend, &mut s2, &[id], &l.experts, Logits::Last)
                            .unwrap();
                        assert!(a == b, "{name}: {slots} slots, queue depth {queue_depth}, {io:?}: decode logits differ");
                    }
                    let st = pool.stats();
                    assert!(st.hits + st.misses > 0);
                    assert_eq!(
                        st.demand_bytes,
                        st.misses * index.layout.record_bytes as u64
                    );
                }
            }
        }
    }
}

/// Prefill reads outside the pool: runs of consecutive ids come back byte-equal to the
/// checkpoint (from the shards and from a pack), count as sweep bytes rather than misses,
/// and the prompt's most used experts are admitted at the end of the prefill.
#[test]
fn prefill_sweep_reads_runs_outside_the_pool_and_admits_hot_experts() {
    use slotstream::records::ExpertSource;
    let rt = runtime();
    let tmp = copy_fixture(FIXTURES_FOR_SWEEP);
    let (ckpt, index) = open(tmp.path());
    // Quota per layer here: (40 - 24 + 16) / 4 = 8 slots.
    let few: Vec<u32> = vec![0, 1, 2, 5, 6, 9, 15];
    let many: Vec<u32> = vec![0, 1, 2, 3, 5, 6, 7, 9, 10, 11, 14, 15];
    let many_uses: Vec<u32> = vec![1, 9, 1, 2, 7, 1, 3, 1, 6, 1, 5, 8];
    for packed in [false, true] {
        if packed {
            pack(&ckpt, &index, tmp.path(), false).unwrap();
        }
        let open_pool = || {
            let pool = sweep_pool(&ckpt, &index, &rt);
            assert_eq!(pool.packed(), packed);
            pool
        };
        let layer = index.moe_layers[1];

        // Within the quota: read once, through the pool.
        let pool = open_pool();
        let source = PoolExperts::new(pool.clone());
        let got = source
            .fetch_prefill(layer, &few, &vec![1; few.len()])
            .unwrap();
        for (r, &e) in got.iter().zip(&few) {
            assert!(
                r[..] == expected(&ckpt, &index, layer, e)[..],
                "packed {packed}: expert {e}"
            );
        }
        let st = pool.stats();
        assert_eq!(
            (st.misses, st.sweep_bytes),
            (few.len() as u64, 0),
            "packed {packed}"
        );
        drop(got);
        source.end_prefill(true);
        assert_eq!(pool.stats().admitted_bytes, 0, "nothing left to admit");
        for &e in &few {
            assert!(
                pool.resident((layer as u32, e)).is_some(),
                "packed {packed}: expert {e} not resident"
            );
        }

        // Beyond it: read outside the pool in runs, then the 8 most used are admitted.
        let pool = open_pool();
        let source = PoolExperts::new(pool.clone());
        let got = source.fetch_prefill(layer, &many, &many_uses).unwrap();
        for (r, &e) in got.iter().zip(&many) {
            assert!(
                r[..] == expected(&ckpt, &index, layer, e)[..],
                "packed {packed}: expert {e}"
            );
        }
        let st = pool.stats();
        assert_eq!((st.hits, st.misses), (0, 0), "sweep reads are not lookups");
        assert_eq!(
            st.sweep_bytes,
            (many.len() * index.layout.record_bytes) as u64
        );
        // The 8 the admission wants are copied into slots as the sweep reads them ...
        assert_eq!(st.sweep_admitted, 8, "packed {packed}");
        drop(got);
        source.end_prefill(true);
        // ... so the admission reads nothing again.
        assert_eq!(pool.stats().admitted_bytes, 0, "packed {packed}");
        let mut by_use: Vec<(u32, u32)> = many_uses
            .iter()
            .copied()
            .zip(many.iter().copied())
            .collect();
        by_use.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for (rank, &(_, e)) in by_use.iter().enumerate() {
            let resident = pool.resident((layer as u32, e)).is_some();
            assert_eq!(
                resident,
                rank < 8,
                "packed {packed}: expert {e} (rank {rank})"
            );
            if resident {
                let held = rt.block_on(pool.ensure(layer, &[e])).unwrap();
                assert!(
                    held[0][..] == expected(&ckpt, &index, layer, e)[..],
                    "packed {packed}: admitted expert {e} holds other bytes"
                );
            }
        }
        assert_eq!(pool.stats().misses, 0, "the admitted records are hits");
    }
}

/// A prompt of several chunks: each chunk's sweep keeps the layer's most used experts so
/// far in slots, giving back the ones that fell out of them, so the layer never holds
/// more than its share of the slots (8 here), and the end of the prompt finds its hottest
/// experts resident. Each chunk's uses outweigh all before it, so the most used change
/// from chunk to chunk and records are given back.
#[test]
fn sweeps_of_several_chunks_keep_a_layer_within_its_share() {
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    use slotstream::records::ExpertSource;
    let seed: u64 = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let rt = runtime();
    let tmp = copy_fixture(FIXTURES_FOR_SWEEP);
    let (ckpt, index) = open(tmp.path());
    let pool = sweep_pool(&ckpt, &index, &rt);
    let source = PoolExperts::new(pool.clone());
    let layer = index.moe_layers[1];
    let experts = index.num_experts as u32;
    let resident = || {
        (0..experts)
            .filter(|&e| pool.resident((layer as u32, e)).is_some())
            .collect::<Vec<u32>>()
    };
    // Three chunks of 12 distinct experts each: every chunk is past the share of 8, so
    // it sweeps.
    let mut total: HashMap<u32, u64> = HashMap::new();
    let mut given_back = 0;
    let mut before: Vec<u32> = Vec::new();
    for chunk in 0..3u32 {
        let mut ids: Vec<u32> = (0..experts).collect();
        ids.shuffle(&mut rng);
        ids.truncate(12);
        ids.sort_unstable();
        let uses: Vec<u32> = ids
            .iter()
            .map(|_| rng.random_range(1..20) * 100u32.pow(chunk))
            .collect();
        for (&e, &n) in ids.iter().zip(&uses) {
            *total.entry(e).or_default() += n as u64;
        }
        let got = source.fetch_prefill(layer, &ids, &uses).unwrap();
        for (r, &e) in got.iter().zip(&ids) {
            assert!(
                r[..] == expected(&ckpt, &index, layer, e)[..],
                "seed {seed}, chunk {chunk}: expert {e}"
            );
        }
        drop(got);
        let held = resident();
        assert!(
            held.len() <= 8,
            "seed {seed}, chunk {chunk}: the layer holds {held:?}"
        );
        given_back += before.iter().filter(|e| !held.contains(e)).count();
        before = held;
    }
    assert!(given_back > 0, "seed {seed}: no record was given back");
    source.end_prefill(true);
    let mut by_use: Vec<(u64, u32)> = total.iter().map(|(&e, &n)| (n, e)).collect();
    by_use.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut hottest: Vec<u32> = by_use.iter().take(8).map(|&(_, e)| e).collect();
    hottest.sort_unstable();
    assert_eq!(resident(), hottest, "seed {seed}: after the prompt");
}

/// A chunk that routes to nearly every expert of a layer (90% or more) has the next MoE
/// layer's missing records read while it computes: that layer's chunk then gets them
/// byte-equal to the checkpoint without reading them again, and what it did not route to
/// is counted unused. A chunk of fewer experts reads nothing ahead, and a read ahead
/// that no chunk takes is dropped (and counted) at the end of the prompt.
#[test]
fn a_chunk_of_nearly_every_expert_reads_the_next_layer_ahead() {
    use rand::seq::SliceRandom;
    use slotstream::records::ExpertSource;
    let rt = runtime();
    let tmp = copy_fixture(FIXTURES_FOR_SWEEP);
    let (ckpt, index) = open(tmp.path());
    let pool = sweep_pool(&ckpt, &index, &rt);
    let source = PoolExperts::new(pool.clone());
    let experts = index.num_experts as u32;
    let record = index.layout.record_bytes as u64;
    let (first, next, last) = (
        index.moe_layers[0],
        index.moe_layers[1],
        index.moe_layers[2],
    );
    let all: Vec<u32> = (0..experts).collect();
    let uses =
        |ids: &[u32]| -> Vec<u32> { ids.iter().map(|_| rand::random_range(1..50)).collect() };
    let mut some = all.clone();
    some.shuffle(&mut rand::rng());
    some.truncate(12);
    some.sort_unstable();

    // Every expert of the first layer: the next one's are read ahead.
    drop(source.fetch_prefill(first, &all, &uses(&all)).unwrap());
    // The next layer's chunk takes 12 of them and reads nothing (the read ahead counts
    // its bytes when it is done); 12 of 16 experts reads nothing ahead either.
    let got = source.fetch_prefill(next, &some, &uses(&some)).unwrap();
    for (r, &e) in got.iter().zip(&some) {
        assert!(
            r[..] == expected(&ckpt, &index, next, e)[..],
            "{some:?}: expert {e}"
        );
    }
    drop(got);
    let st = pool.stats();
    assert_eq!(st.sweep_bytes, 2 * experts as u64 * record, "{st:?}");
    assert_eq!(st.sweep_unused, (experts - 12) as u64, "{st:?}");
    // Every expert of the second layer again, the last layer's read ahead, and the
    // prompt ends before a chunk takes it.
    drop(source.fetch_prefill(next, &all, &uses(&all)).unwrap());
    source.end_prefill(true);
    let st = pool.stats();
    let resident_last = (0..experts)
        .filter(|&e| pool.resident((last as u32, e)).is_some())
        .count() as u64;
    assert_eq!(resident_last, 0, "nothing of the last layer is admitted");
    assert!(st.sweep_unused > (experts - 12) as u64, "{st:?}");
    assert_eq!(pool.pinned_slots(), 0);
}

/// A sweep of one long run of ids (a cold pool's whole layer) is read in parts by
/// several readers at once, up to the queue depth, and comes back byte-equal to the
/// checkpoint. (One run was once read by one reader: a queue depth of 1.)
#[test]
fn a_long_sweep_run_is_read_at_the_queue_depth() {
    let fx = fixture(BF16);
    let rt = runtime();
    let index = &fx.index;
    let gauge: Arc<[AtomicU64; 2]> = Arc::default();
    let files: Vec<Arc<Faulty>> = shard_paths(&fx.ckpt)
        .iter()
        .map(|p| {
            let mut f = Faulty::new(p, IoMode::Buffered);
            f.delay = Some(Duration::from_millis(5));
            f.active = gauge.clone();
            Arc::new(f)
        })
        .collect();
    let readers: Vec<Arc<dyn ReadAt>> =
        files.iter().map(|f| f.clone() as Arc<dyn ReadAt>).collect();
    let qd = 4;
    let pool = shards_pool(
        index,
        readers,
        qd,
        floor_slots(index.num_experts, 2),
        2,
        &rt,
    );
    let layer = index.moe_layers[0];
    let all: Vec<u32> = (0..index.num_experts as u32).collect();
    let read = pool.read_runs(layer, &all).unwrap();
    for (bytes, &e) in read.iter().zip(&all) {
        assert!(
            bytes[..] == fx.records[&(layer as u32, e)][..],
            "expert {e}"
        );
    }
    let most = gauge[1].load(Ordering::SeqCst);
    let total: u64 = files.iter().map(|f| f.calls.load(Ordering::SeqCst)).sum();
    assert!(most >= 2, "one reader read the run: {total} calls");
    assert!(
        most <= qd as u64,
        "{most} reads at once, above the queue depth"
    );
}

const FIXTURES_FOR_SWEEP: &str = "qwen3-next-f32-sharded";

/// A pool of 40 slots reading `ckpt` with direct I/O (a layer's share of the slots for a
/// prompt: (40 - 24 + 16) / 4 = 8).
fn sweep_pool(
    ckpt: &Checkpoint,
    index: &Arc<ExpertIndex>,
    rt: &tokio::runtime::Runtime,
) -> Arc<SlotPool> {
    let mut options = StreamOptions::with_slots(40);
    options.io = IoMode::Direct;
    SlotPool::open(ckpt, index.clone(), options, rt.handle().clone()).unwrap()
}

/// A pool of every record gives each record a slot of its own in layer order, whatever
/// order the records are first asked for in (so a layer's records lie together for
/// whole-layer routing on a GPU), and still returns the right bytes.
#[test]
fn a_pool_of_every_record_keeps_layers_together() {
    use rand::seq::SliceRandom;
    let fx = fixture(BF16);
    let rt = runtime();
    let index = &fx.index;
    let pool = pool_with(&fx.ckpt, index, IoMode::Buffered, index.records(), &rt);
    let mut keys = all_keys(index);
    keys.shuffle(&mut rand::rng());
    for (layer, expert) in keys {
        let held = rt.block_on(pool.ensure(layer, &[expert])).unwrap();
        let pos = index.moe_position(layer).unwrap();
        assert_eq!(held[0].slot(), pos * index.num_experts + expert as usize);
        assert!(held[0][..] == fx.records[&(layer as u32, expert)][..]);
    }
    assert_eq!(pool.stats().misses, index.records() as u64);
}

/// `bytes_read` accounts for every byte the pool's reader returned during a generation
/// whose prompt is read outside the pool (sweeps), whose hottest experts are admitted
/// after it, and whose decode misses and reads ahead: each counted record is one record's
/// pieces read from the shards. (The demo's summary once left out sweeps and admissions,
/// a quarter of what it read.)
#[test]
fn bytes_read_counts_everything_the_reader_read() {
    use slotstream::generate::{generate, GenerateOptions};
    let rt = runtime();
    let l = crate::common::load_cpu(BF16);
    let index = Arc::new(l.model.experts.clone());
    let files: Vec<Arc<Faulty>> = shard_paths(&l.ckpt)
        .iter()
        .map(|p| Arc::new(Faulty::new(p, IoMode::Buffered)))
        .collect();
    let readers: Vec<Arc<dyn ReadAt>> =
        files.iter().map(|f| f.clone() as Arc<dyn ReadAt>).collect();
    let slots = floor_slots(index.num_experts, 8);
    let pool = shards_pool(&index, readers, 8, slots, 8, &rt);
    let experts = PoolExperts::new(pool.clone());
    let r = crate::common::reference(BF16);
    let options = GenerateOptions {
        max_tokens: 16,
        sampling: Default::default(),
        eos_ids: vec![],
        cancel: None,
        prefilled: None,
        draft_tokens: 0,
        logprobs: None,
        constraint: None,
    };
    let mut state = l.model.new_state(&CpuBackend);
    generate(
        &l.model,
        &CpuBackend,
        &experts,
        &mut state,
        &r.scored_ids,
        &options,
        |_| Ok(true),
    )
    .unwrap();
    let st = pool.stats();
    // The prompt's hottest experts are admitted from its sweeps (copied, not read again).
    assert!(st.sweep_admitted > 0, "{st:?}");
    for (what, bytes) in [
        ("sweep", st.sweep_bytes),
        ("demand", st.demand_bytes),
        ("speculative", st.speculative_bytes),
    ] {
        assert!(bytes > 0, "no {what} reads: {st:?}");
    }
    let layout = &index.layout;
    let pieces: u64 = layout.lens.iter().map(|&n| n as u64).sum();
    // The last step's lookahead reads are counted when they take their slots, and nothing
    // waits for a wrong guess: the reader may still be returning them.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = pool.stats();
        assert_eq!(st.bytes_read % layout.record_bytes as u64, 0, "{st:?}");
        let records = st.bytes_read / layout.record_bytes as u64;
        let read: u64 = files.iter().map(|f| f.bytes.load(Ordering::SeqCst)).sum();
        if read == records * pieces {
            break;
        }
        assert!(
            read < records * pieces && Instant::now() < deadline,
            "{read} bytes read for {records} records of {pieces}: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}
