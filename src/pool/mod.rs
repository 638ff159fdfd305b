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

mod clock;
mod elastic;
mod experts;
mod pin;
mod read;
mod stats;

pub use elastic::{ElasticOptions, ElasticStats, Governor, Watcher};
pub use experts::{PoolExperts, PoolRecord};
pub use pin::{LayerPin, SlotRecord};
pub use stats::{LayerCounts, Outcome, PoolStats, ResidentSet, TraceEvent};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::{watch, Semaphore};

use crate::checkpoint::Checkpoint;
use crate::checkpoint::{slot_stride, ExpertIndex, RecordLayout};
use crate::error::{Error, Result};
use crate::io::{AlignedBuf, IoMode, Reader};
use crate::pack::PackedRecords;
use crate::records::PoolMemory;

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
    /// Given back by a shrink of an elastic pool ([`SlotPool::resize`]): never claimed,
    /// its memory returned to the OS where the backend allows it.
    Retired,
}

struct Slot {
    key: Option<Key>,
    state: State,
    referenced: bool,
    pins: u32,
    /// Filled by a prefetch and not yet asked for by `ensure`.
    speculative: bool,
    load: Option<watch::Receiver<Load>>,
    /// Number of loads into this slot so far (see [`SlotTag`](crate::records::SlotTag)).
    generation: u64,
    /// Whether the slot's pages are backed by memory: false once a shrink returned them
    /// to the OS, until a load writes them again.
    backed: bool,
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
    /// Slots [`SlotPool::evict`] emptied (or a grow brought back), which a claim takes
    /// before any other victim.
    emptied: Vec<usize>,
    /// Slots not retired: the pool's size now (`slots.len()` but for an elastic pool that
    /// shrank).
    active: usize,
}

impl Inner {
    /// Whether the pool has a slot for every record (each record then has a slot of its
    /// own, in layer order).
    fn holds_every_record(&self, records: usize) -> bool {
        self.active >= records
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
    /// Process-unique id (see [`SlotTag::pool`](crate::records::SlotTag::pool)).
    id: u64,
    /// Whether a shrink may return retired slots' pages to the OS (false where the
    /// backend reads the pool's memory through a mapping of its own,
    /// [`crate::backend::Backend::pool_memory_releasable`]).
    releasable: AtomicBool,
    /// Serializes [`SlotPool::resize`]: a slot's pages are returned outside the lock on
    /// `inner`, and only a resize brings a retired slot back.
    resizing: Mutex<()>,
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
                backed: true,
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
                emptied: Vec::new(),
                active: options.slots,
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
            releasable: AtomicBool::new(true),
            resizing: Mutex::new(()),
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
        Self::open_mirrored(ckpt, index, options, &[], runtime)
    }

    /// [`SlotPool::open`] with copies of the files it reads in `mirrors` (`--mirror`
    /// directories, [`Reader::open_mirrored`]): each read goes to the copy expected to
    /// finish first. Errors: [`Reader::open_mirrored`]'s, besides [`SlotPool::open`]'s.
    pub fn open_mirrored(
        ckpt: &Checkpoint,
        index: Arc<ExpertIndex>,
        options: StreamOptions,
        mirrors: &[std::path::PathBuf],
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
        let reader = Reader::open_mirrored(&paths, mirrors, options.io, options.queue_depth)?;
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

    /// Number of slots in use now: [`SlotPool::capacity`], less those an elastic pool's
    /// shrink retired ([`SlotPool::resize`]).
    pub fn slots(&self) -> usize {
        self.lock().active
    }

    /// Number of slots the pool's memory holds (the most it can grow to).
    pub fn capacity(&self) -> usize {
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
            slots: self.capacity(),
            stride: self.stride,
            layer_records: self.layer_records(),
            memory: self.memory.clone(),
        }
    }

    /// Process-unique id of this pool (see [`SlotTag::pool`](crate::records::SlotTag::pool)).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Distance between slots in bytes (a multiple of 4096).
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Records per MoE layer ([`SlotTag::layer_records`](crate::records::SlotTag::layer_records)).
    pub fn layer_records(&self) -> usize {
        self.index.num_experts
    }

    /// Layout of the records in the slots.
    pub fn layout(&self) -> &RecordLayout {
        &self.index.layout
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

    /// Admits records already read (a prefill sweep's: key and bytes in the record
    /// layout) into victim slots by copying them, as [`SlotPool::admit`] would by reading
    /// them; keys already resident are skipped. Stops early when no slot is free (a
    /// colder start, not an error), and after `limit` admitted. Returns the keys
    /// admitted. The slots are claimed under the pool's lock and filled outside it (a
    /// layer's share can be hundreds of megabytes), like a read: a lookup of one meanwhile
    /// waits for its copy.
    pub fn admit_read(&self, records: &[(Key, &[u8])], limit: usize) -> Vec<Key> {
        let record_bytes = self.index.layout.record_bytes;
        let claimed: Vec<(usize, Key, &[u8], watch::Sender<Load>)> = {
            let mut inner = self.lock();
            let mut claimed = Vec::new();
            for &(key, bytes) in records {
                if claimed.len() == limit {
                    break;
                }
                if inner.map.contains_key(&key) || bytes.len() != record_bytes {
                    continue;
                }
                let Some(i) = self.claim_victim(&mut inner, key) else {
                    break;
                };
                let (tx, rx) = watch::channel(Load::Pending);
                inner.slots[i].load = Some(rx);
                claimed.push((i, key, bytes, tx));
            }
            claimed
        };
        let admitted = claimed.iter().map(|c| c.1).collect();
        for (i, _, bytes, tx) in claimed {
            // SAFETY: slot i is `Loading` with this call's channel as its load: no read
            // writes it, and a lookup pins it only to wait for `tx`.
            let slot = unsafe { self.slot_bytes_mut(i) };
            slot[..record_bytes].copy_from_slice(bytes);
            {
                let mut inner = self.lock();
                inner.slots[i].state = State::Ready;
                inner.slots[i].load = None;
                inner.stats.sweep_admitted += 1;
            }
            let _ = tx.send(Load::Done);
        }
        admitted
    }

    /// Empties the slots of those of `keys` that are resident, loaded, not pinned and not
    /// a prefetch's, for the next claims to take before any other victim; returns the
    /// keys emptied. A prompt's sweeps give back this way the records they admitted that
    /// are no longer among their layer's most used. A pool of every record keeps each in
    /// its place: nothing is emptied.
    pub fn evict(&self, keys: &[Key]) -> Vec<Key> {
        let mut inner = self.lock();
        let mut evicted = Vec::new();
        if inner.holds_every_record(self.index.records()) {
            return evicted;
        }
        for &key in keys {
            let Some(&i) = inner.map.get(&key) else {
                continue;
            };
            let s = &mut inner.slots[i];
            if s.pins != 0 || s.state != State::Ready || s.speculative {
                continue;
            }
            s.key = None;
            s.state = State::Empty;
            s.referenced = false;
            inner.map.remove(&key);
            inner.emptied.push(i);
            evicted.push(key);
        }
        evicted
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
}
