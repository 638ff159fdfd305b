//! Filling slots: the CLOCK choice of a victim, the lookahead's speculative reads, and
//! the load task that reads a record into its slot.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::{watch, OwnedSemaphorePermit};

use crate::error::Error;

use super::{Inner, Key, Load, Slot, SlotPool, State};

impl SlotPool {
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

    /// Picks a victim (a slot [`SlotPool::evict`] emptied first, then by CLOCK; near the
    /// floor, a same-layer victim first), evicts it and maps `key` to it in the `Loading`
    /// state.
    pub(super) fn claim_victim(&self, inner: &mut Inner, key: Key) -> Option<usize> {
        let n = inner.slots.len();
        let free = |s: &Slot| s.pins == 0 && s.state != State::Loading && s.state != State::Retired;
        let mut victim = None;
        if inner.holds_every_record(self.index.records()) {
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
        // A slot `evict` emptied (never in a pool of every record), if nothing took it
        // since.
        while victim.is_none() {
            let Some(i) = inner.emptied.pop() else {
                break;
            };
            victim = Some(i).filter(|&i| free(&inner.slots[i]) && inner.slots[i].key.is_none());
        }
        if victim.is_none() && inner.active < 2 * self.floor {
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
                // The load writes the slot's pages again.
                backed: true,
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
    pub(super) fn start_load(
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
}
