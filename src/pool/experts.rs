//! The pool as the model's [`ExpertSource`]: [`PoolExperts`].

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::io::RangeRead;
use crate::records::{ExpertSource, HeldRecord, LayerRecords, SlotTag};

use super::{Key, SlotPool, SlotRecord};

/// The pool as the model's expert source: `fetch` blocks on `ensure`. Call the forward
/// pass from a thread that is not one of the runtime's workers (a plain thread or
/// `spawn_blocking`).
pub struct PoolExperts {
    pub pool: Arc<SlotPool>,
    /// Run the lookahead routers and prefetch what they pick.
    pub lookahead: bool,
    /// What the current prompt's prefill has done so far.
    prompt: Mutex<Prompt>,
    /// The next MoE layer's sweep, when one was started ahead of its chunk.
    ahead: Mutex<Option<ReadAhead>>,
}

/// A chunk that routes to at least this share of a layer's experts has the next MoE
/// layer's missing records read while it computes (the next layer's routes most likely
/// touch as many: a chunk of 256 tokens with top-10 of 512 experts touches 99% of them),
/// so the disk reads while the device computes, and about a tenth at most of what is read
/// ahead goes unused (0.7% of what a 512-token prompt read, BENCHMARKS.md).
const READ_AHEAD_SHARE: f64 = 0.9;

/// A sweep of a layer's records started before its chunk asked for them.
struct ReadAhead {
    layer: usize,
    /// The records it reads (ascending ids): those the pool lacked when it started.
    ids: Vec<u32>,
    reads: JoinHandle<Result<Vec<Vec<u8>>>>,
}

impl ReadAhead {
    /// Its records, once read; `None` if the read failed (the chunk then reads them
    /// itself, and reports the error if it fails again).
    fn join(self) -> Option<(Vec<u32>, Vec<Vec<u8>>)> {
        match self.reads.join() {
            Ok(Ok(reads)) => Some((self.ids, reads)),
            Ok(Err(e)) => {
                tracing::debug!(layer = self.layer, error = %e, "a sweep read ahead failed");
                None
            }
            Err(_) => None,
        }
    }
}

/// A prompt's prefill so far, for the admission of its most used experts.
#[derive(Default)]
struct Prompt {
    /// Routes per (layer, expert).
    uses: HashMap<Key, u64>,
    /// Per layer, the experts its sweeps have put into slots.
    swept: HashMap<u32, HashSet<u32>>,
}

impl Prompt {
    /// The experts `layer`'s sweeps put into slots that are not in `hot`.
    fn stale(&self, layer: u32, hot: &[u32]) -> Vec<Key> {
        self.swept.get(&layer).map_or_else(Vec::new, |held| {
            held.iter()
                .filter(|e| !hot.contains(e))
                .map(|&e| (layer, e))
                .collect()
        })
    }
}

impl PoolExperts {
    /// A source over `pool`, with lookahead on.
    pub fn new(pool: Arc<SlotPool>) -> Self {
        PoolExperts {
            pool,
            lookahead: true,
            prompt: Mutex::default(),
            ahead: Mutex::default(),
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

/// The `quota` most used experts of a layer's `(uses, expert)` list, most used first (ties
/// by id): the ones the end of a prompt admits.
fn hottest(mut list: Vec<(u64, u32)>, quota: usize) -> impl Iterator<Item = u32> {
    list.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    list.into_iter().take(quota).map(|(_, e)| e)
}

/// The ids of `ids` whose entry in `found` is `None` (what is left to read), in order.
fn gaps<T>(ids: &[u32], found: &[Option<T>]) -> Vec<u32> {
    ids.iter()
        .zip(found)
        .filter(|(_, r)| r.is_none())
        .map(|(&e, _)| e)
        .collect()
}

/// `found` with each `None` filled, in order, from `read` (the reads of its [`gaps`]).
/// Errors: fewer reads than gaps.
fn fill_gaps<T>(found: Vec<Option<T>>, read: Vec<T>) -> Result<Vec<T>> {
    let mut read = read.into_iter();
    found
        .into_iter()
        .map(|r| {
            r.or_else(|| read.next())
                .ok_or_else(|| Error::Internal("a sweep read went missing".into()))
        })
        .collect()
}

impl PoolExperts {
    /// Puts the records a sweep of `layer` just read (`ids`, ascending, and `read`) that
    /// the end of the prompt would admit (the layer's most used so far, its share of the
    /// slots) into slots now, from the sweep's buffers, so that the admission does not
    /// read them again (a 2,048-token prompt on 30% of the records re-read 6.05 GB of
    /// 21.74). The records earlier chunks' sweeps put in that are no longer among the
    /// most used are given back first, so the layer's sweeps never hold more than its
    /// share.
    fn admit_swept(&self, layer: usize, ids: &[u32], read: &[Vec<u8>]) {
        let quota = self.admission_quota();
        if quota == 0 || ids.is_empty() {
            return;
        }
        let l = layer as u32;
        let (hot, stale) = {
            let prompt = self.lock_prompt();
            let list = prompt
                .uses
                .iter()
                .filter(|((pl, _), _)| *pl == l)
                .map(|(&(_, e), &n)| (n, e))
                .collect();
            let hot: Vec<u32> = hottest(list, quota).collect();
            let stale = prompt.stale(l, &hot);
            (hot, stale)
        };
        let given_back = self.pool.evict(&stale);
        let room = {
            let mut prompt = self.lock_prompt();
            let held = prompt.swept.entry(l).or_default();
            for (_, e) in &given_back {
                held.remove(e);
            }
            // What other reads evicted meanwhile holds no slot; stale records still pinned
            // (this chunk uses them) count against the share.
            held.retain(|&e| self.pool.resident((l, e)).is_some());
            quota.saturating_sub(held.len())
        };
        // Hottest first: if the slots run out, the records left out are the coldest.
        let records: Vec<(Key, &[u8])> = hot
            .iter()
            .filter_map(|e| {
                let at = ids.binary_search(e).ok()?;
                Some(((l, *e), &read[at][..]))
            })
            .collect();
        let admitted = self.pool.admit_read(&records, room);
        self.lock_prompt()
            .swept
            .entry(l)
            .or_default()
            .extend(admitted.iter().map(|&(_, e)| e));
    }

    fn lock_prompt(&self) -> std::sync::MutexGuard<'_, Prompt> {
        self.prompt.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The sweep read ahead for `layer` (`None`: for none), once read; one for another
    /// layer is waited for, dropped and counted as unused.
    fn take_ahead(&self, layer: Option<usize>) -> Option<(Vec<u32>, Vec<Vec<u8>>)> {
        let ahead = self
            .ahead
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        let same = Some(ahead.layer) == layer;
        let read = ahead.join()?;
        if same {
            return Some(read);
        }
        self.pool.lock().stats.sweep_unused += read.0.len() as u64;
        None
    }

    /// Starts reading the records of the MoE layer after `layer` that the pool lacks,
    /// when `layer`'s chunk routed to `touched` experts, at least [`READ_AHEAD_SHARE`] of
    /// them.
    fn read_ahead_after(&self, layer: usize, touched: usize) {
        let index = &self.pool.index;
        if (touched as f64) < READ_AHEAD_SHARE * index.num_experts as f64 {
            return;
        }
        let Some(&next) = index.moe_layers.iter().find(|&&l| l > layer) else {
            return;
        };
        let ids: Vec<u32> = (0..index.num_experts as u32)
            .filter(|&e| self.pool.resident((next as u32, e)).is_none())
            .collect();
        if ids.is_empty() {
            return;
        }
        let (pool, read) = (self.pool.clone(), ids.clone());
        match std::thread::Builder::new()
            .name("sweep-ahead".into())
            .spawn(move || pool.read_runs(next, &read))
        {
            Ok(reads) => {
                *self.ahead.lock().unwrap_or_else(|p| p.into_inner()) = Some(ReadAhead {
                    layer: next,
                    ids,
                    reads,
                })
            }
            // The chunk reads them itself then.
            Err(e) => tracing::debug!(error = %e, "no thread for a sweep read ahead"),
        }
    }

    /// The records of `missing` (ascending ids) of `layer`: from the sweep read ahead
    /// for it, the rest read now. Counts the records read ahead that the chunk did not
    /// need, and the time spent waiting for reads.
    fn sweep(&self, layer: usize, missing: &[u32]) -> Result<Vec<Vec<u8>>> {
        let start = Instant::now();
        let read = match self.take_ahead(Some(layer)) {
            None => self.pool.read_runs(layer, missing),
            Some((ids, mut reads)) => {
                let taken: Vec<Option<Vec<u8>>> = missing
                    .iter()
                    .map(|e| {
                        ids.binary_search(e)
                            .ok()
                            .map(|at| std::mem::take(&mut reads[at]))
                    })
                    .collect();
                let rest = gaps(missing, &taken);
                let used = missing.len() - rest.len();
                self.pool.lock().stats.sweep_unused += (ids.len() - used) as u64;
                self.pool
                    .read_runs(layer, &rest)
                    .and_then(|read| fill_gaps(taken, read))
            }
        };
        self.pool.lock().stats.sweep_wait_seconds += start.elapsed().as_secs_f64();
        read
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
            PoolRecord::Sweep(r) => r,
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
            let mut prompt = self.lock_prompt();
            for (&e, &n) in experts.iter().zip(uses) {
                *prompt.uses.entry((layer as u32, e)).or_default() += n as u64;
            }
        }
        if experts.len() <= self.admission_quota() {
            return self.fetch(layer, experts);
        }
        // Records already in the pool are used where they are; the rest are read in runs.
        let resident = self.pool.pin_resident(layer, experts);
        let missing = gaps(experts, &resident);
        let read = self.sweep(layer, &missing)?;
        self.read_ahead_after(layer, experts.len());
        self.admit_swept(layer, &missing, &read);
        fill_gaps(
            resident
                .into_iter()
                .map(|r| r.map(PoolRecord::Slot))
                .collect(),
            read.into_iter().map(PoolRecord::Sweep).collect(),
        )
    }

    /// Admits the prompt's most used experts into the pool (an equal share of the slots
    /// per layer, hottest first), so decoding starts warm, and starts counting decode waits.
    /// What the sweeps put in that is not among them is given back first.
    fn end_prefill(&self, admit: bool) {
        // A sweep read ahead for a chunk that never came (the prompt ended early).
        self.take_ahead(None);
        let prompt = std::mem::take(&mut *self.lock_prompt());
        if admit && !prompt.uses.is_empty() {
            let quota = self.admission_quota();
            let mut by_layer: std::collections::BTreeMap<u32, Vec<(u64, u32)>> = Default::default();
            for (&(l, e), &n) in &prompt.uses {
                by_layer.entry(l).or_default().push((n, e));
            }
            let (mut keys, mut stale) = (Vec::new(), Vec::new());
            for (layer, list) in by_layer {
                let hot: Vec<u32> = hottest(list, quota).collect();
                stale.extend(prompt.stale(layer, &hot));
                keys.extend(hot.into_iter().map(|e| (layer, e)));
            }
            // What the sweeps put in and is no longer among the most used makes room
            // first (nothing pins it now).
            self.pool.evict(&stale);
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

    /// While the pool has fewer slots than records (then [`ExpertSource::resident_layer`]
    /// offers none).
    fn streams(&self) -> bool {
        self.pool.slots() < self.pool.index.records()
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
