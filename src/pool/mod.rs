//! The slot pool: a fixed set of record-sized slots shared by all layers, filled from the
//! SSD on demand (misses) or ahead of need (lookahead), evicted by CLOCK.
//!
//! Rules (../shared/DESIGN.md, "The slot pool"):
//! - a slot holds one `(layer, expert)` record and a key maps to at most one slot;
//! - a hit sets the slot's reference bit; the CLOCK hand skips pinned and in-flight
//!   slots, clears set bits and evicts the first clear one;
//! - a layer pins its experts' slots until its expert compute is done;
//! - two concurrent requests for the same missing record share one read;
//! - a failed read leaves the slot empty, never valid.
//!
//! Reads are tokio tasks: each waits for a permit (demand reads from the queue-depth
//! semaphore, speculative reads from a separate, smaller one, so speculation never holds
//! a permit a demand read needs) and then runs its `pread`s on the blocking pool.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use serde::Serialize;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use crate::checkpoint::Checkpoint;
use crate::checkpoint::{slot_stride, ExpertIndex, RecordLayout, PIECES_PER_RECORD};
use crate::error::{Error, Result};
use crate::io::{read_range, AlignedBuf, IoMode, RangeRead, Reader};
use crate::pack::PackedRecords;
use crate::records::{ExpertRecord, ExpertSource, HeldRecord, LayerRecords, PoolMemory, SlotTag};

/// `(layer, expert)`.
pub type Key = (u32, u32);

#[derive(Clone, Debug, PartialEq)]
enum Load {
    Pending,
    Done,
    Failed(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Empty,
    Loading,
    Ready,
}

struct Slot {
    key: Option<Key>,
    state: State,
    referenced: bool,
    pins: u32,
    /// Filled by a prefetch and not yet asked for by `ensure`.
    speculative: bool,
    load: Option<watch::Receiver<Load>>,
    /// Number of loads into this slot so far (see [`SlotTag`]).
    generation: u64,
}

/// How a lookup was served, as written to the routing trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Hit,
    Miss,
    /// Served by a lookahead read (landed or still in flight).
    Prefetched,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Hit => "hit",
            Outcome::Miss => "miss",
            Outcome::Prefetched => "prefetched",
        }
    }
}

/// One lookup in the routing trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TraceEvent {
    pub token: u64,
    pub layer: u32,
    pub expert: u32,
    pub outcome: Outcome,
}

/// Per-layer lookup counts.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct LayerCounts {
    pub hits: u64,
    pub misses: u64,
}

/// Counters of a pool since it was built (or since [`SlotPool::reset_stats`]).
///
/// Invariants: `hits + misses` = lookups; `demand_bytes = misses * record_bytes`;
/// `bytes_read = demand_bytes + speculative_bytes + sweep_bytes + admitted_bytes +
/// range_bytes`, everything read from the disk through the pool's reader (a packed
/// record that fails its checksum is read again from the shards and counted once).
#[derive(Clone, Debug, Default, Serialize)]
pub struct PoolStats {
    pub slots: usize,
    pub record_bytes: usize,
    /// Lookups served without a new demand read (resident, or joining a read in flight).
    pub hits: u64,
    /// Lookups that issued a demand read.
    pub misses: u64,
    pub hit_rate: f64,
    /// Every byte read from the disk: the sum of the `*_bytes` counters below but
    /// `wasted_bytes` (which is part of `speculative_bytes`).
    pub bytes_read: u64,
    /// Bytes read by lookups that missed (prefill chunks through the pool, and decode).
    pub demand_bytes: u64,
    pub speculative_reads: u64,
    /// Bytes read ahead of their lookup (lookahead).
    pub speculative_bytes: u64,
    /// Prefetched records later asked for.
    pub prefetches_used: u64,
    /// Prefetched records evicted (or failed) without being asked for.
    pub prefetches_wasted: u64,
    pub wasted_bytes: u64,
    /// Seconds callers of `ensure` spent waiting for reads.
    pub wait_seconds: f64,
    /// The part of `wait_seconds` after the last prefill ended (decode waits).
    pub decode_wait_seconds: f64,
    pub max_in_flight: usize,
    /// Mean reads in flight, sampled at each read start.
    pub mean_in_flight: f64,
    /// Records read from the shards because the pack was unusable for them.
    pub pack_fallbacks: u64,
    /// Bytes read for prefill chunks outside the pool (not part of hits and misses).
    pub sweep_bytes: u64,
    /// Bytes read to admit a prompt's hottest experts at the end of its prefill.
    pub admitted_bytes: u64,
    /// Small reads made for the model besides expert records (n-gram table rows: packed
    /// words, scales and biases), through the same reader.
    pub range_reads: u64,
    /// Bytes of `range_reads`.
    pub range_bytes: u64,
    pub per_layer: Vec<LayerCounts>,
    #[serde(skip)]
    in_flight_samples: u64,
    #[serde(skip)]
    in_flight_sum: u64,
}

/// Where records are read from.
#[allow(clippy::large_enum_variant)] // one per pool
pub enum RecordFiles {
    /// Nine `pread`s per record from the checkpoint's stacked tensors; reader file `i`
    /// is shard `i`.
    Shards,
    /// One `pread` per record from a pack (reader file `pack_file`), with the shards as
    /// the fallback for a record whose checksum does not match.
    Packed {
        pack: PackedRecords,
        pack_file: usize,
    },
}

/// Pool construction parameters.
#[derive(Clone, Copy, Debug)]
pub struct PoolOptions {
    pub slots: usize,
    /// Speculative reads allowed in flight at once.
    pub speculative_cap: usize,
}

/// How a pool for a checkpoint reads its records.
#[derive(Clone, Copy, Debug)]
pub struct StreamOptions {
    pub pool: PoolOptions,
    /// Demand reads in flight at once (default 32).
    pub queue_depth: usize,
    pub io: IoMode,
    /// Use `experts.pack` in the model directory when it is present and valid.
    pub use_pack: bool,
}

impl StreamOptions {
    /// Defaults for a pool of `slots`: queue depth 32, direct I/O, pack if present,
    /// up to 8 speculative reads.
    pub fn with_slots(slots: usize) -> Self {
        StreamOptions {
            pool: PoolOptions {
                slots,
                speculative_cap: DEFAULT_SPECULATIVE_CAP,
            },
            queue_depth: 32,
            io: IoMode::Direct,
            use_pack: true,
        }
    }
}

struct Inner {
    slots: Vec<Slot>,
    map: HashMap<Key, usize>,
    hand: usize,
    stats: PoolStats,
    trace: Option<Vec<TraceEvent>>,
    token: u64,
    /// Per layer, the slots of all its experts as [`SlotPool::pin_layer`] last found them
    /// (checked against the slots before use, so evictions only cost a fresh lookup).
    layer_slots: HashMap<usize, Vec<usize>>,
}

impl Inner {
    /// Marks resident slot `i` referenced for a lookup: a hit, or a prefetch used when a
    /// lookahead read brought it in.
    fn touch(&mut self, i: usize) -> Outcome {
        let s = &mut self.slots[i];
        s.referenced = true;
        if std::mem::take(&mut s.speculative) {
            Outcome::Prefetched
        } else {
            Outcome::Hit
        }
    }

    /// Counts one lookup of `expert` of `layer`: the pool's and the layer's hits or
    /// misses, prefetches used, and the routing trace.
    fn count(&mut self, layer: usize, expert: u32, outcome: Outcome) {
        let miss = outcome == Outcome::Miss;
        if miss {
            self.stats.misses += 1;
        } else {
            self.stats.hits += 1;
        }
        if outcome == Outcome::Prefetched {
            self.stats.prefetches_used += 1;
        }
        if let Some(per_layer) = self.stats.per_layer.get_mut(layer) {
            if miss {
                per_layer.misses += 1;
            } else {
                per_layer.hits += 1;
            }
        }
        let token = self.token;
        if let Some(trace) = self.trace.as_mut() {
            trace.push(TraceEvent {
                token,
                layer: layer as u32,
                expert,
                outcome,
            });
        }
    }
}

/// The shared expert cache. Build with [`SlotPool::new`]; share as `Arc<SlotPool>`.
pub struct SlotPool {
    inner: Mutex<Inner>,
    memory: Arc<AlignedBuf>,
    stride: usize,
    index: Arc<ExpertIndex>,
    files: RecordFiles,
    reader: Reader,
    speculative: Arc<Semaphore>,
    runtime: tokio::runtime::Handle,
    floor: usize,
    in_flight: AtomicUsize,
    /// Process-unique id (see [`SlotTag::pool`]).
    id: u64,
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// Speculative reads a pool allows in flight unless told otherwise.
pub const DEFAULT_SPECULATIVE_CAP: usize = 8;

/// The fewest slots a pool may have: every expert of one layer (a prefill chunk may
/// route to all of them) plus the speculative reads that may be in flight.
pub fn floor_slots(num_experts: usize, speculative_cap: usize) -> usize {
    num_experts + speculative_cap
}

/// Checks that a pool of `slots` is not below [`floor_slots`].
/// Errors: [`Error::Pool`] giving the floor and its terms.
pub fn check_floor(slots: usize, num_experts: usize, speculative_cap: usize) -> Result<()> {
    let floor = floor_slots(num_experts, speculative_cap);
    if slots < floor {
        return Err(Error::Pool(format!(
            "{slots} slots is below the floor of {floor} ({num_experts} experts of one layer + {speculative_cap} speculative reads in flight)"
        )));
    }
    Ok(())
}

impl SlotPool {
    /// Allocates `options.slots` slots for the records of `index`, read by `reader` from
    /// `files`. Reads run on `runtime`.
    /// Errors: fewer slots than the floor (the message gives both numbers), or memory
    /// that cannot be allocated.
    pub fn new(
        index: Arc<ExpertIndex>,
        files: RecordFiles,
        reader: Reader,
        options: PoolOptions,
        runtime: tokio::runtime::Handle,
    ) -> Result<Arc<Self>> {
        let floor = floor_slots(index.num_experts, options.speculative_cap);
        let mut options = options;
        if options.slots > index.records().max(floor) {
            // Slots beyond one per record would never be used.
            tracing::info!(
                asked = options.slots,
                records = index.records(),
                "pool clamped to every record"
            );
            options.slots = index.records().max(floor);
        }
        check_floor(options.slots, index.num_experts, options.speculative_cap)?;
        let stride = slot_stride(index.layout.record_bytes);
        let bytes = stride.checked_mul(options.slots).ok_or_else(|| {
            Error::Pool(format!(
                "{} slots of {stride} bytes overflow the address space",
                options.slots
            ))
        })?;
        let memory = Arc::new(AlignedBuf::zeroed(bytes)?);
        let slots = (0..options.slots)
            .map(|_| Slot {
                key: None,
                state: State::Empty,
                referenced: false,
                pins: 0,
                speculative: false,
                load: None,
                generation: 0,
            })
            .collect();
        let stats = PoolStats {
            slots: options.slots,
            record_bytes: index.layout.record_bytes,
            per_layer: vec![
                LayerCounts::default();
                index.moe_layers.iter().max().map_or(0, |m| m + 1)
            ],
            ..Default::default()
        };
        Ok(Arc::new(SlotPool {
            inner: Mutex::new(Inner {
                slots,
                map: HashMap::new(),
                hand: 0,
                stats,
                trace: None,
                token: 0,
                layer_slots: HashMap::new(),
            }),
            memory,
            stride,
            index,
            files,
            reader,
            speculative: Arc::new(Semaphore::new(options.speculative_cap)),
            runtime,
            floor,
            in_flight: AtomicUsize::new(0),
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
        }))
    }

    /// A pool for the expert records of `ckpt`: reads the pack in the model directory if
    /// it is present and matches (else the shards; the choice is logged).
    pub fn open(
        ckpt: &Checkpoint,
        index: Arc<ExpertIndex>,
        options: StreamOptions,
        runtime: tokio::runtime::Handle,
    ) -> Result<Arc<Self>> {
        let mut paths: Vec<_> = ckpt.shards().iter().map(|s| s.path.clone()).collect();
        let pack = if options.use_pack {
            PackedRecords::open_if_valid(&ckpt.dir, ckpt, &index)
        } else {
            None
        };
        let files = match pack {
            Some(pack) => {
                paths.push(pack.path.clone());
                RecordFiles::Packed {
                    pack,
                    pack_file: paths.len() - 1,
                }
            }
            None => {
                tracing::info!("reading expert records from the checkpoint shards");
                RecordFiles::Shards
            }
        };
        let reader = Reader::open(&paths, options.io, options.queue_depth)?;
        Self::new(index, files, reader, options.pool, runtime)
    }

    /// Whether records come from a pack (one read each) rather than the shards.
    pub fn packed(&self) -> bool {
        matches!(self.files, RecordFiles::Packed { .. })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing in the critical sections panics on valid state; if something did, the
        // counters may be off but slots stay consistent enough to keep serving, so recover.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.lock().slots.len()
    }

    /// The floor this pool was checked against.
    pub fn floor(&self) -> usize {
        self.floor
    }

    /// The pool's memory and how its slots lie, for a backend to place
    /// ([`crate::backend::Backend::attach_pool`]).
    pub fn memory(&self) -> PoolMemory {
        PoolMemory {
            pool: self.id,
            slots: self.slots(),
            stride: self.stride,
            layer_records: self.layer_records(),
            memory: self.memory.clone(),
        }
    }

    /// Process-unique id of this pool (see [`SlotTag::pool`]).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Distance between slots in bytes (a multiple of 4096).
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Records per MoE layer ([`SlotTag::layer_records`]).
    pub fn layer_records(&self) -> usize {
        self.index.num_experts
    }

    /// Layout of the records in the slots.
    pub fn layout(&self) -> &RecordLayout {
        &self.index.layout
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PoolStats {
        let inner = self.lock();
        let mut s = inner.stats.clone();
        s.bytes_read =
            s.demand_bytes + s.speculative_bytes + s.sweep_bytes + s.admitted_bytes + s.range_bytes;
        let lookups = s.hits + s.misses;
        s.hit_rate = if lookups == 0 {
            0.0
        } else {
            s.hits as f64 / lookups as f64
        };
        s.mean_in_flight = if s.in_flight_samples == 0 {
            0.0
        } else {
            s.in_flight_sum as f64 / s.in_flight_samples as f64
        };
        s
    }

    /// Slots pinned now: held by a caller, or in flight (0 when no request runs and no
    /// read is pending).
    pub fn pinned_slots(&self) -> usize {
        self.lock().slots.iter().filter(|s| s.pins > 0).count()
    }

    /// Zeroes the counters (the pool's contents stay).
    pub fn reset_stats(&self) {
        let mut inner = self.lock();
        let layers = inner.stats.per_layer.len();
        inner.stats = PoolStats {
            slots: inner.slots.len(),
            record_bytes: self.index.layout.record_bytes,
            per_layer: vec![LayerCounts::default(); layers],
            ..Default::default()
        };
    }

    /// Starts recording every lookup; [`SlotPool::take_trace`] returns them.
    pub fn enable_trace(&self) {
        self.lock().trace = Some(Vec::new());
    }

    /// The lookups recorded since tracing was enabled (or last taken).
    pub fn take_trace(&self) -> Vec<TraceEvent> {
        self.lock()
            .trace
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Advances the token counter used in the trace (one per forward step).
    pub fn begin_step(&self) {
        self.lock().token += 1;
    }

    /// Slot of `key` if it is resident and valid (for tests and diagnostics).
    pub fn resident(&self, key: Key) -> Option<usize> {
        let inner = self.lock();
        inner
            .map
            .get(&key)
            .copied()
            .filter(|&i| inner.slots[i].state == State::Ready)
    }

    /// Bytes of slot `slot` (the record plus padding).
    ///
    /// # Safety
    /// The caller must hold a pin on a `Ready` slot (or otherwise know no read is
    /// writing it): only the single load of a `Loading` slot writes its bytes.
    unsafe fn slot_bytes(&self, slot: usize) -> &[u8] {
        std::slice::from_raw_parts(self.memory.as_ptr().add(slot * self.stride), self.stride)
    }

    /// Mutable bytes of a slot for its load.
    ///
    /// # Safety
    /// Only the load task of a `Loading` slot may call this, once.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot_bytes_mut(&self, slot: usize) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.memory.as_ptr().add(slot * self.stride), self.stride)
    }

    /// Makes every expert of `experts` for `layer` resident and pinned. Misses are read
    /// concurrently; a record already being read (by another request or a prefetch) is
    /// waited for, not read again. The returned records unpin on drop, also when this
    /// future is dropped before it completes.
    ///
    /// Errors: a read failed (the slot is left empty), or too many slots are pinned or in
    /// flight to find a victim.
    pub async fn ensure(
        self: &Arc<Self>,
        layer: usize,
        experts: &[u32],
    ) -> Result<Vec<SlotRecord>> {
        let mut held = Vec::with_capacity(experts.len());
        let mut waits = Vec::new();
        {
            let mut inner = self.lock();
            for &e in experts {
                let key = (layer as u32, e);
                let (slot, outcome) = match inner.map.get(&key).copied() {
                    Some(i) => {
                        inner.slots[i].pins += 1;
                        if inner.slots[i].state == State::Loading {
                            waits.push(inner.slots[i].load.clone());
                        }
                        (i, inner.touch(i))
                    }
                    None => {
                        let Some(i) = self.claim_victim(&mut inner, key) else {
                            let pinned = inner.slots.iter().filter(|s| s.pins > 0).count();
                            let loading = inner
                                .slots
                                .iter()
                                .filter(|s| s.state == State::Loading)
                                .count();
                            return Err(Error::Pool(format!(
                                "no free slot for layer {layer} expert {e}: {} slots, {pinned} pinned, {loading} reads in flight",
                                inner.slots.len()
                            )));
                        };
                        inner.slots[i].pins = 1;
                        inner.stats.demand_bytes += self.index.layout.record_bytes as u64;
                        waits.push(Some(self.start_load(&mut inner, i, key, None)));
                        (i, Outcome::Miss)
                    }
                };
                held.push(self.slot_record(&inner, slot));
                inner.count(layer, e, outcome);
            }
        }
        if !waits.is_empty() {
            let start = Instant::now();
            for rx in waits.into_iter().flatten() {
                let mut rx = rx;
                let status = rx
                    .wait_for(|s| *s != Load::Pending)
                    .await
                    .map(|s| s.clone());
                match status {
                    Ok(Load::Done) => {}
                    Ok(Load::Failed(msg)) => return Err(Error::Pool(msg)),
                    _ => return Err(Error::Pool("a read was abandoned".into())),
                }
            }
            let waited = start.elapsed().as_secs_f64();
            let mut inner = self.lock();
            inner.stats.wait_seconds += waited;
            inner.stats.decode_wait_seconds += waited;
        }
        Ok(held)
    }

    /// Reads `keys` that are not resident into the pool and waits for them, without
    /// pinning them and without counting them as lookups (they are counted as
    /// `admitted_bytes`): the end-of-prompt admission of the prompt's hottest experts.
    /// Stops early, without error, when no victim is free. Errors: a failed read.
    pub async fn admit(self: &Arc<Self>, keys: &[Key]) -> Result<()> {
        let mut waits = Vec::new();
        {
            let mut inner = self.lock();
            for &key in keys {
                if inner.map.contains_key(&key) {
                    continue;
                }
                let Some(i) = self.claim_victim(&mut inner, key) else {
                    break;
                };
                inner.stats.admitted_bytes += self.index.layout.record_bytes as u64;
                waits.push(self.start_load(&mut inner, i, key, None));
            }
        }
        for mut rx in waits {
            match rx
                .wait_for(|s| *s != Load::Pending)
                .await
                .map(|s| s.clone())
            {
                Ok(Load::Done) => {}
                Ok(Load::Failed(msg)) => return Err(Error::Pool(msg)),
                _ => return Err(Error::Pool("a read was abandoned".into())),
            }
        }
        Ok(())
    }

    /// Starts speculative reads of the experts of `layer` that are not resident, into
    /// victim slots, without pinning them. A later [`SlotPool::ensure`] adopts them.
    /// At most `speculative_cap` such reads are in flight at once; experts beyond that,
    /// or with no free victim, are skipped (speculation never fails a request).
    pub fn prefetch(self: &Arc<Self>, layer: usize, experts: &[u32]) {
        let mut inner = self.lock();
        for &e in experts {
            let key = (layer as u32, e);
            if inner.map.contains_key(&key) {
                continue;
            }
            // The permit is taken before the slot, so at most `speculative_cap` slots are
            // ever held by speculation (the floor counts on that).
            let Ok(permit) = self.speculative.clone().try_acquire_owned() else {
                return;
            };
            let Some(i) = self.claim_victim(&mut inner, key) else {
                return;
            };
            inner.slots[i].speculative = true;
            inner.stats.speculative_reads += 1;
            inner.stats.speculative_bytes += self.index.layout.record_bytes as u64;
            self.start_load(&mut inner, i, key, Some(permit));
        }
    }

    /// Picks a victim by CLOCK (near the floor, a same-layer victim first), evicts it
    /// and maps `key` to it in the `Loading` state.
    fn claim_victim(&self, inner: &mut Inner, key: Key) -> Option<usize> {
        let n = inner.slots.len();
        let free = |s: &Slot| s.pins == 0 && s.state != State::Loading;
        let mut victim = None;
        if n >= self.index.records() {
            // A pool of every record: each record gets a slot of its own, in layer order,
            // so that a layer's records lie together (in one GPU arena where an arena
            // holds a layer, see SlotTag::layer_records; whole-layer routing on the
            // device dispatches once per arena), whatever order they were first asked for
            // in.
            victim = self
                .index
                .moe_position(key.0 as usize)
                .map(|pos| pos * self.index.num_experts + key.1 as usize)
                .filter(|&i| i < n && free(&inner.slots[i]));
        }
        if victim.is_none() && n < 2 * self.floor {
            // Near the floor, evicting another layer's expert would likely evict one the
            // next layers need; the same layer's cold experts are the cheaper loss.
            victim = (0..n).map(|i| (inner.hand + i) % n).find(|&i| {
                free(&inner.slots[i])
                    && inner.slots[i].key.is_some_and(|k| k.0 == key.0)
                    && !inner.slots[i].referenced
            });
        }
        if victim.is_none() {
            for _ in 0..2 * n + 1 {
                let i = inner.hand;
                inner.hand = (inner.hand + 1) % n;
                let s = &mut inner.slots[i];
                if !free(s) {
                    continue;
                }
                if s.state == State::Ready && s.referenced {
                    s.referenced = false;
                    continue;
                }
                victim = Some(i);
                break;
            }
        }
        let i = victim?;
        let generation = inner.slots[i].generation + 1;
        let old = std::mem::replace(
            &mut inner.slots[i],
            Slot {
                key: Some(key),
                state: State::Loading,
                referenced: true,
                pins: 0,
                speculative: false,
                load: None,
                generation,
            },
        );
        if let Some(old_key) = old.key {
            inner.map.remove(&old_key);
            if old.speculative {
                inner.stats.prefetches_wasted += 1;
                inner.stats.wasted_bytes += self.index.layout.record_bytes as u64;
            }
        }
        inner.map.insert(key, i);
        Some(i)
    }

    /// Spawns the read of `key` into slot `i` (already `Loading`); returns its status.
    /// A speculative read brings the permit it was admitted with; a demand read waits
    /// for one of the queue depth's.
    fn start_load(
        self: &Arc<Self>,
        inner: &mut Inner,
        i: usize,
        key: Key,
        speculative: Option<OwnedSemaphorePermit>,
    ) -> watch::Receiver<Load> {
        let (tx, rx) = watch::channel(Load::Pending);
        inner.slots[i].load = Some(rx.clone());
        let pool = self.clone();
        let demand = self.reader.semaphore();
        self.runtime.spawn(async move {
            let permit = match speculative {
                Some(p) => Ok(p),
                None => demand.acquire_owned().await,
            };
            let now = pool.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            {
                let mut inner = pool.lock();
                inner.stats.max_in_flight = inner.stats.max_in_flight.max(now);
                inner.stats.in_flight_sum += now as u64;
                inner.stats.in_flight_samples += 1;
            }
            let reader_pool = pool.clone();
            let result = tokio::task::spawn_blocking(move || reader_pool.read_record(i, key))
                .await
                .unwrap_or_else(|e| Err(Error::Pool(format!("read task failed: {e}"))));
            pool.in_flight.fetch_sub(1, Ordering::SeqCst);
            let mut inner = pool.lock();
            let status = match result {
                Ok(()) => {
                    inner.slots[i].state = State::Ready;
                    Load::Done
                }
                Err(e) => {
                    tracing::warn!(layer = key.0, expert = key.1, error = %e, "expert read failed");
                    let s = &mut inner.slots[i];
                    if s.speculative {
                        inner.stats.prefetches_wasted += 1;
                        inner.stats.wasted_bytes += pool.index.layout.record_bytes as u64;
                    }
                    let s = &mut inner.slots[i];
                    s.state = State::Empty;
                    s.key = None;
                    s.speculative = false;
                    s.referenced = false;
                    inner.map.remove(&key);
                    Load::Failed(e.to_string())
                }
            };
            inner.slots[i].load = None;
            // Released only now that the slot has left `Loading`, so speculation never
            // holds more than its cap of slots, even for a moment.
            drop(permit);
            drop(inner);
            let _ = tx.send(status);
        });
        rx
    }

    /// Pins the records of `experts` of `layer` that are resident (`Ready`) now, without
    /// reading anything or counting lookups; `None` for the others. Prefill sweeps use it
    /// to read only what the pool lacks.
    pub fn pin_resident(
        self: &Arc<Self>,
        layer: usize,
        experts: &[u32],
    ) -> Vec<Option<SlotRecord>> {
        let mut inner = self.lock();
        experts
            .iter()
            .map(|&e| {
                let i = inner.map.get(&(layer as u32, e)).copied()?;
                let s = &mut inner.slots[i];
                if s.state != State::Ready {
                    return None;
                }
                s.pins += 1;
                s.referenced = true;
                if std::mem::take(&mut s.speculative) {
                    inner.stats.prefetches_used += 1;
                }
                Some(self.slot_record(&inner, i))
            })
            .collect()
    }

    /// Every expert record of `layer`, pinned under one lock, when all of them are
    /// resident (`Ready`) now, as in a pool that holds every record; `None` otherwise.
    /// Counts no lookups: [`SlotPool::count_hits`] does once the routing is known.
    pub fn pin_layer(self: &Arc<Self>, layer: usize) -> Option<LayerPin> {
        let mut inner = self.lock();
        let experts = self.index.num_experts;
        let valid = |inner: &Inner, slots: &[usize]| {
            slots.len() == experts
                && slots.iter().enumerate().all(|(e, &i)| {
                    let s = &inner.slots[i];
                    s.state == State::Ready && s.key == Some((layer as u32, e as u32))
                })
        };
        let slots = match inner.layer_slots.remove(&layer) {
            Some(slots) if valid(&inner, &slots) => slots,
            _ => {
                let slots: Vec<usize> = (0..experts as u32)
                    .map(|e| inner.map.get(&(layer as u32, e)).copied())
                    .collect::<Option<_>>()?;
                if !valid(&inner, &slots) {
                    return None;
                }
                slots
            }
        };
        let n = inner.slots.len();
        let tags = slots
            .iter()
            .map(|&i| {
                let s = &mut inner.slots[i];
                s.pins += 1;
                SlotTag {
                    pool: self.id,
                    slot: i,
                    generation: s.generation,
                    slots: n,
                    stride: self.stride,
                    layer_records: self.index.num_experts,
                }
            })
            .collect();
        inner.layer_slots.insert(layer, slots);
        Some(LayerPin {
            pool: self.clone(),
            tags,
            len: self.index.layout.record_bytes,
        })
    }

    /// Counts lookups of `experts` of `layer` served from a [`LayerPin`]: hits (or
    /// prefetches used), per-layer counts and trace events, as [`SlotPool::ensure`] would
    /// have counted them. Experts not resident are skipped.
    pub fn count_hits(&self, layer: usize, experts: &[u32]) {
        let mut inner = self.lock();
        for &e in experts {
            if let Some(i) = inner.map.get(&(layer as u32, e)).copied() {
                let outcome = inner.touch(i);
                inner.count(layer, e, outcome);
            }
        }
    }

    /// A handle on slot `slot`, which the caller has just pinned (the handle unpins it).
    fn slot_record(self: &Arc<Self>, inner: &Inner, slot: usize) -> SlotRecord {
        SlotRecord {
            pool: self.clone(),
            tag: SlotTag {
                pool: self.id,
                slot,
                generation: inner.slots[slot].generation,
                slots: inner.slots.len(),
                stride: self.stride,
                layer_records: self.index.num_experts,
            },
            len: self.index.layout.record_bytes,
        }
    }

    /// Reads the records of `experts` (ascending ids) of `layer` into new buffers outside
    /// the pool, one read per run of consecutive ids (per piece from the shards, or per
    /// run from a pack), up to the queue depth of runs at once. Counted as `sweep_bytes`,
    /// not as hits or misses.
    pub fn read_runs(&self, layer: usize, experts: &[u32]) -> Result<Vec<Vec<u8>>> {
        let mut runs = Vec::new();
        let mut start = 0;
        while start < experts.len() {
            let mut end = start + 1;
            while end < experts.len() && experts[end] == experts[end - 1] + 1 {
                end += 1;
            }
            runs.push((experts[start] as usize, end - start));
            start = end;
        }
        // Plain threads, as the callers are synchronous; each takes the next run.
        let next = std::sync::atomic::AtomicUsize::new(0);
        // Each run's records once its worker has read them.
        type RunSlot = Mutex<Option<Result<Vec<Vec<u8>>>>>;
        let results: Vec<RunSlot> = runs.iter().map(|_| Mutex::new(None)).collect();
        let workers = self.reader.queue_depth().min(runs.len());
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(e0, n)) = runs.get(i) else { break };
                    let run = self.read_run(layer, e0, n);
                    *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(run);
                });
            }
        });
        let mut out = Vec::with_capacity(experts.len());
        for r in results {
            let run = r.into_inner().unwrap_or_else(|p| p.into_inner());
            out.extend(run.ok_or_else(|| Error::Internal("a sweep read was not run".into()))??);
        }
        self.lock().stats.sweep_bytes += (experts.len() * self.index.layout.record_bytes) as u64;
        Ok(out)
    }

    /// The records of experts `e0..e0 + n` of `layer`, read as one run.
    fn read_run(&self, layer: usize, e0: usize, n: usize) -> Result<Vec<Vec<u8>>> {
        let layout = &self.index.layout;
        let mut out: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; layout.record_bytes]).collect();
        match &self.files {
            RecordFiles::Packed { pack, pack_file } => {
                // Aligned memory: a direct read lands in it without a scratch copy (pack
                // offsets and the stride are multiples of the direct-I/O alignment).
                let mut buf = AlignedBuf::zeroed(n * self.stride)?;
                let buf = &mut buf.as_mut_slice()[..n * self.stride];
                read_range(&*self.reader.file(*pack_file), pack.offset(layer, e0)?, buf)?;
                for (i, rec) in out.iter_mut().enumerate() {
                    let bytes = &buf[i * self.stride..i * self.stride + layout.record_bytes];
                    if !pack.check(layer, e0 + i, bytes) {
                        self.read_shard_record(layer, e0 + i, rec)?;
                    } else {
                        rec.copy_from_slice(bytes);
                    }
                }
            }
            RecordFiles::Shards => {
                let first = self.index.ranges(layer, e0).ok_or_else(|| {
                    Error::Pool(format!("no record for layer {layer} expert {e0}"))
                })?;
                for (k, r) in first.iter().enumerate() {
                    let len = r.len as usize;
                    let mut buf = vec![0u8; n * len];
                    read_range(&*self.reader.file(r.shard), r.offset, &mut buf)?;
                    for (i, rec) in out.iter_mut().enumerate() {
                        rec[layout.offsets[k]..layout.offsets[k] + len]
                            .copy_from_slice(&buf[i * len..(i + 1) * len]);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Reads one record from the shards, nine pieces, into `dst` (record layout).
    fn read_shard_record(&self, layer: usize, expert: usize, dst: &mut [u8]) -> Result<()> {
        let ranges = self
            .index
            .ranges(layer, expert)
            .ok_or_else(|| Error::Pool(format!("no record for layer {layer} expert {expert}")))?;
        let layout = &self.index.layout;
        for (k, r) in ranges.iter().enumerate().take(PIECES_PER_RECORD) {
            let at = layout.offsets[k];
            read_range(
                &*self.reader.file(r.shard),
                r.offset,
                &mut dst[at..at + r.len as usize],
            )?;
        }
        Ok(())
    }

    /// Reads `reads` outside the slots (the n-gram table's rows) on the blocking pool,
    /// each holding one of the demand reads' queue-depth permits, so they share the
    /// reader's bound with expert misses; at most half the queue depth of them at once, so
    /// a long prompt's rows do not hold every permit ahead of the first layers' misses.
    /// Returns their bytes in order. Errors: the first failed read, naming its file and
    /// offset.
    pub async fn read_ranges(&self, reads: Vec<RangeRead>) -> Result<Vec<Vec<u8>>> {
        let demand = self.reader.semaphore();
        let share = Arc::new(Semaphore::new((self.reader.queue_depth() / 2).max(1)));
        let runtime = self.runtime.clone();
        {
            let mut inner = self.lock();
            inner.stats.range_reads += reads.len() as u64;
            inner.stats.range_bytes += reads.iter().map(|r| r.len as u64).sum::<u64>();
        }
        futures::future::try_join_all(reads.into_iter().map(|read| {
            let (demand, share, runtime) = (demand.clone(), share.clone(), runtime.clone());
            async move {
                let _share = share
                    .acquire_owned()
                    .await
                    .map_err(|_| Error::Pool("the reader is closed".into()))?;
                let _permit = demand
                    .acquire_owned()
                    .await
                    .map_err(|_| Error::Pool("the reader is closed".into()))?;
                runtime
                    .spawn_blocking(move || read.read())
                    .await
                    .unwrap_or_else(|e| Err(Error::Pool(format!("read task failed: {e}"))))
            }
        }))
        .await
    }

    /// Reads the record of `key` into slot `i` (runs on the blocking pool).
    fn read_record(&self, i: usize, key: Key) -> Result<()> {
        // SAFETY: slot i is Loading and this is its only load (start_load is called once
        // per claim, and a Loading slot is never a victim).
        let dst = unsafe { self.slot_bytes_mut(i) };
        let (layer, expert) = (key.0 as usize, key.1 as usize);
        if let RecordFiles::Packed { pack, pack_file } = &self.files {
            let offset = pack.offset(layer, expert)?;
            let file = self.reader.file(*pack_file);
            match read_range(&*file, offset, &mut dst[..self.stride]) {
                Ok(()) if pack.check(layer, expert, &dst[..self.index.layout.record_bytes]) => {
                    return Ok(())
                }
                outcome => {
                    let why = match outcome {
                        Err(e) => e.to_string(),
                        Ok(()) => "checksum mismatch".into(),
                    };
                    tracing::warn!(layer, expert, %why, "packed record unusable; reading the shards");
                    self.lock().stats.pack_fallbacks += 1;
                }
            }
        }
        self.read_shard_record(layer, expert, dst)
    }
}

/// A pinned, valid record in a slot. Derefs to the record's bytes; unpins on drop.
pub struct SlotRecord {
    pool: Arc<SlotPool>,
    tag: SlotTag,
    len: usize,
}

impl SlotRecord {
    /// The slot index.
    pub fn slot(&self) -> usize {
        self.tag.slot
    }
}

impl HeldRecord for SlotRecord {
    fn slot(&self) -> Option<SlotTag> {
        Some(self.tag)
    }
}

impl std::ops::Deref for SlotRecord {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: a SlotRecord is handed out only after its load completed, and its pin
        // keeps the slot from being evicted (and so rewritten) until drop.
        unsafe { &self.pool.slot_bytes(self.tag.slot)[..self.len] }
    }
}

impl Drop for SlotRecord {
    fn drop(&mut self) {
        let mut inner = self.pool.lock();
        let s = &mut inner.slots[self.tag.slot];
        s.pins = s.pins.saturating_sub(1);
    }
}

/// Every expert record of one layer, pinned ([`SlotPool::pin_layer`]); unpins on drop.
pub struct LayerPin {
    pool: Arc<SlotPool>,
    /// In expert order.
    tags: Vec<SlotTag>,
    len: usize,
}

impl LayerRecords for LayerPin {
    fn records(&self) -> Vec<ExpertRecord<'_>> {
        self.tags
            .iter()
            .map(|t| ExpertRecord {
                // SAFETY: every slot is pinned and was Ready when pinned, so it is neither
                // evicted nor rewritten until this pin drops.
                bytes: unsafe { &self.pool.slot_bytes(t.slot)[..self.len] },
                slot: Some(*t),
            })
            .collect()
    }
}

impl Drop for LayerPin {
    fn drop(&mut self) {
        let mut inner = self.pool.lock();
        for t in &self.tags {
            let s = &mut inner.slots[t.slot];
            s.pins = s.pins.saturating_sub(1);
        }
    }
}

/// The pool as the model's expert source: `fetch` blocks on `ensure`. Call the forward
/// pass from a thread that is not one of the runtime's workers (a plain thread or
/// `spawn_blocking`).
pub struct PoolExperts {
    pub pool: Arc<SlotPool>,
    /// Run the lookahead routers and prefetch what they pick.
    pub lookahead: bool,
    /// Routes per (layer, expert) during the current prompt's prefill, for admission.
    prompt_uses: Mutex<HashMap<Key, u64>>,
}

impl PoolExperts {
    /// A source over `pool`, with lookahead on.
    pub fn new(pool: Arc<SlotPool>) -> Self {
        PoolExperts {
            pool,
            lookahead: true,
            prompt_uses: Mutex::default(),
        }
    }

    /// Slots per MoE layer a prompt's experts may take: an equal share of the pool less
    /// the speculative reserve.
    fn admission_quota(&self) -> usize {
        let layers = self.pool.index.moe_layers.len().max(1);
        let spare = self
            .pool
            .slots()
            .saturating_sub(self.pool.floor() - self.pool.index.num_experts);
        spare / layers
    }
}

/// A record from [`PoolExperts`]: pinned in a slot, or read for one prefill chunk
/// outside the pool.
pub enum PoolRecord {
    Slot(SlotRecord),
    Sweep(Vec<u8>),
}

impl std::ops::Deref for PoolRecord {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            PoolRecord::Slot(r) => r,
            PoolRecord::Sweep(v) => v,
        }
    }
}

impl HeldRecord for PoolRecord {
    fn slot(&self) -> Option<SlotTag> {
        match self {
            PoolRecord::Slot(r) => HeldRecord::slot(r),
            PoolRecord::Sweep(_) => None,
        }
    }
}

impl ExpertSource for PoolExperts {
    type Record<'a> = PoolRecord;

    fn fetch(&self, layer: usize, experts: &[u32]) -> Result<Vec<PoolRecord>> {
        Ok(
            futures::executor::block_on(self.pool.ensure(layer, experts))?
                .into_iter()
                .map(PoolRecord::Slot)
                .collect(),
        )
    }

    /// A prefill chunk's experts: when they fit the layer's share of the pool (what the
    /// end of the prompt would admit anyway), through the pool, so they are read once;
    /// otherwise outside it, in runs of consecutive ids (one read per run and piece, or
    /// per run in a pack), so a long prompt does not churn the pool. Uses are counted for
    /// [`ExpertSource::end_prefill`].
    fn fetch_prefill(
        &self,
        layer: usize,
        experts: &[u32],
        uses: &[u32],
    ) -> Result<Vec<PoolRecord>> {
        {
            let mut counts = self.prompt_uses.lock().unwrap_or_else(|p| p.into_inner());
            for (&e, &n) in experts.iter().zip(uses) {
                *counts.entry((layer as u32, e)).or_default() += n as u64;
            }
        }
        if experts.len() <= self.admission_quota() {
            return self.fetch(layer, experts);
        }
        // Records already in the pool are used where they are; the rest are read in runs.
        let resident = self.pool.pin_resident(layer, experts);
        let missing: Vec<u32> = experts
            .iter()
            .zip(&resident)
            .filter(|(_, r)| r.is_none())
            .map(|(&e, _)| e)
            .collect();
        let mut read = self.pool.read_runs(layer, &missing)?.into_iter();
        resident
            .into_iter()
            .map(|r| match r {
                Some(r) => Ok(PoolRecord::Slot(r)),
                None => read
                    .next()
                    .map(PoolRecord::Sweep)
                    .ok_or_else(|| Error::Internal("a sweep read went missing".into())),
            })
            .collect()
    }

    /// Admits the prompt's most used experts into the pool (an equal share of the slots
    /// per layer, hottest first), so decoding starts warm, and starts counting decode waits.
    fn end_prefill(&self, admit: bool) {
        let counts =
            std::mem::take(&mut *self.prompt_uses.lock().unwrap_or_else(|p| p.into_inner()));
        if admit && !counts.is_empty() {
            let quota = self.admission_quota();
            let mut by_layer: std::collections::BTreeMap<u32, Vec<(u64, u32)>> = Default::default();
            for ((l, e), n) in counts {
                by_layer.entry(l).or_default().push((n, e));
            }
            let mut keys = Vec::new();
            for (layer, mut list) in by_layer {
                list.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
                keys.extend(list.iter().take(quota).map(|&(_, e)| (layer, e)));
            }
            // A failure here only means a colder start.
            if let Err(e) = futures::executor::block_on(self.pool.admit(&keys)) {
                tracing::warn!(error = %e, "admitting the prompt's experts failed");
            }
        }
        self.pool.lock().stats.decode_wait_seconds = 0.0;
    }

    fn begin_step(&self) {
        self.pool.begin_step();
    }

    /// On when asked for, unless the pool holds every record (nothing to read ahead, and
    /// each guess would cost a GPU read-back).
    fn lookahead(&self) -> bool {
        self.lookahead && self.pool.slots() < self.pool.index.records()
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        self.pool.prefetch(layer, experts);
    }

    /// Only when the pool holds every record: a streaming pool that happens to have a
    /// whole layer ready would otherwise pin all of it for the step.
    fn resident_layer(&self, layer: usize) -> Option<Box<dyn LayerRecords + '_>> {
        if self.pool.slots() < self.pool.index.records() {
            return None;
        }
        self.pool
            .pin_layer(layer)
            .map(|p| Box::new(p) as Box<dyn LayerRecords>)
    }

    fn count_lookups(&self, layer: usize, experts: &[u32]) {
        self.pool.count_hits(layer, experts);
    }

    fn read_ranges(&self, reads: Vec<RangeRead>) -> Result<Vec<Vec<u8>>> {
        futures::executor::block_on(self.pool.read_ranges(reads))
    }
}
