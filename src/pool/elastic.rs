//! The elastic pool: a watcher reads the memory the machine has left and shrinks the pool
//! when it runs short, growing it again (never past its plan) when the memory comes back.
//!
//! The reference system's governor does the same between requests (reference-system.md
//! B.3: shrink and grow dead-bands, a grow cooldown). Here it runs while requests do: a
//! shrink retires slots that no request holds (the emptiest first, then the coldest by
//! CLOCK: never a pinned or loading one, never below the floor) and returns their pages
//! to the OS ([`crate::io::AlignedBuf::release`]); a grow brings retired slots back empty.
//! The records in slots are the checkpoint's bytes wherever they sit, so a run's output is
//! the same whatever the pool's size.
//!
//! Hysteresis ([`Governor`]): the pool shrinks when the memory left falls below a low-water
//! mark (or PSI reports the machine stalling on memory), by as many slots as bring the
//! memory left back to the middle of the band; it grows only once the memory left has
//! stayed above a high-water mark for a hold time, by as many slots as bring it back to
//! the middle. Either move leaves the memory left inside the band, so the next reading
//! neither shrinks nor grows.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::machine::{MemoryProbe, MemoryReading};

use super::{SlotPool, State};

/// When the watcher shrinks and grows the pool.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ElasticOptions {
    /// Shrink when the memory left ([`crate::machine::MachineMemory::room`]) falls below
    /// this many bytes.
    pub low_water: u64,
    /// Grow when the memory left has stayed above this many bytes for `hold`.
    pub high_water: u64,
    /// How long the memory left must stay above `high_water` before a grow.
    pub hold: Duration,
    /// Between readings.
    pub interval: Duration,
    /// PSI `some avg10` (percent) at or above which the machine counts as short whatever
    /// it has left: the pool sheds at least an eighth of its slots above the floor and
    /// does not grow.
    pub pressure: f64,
}

impl ElasticOptions {
    /// For a machine (or cgroup) of `ram` bytes: low water 5% of it, within 256 MiB to
    /// 2 GiB (the reference system keeps max(1.5 GB, 5% of RAM) free, B.3); high water
    /// twice that; a 5 s hold; a reading every second; 10% pressure.
    pub fn for_ram(ram: u64) -> Self {
        let low_water = (ram / 20).clamp(256 << 20, 2 << 30);
        ElasticOptions {
            low_water,
            high_water: 2 * low_water,
            hold: Duration::from_secs(5),
            interval: Duration::from_secs(1),
            pressure: 10.0,
        }
    }
}

/// An elastic pool's resizes since it was built ([`super::PoolStats::elastic`]).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ElasticStats {
    /// The most slots the pool grows to: its plan's.
    pub max_slots: usize,
    /// The fewest it shrinks to.
    pub floor: usize,
    /// Resizes that retired slots.
    pub shrinks: u64,
    /// Resizes that brought slots back.
    pub grows: u64,
    /// Slots retired, over all shrinks.
    pub slots_retired: u64,
    /// Slots brought back, over all grows.
    pub slots_restored: u64,
    /// Bytes of retired slots' pages returned to the OS.
    pub bytes_returned: u64,
    /// Whether retired slots keep their memory: the backend reads the pool's memory
    /// through a mapping of its own (a GPU that imported it), so its pages cannot be
    /// returned while it is attached.
    pub memory_kept: bool,
    /// The memory left at the watcher's last reading, in bytes.
    pub last_room: Option<u64>,
}

/// Decides the pool's size from memory readings, with hysteresis (see the module's
/// documentation). Pure: time is given, not read, so a scripted sequence of readings
/// gives exact sizes.
#[derive(Clone, Debug)]
pub struct Governor {
    options: ElasticOptions,
    max_slots: usize,
    floor: usize,
    slot_bytes: u64,
    /// When the memory left rose above the high-water mark (and has stayed there).
    above_since: Option<Duration>,
}

impl Governor {
    /// A governor for a pool of at most `max_slots` and at least `floor` slots of
    /// `slot_bytes` each.
    pub fn new(options: ElasticOptions, max_slots: usize, floor: usize, slot_bytes: u64) -> Self {
        Governor {
            options,
            max_slots,
            floor: floor.min(max_slots),
            slot_bytes: slot_bytes.max(1),
            above_since: None,
        }
    }

    /// The slots the pool should have after `reading` at `now` (time since the watcher
    /// started), given `slots` in use of which `unbacked` have no memory yet (brought
    /// back by a grow and not yet filled: they will take memory the reading still counts
    /// as left).
    pub fn decide(
        &mut self,
        now: Duration,
        reading: &MemoryReading,
        slots: usize,
        unbacked: usize,
    ) -> usize {
        let o = &self.options;
        let room = reading
            .memory
            .room()
            .saturating_sub(unbacked as u64 * self.slot_bytes);
        let mid = o.low_water / 2 + o.high_water / 2;
        let pressed = reading.pressure.is_some_and(|p| p >= o.pressure);
        if room < o.low_water || pressed {
            self.above_since = None;
            let mut shed = (mid.saturating_sub(room)).div_ceil(self.slot_bytes) as usize;
            if pressed {
                shed = shed.max((slots.saturating_sub(self.floor) / 8).max(1));
            }
            return slots.saturating_sub(shed).max(self.floor).min(slots);
        }
        if room <= o.high_water || slots >= self.max_slots {
            self.above_since = None;
            return slots;
        }
        let since = *self.above_since.get_or_insert(now);
        if now.saturating_sub(since) < o.hold {
            return slots;
        }
        // Held long enough: grow, then hold again before the next grow.
        self.above_since = None;
        let add = ((room - mid) / self.slot_bytes) as usize;
        (slots + add).min(self.max_slots)
    }
}

impl SlotPool {
    /// Resizes the pool to `target` slots, within its floor and its capacity: a shrink
    /// retires slots no request holds (empty ones first, then the coldest by CLOCK, whose
    /// records leave the pool) and returns their pages to the OS unless the backend reads
    /// the pool's memory through a mapping of its own; a grow brings retired slots back,
    /// empty. A shrink retires fewer when too many slots are pinned or loading. Returns
    /// the slots in use after it.
    pub fn resize(&self, target: usize) -> usize {
        let _resizing = self.resizing.lock().unwrap_or_else(|p| p.into_inner());
        let mut inner = self.lock();
        let n = inner.slots.len();
        let target = target.clamp(self.floor.min(n), n);
        let before = inner.active;
        let record_bytes = self.index.layout.record_bytes as u64;
        self.elastic_stats(&mut inner);
        if target > before {
            let mut restored = 0;
            for i in 0..n {
                if before + restored == target {
                    break;
                }
                if inner.slots[i].state == State::Retired {
                    inner.slots[i].state = State::Empty;
                    inner.emptied.push(i);
                    restored += 1;
                }
            }
            inner.active += restored;
            let e = inner.stats.elastic.get_or_insert_with(Default::default);
            e.grows += 1;
            e.slots_restored += restored as u64;
            inner.stats.slots = inner.active;
            tracing::info!(
                slots = inner.active,
                restored,
                "elastic pool grew to {} slots",
                inner.active
            );
            return inner.active;
        }
        if target == before {
            return before;
        }
        let want = before - target;
        let mut retired: Vec<(usize, bool)> = Vec::with_capacity(want);
        let retire = |inner: &mut super::Inner, i: usize, retired: &mut Vec<(usize, bool)>| {
            let s = &mut inner.slots[i];
            let (old, speculative, backed) = (s.key.take(), s.speculative, s.backed);
            s.state = State::Retired;
            s.referenced = false;
            s.speculative = false;
            if let Some(key) = old {
                inner.map.remove(&key);
            }
            if speculative {
                inner.stats.prefetches_wasted += 1;
                inner.stats.wasted_bytes += record_bytes;
            }
            retired.push((i, backed));
        };
        // Empty slots first: nothing is lost with them.
        for i in 0..n {
            if retired.len() == want {
                break;
            }
            let s = &inner.slots[i];
            if s.state == State::Empty && s.pins == 0 {
                retire(&mut inner, i, &mut retired);
            }
        }
        // Then the coldest by CLOCK: the hand clears reference bits as it passes.
        for _ in 0..2 * n + 1 {
            if retired.len() == want {
                break;
            }
            let i = inner.hand;
            inner.hand = (inner.hand + 1) % n;
            let s = &mut inner.slots[i];
            if s.pins > 0 || s.state != State::Ready {
                continue;
            }
            if s.referenced {
                s.referenced = false;
                continue;
            }
            retire(&mut inner, i, &mut retired);
        }
        inner.active -= retired.len();
        inner.stats.slots = inner.active;
        let after = inner.active;
        drop(inner);
        // Outside the pool's lock (a shrink may return gigabytes): a retired slot is
        // never claimed, and only a resize (which holds `resizing`) brings one back.
        let release = self.releasable.load(std::sync::atomic::Ordering::Relaxed);
        let mut returned = Vec::new();
        let mut bytes = 0;
        if release {
            for &(i, backed) in &retired {
                if backed {
                    // SAFETY: slot i is retired: no pin, no load, no claim touches it
                    // until a resize brings it back, and none can run meanwhile.
                    let b = unsafe { self.memory.release(i * self.stride, self.stride) };
                    if b > 0 {
                        bytes += b as u64;
                        returned.push(i);
                    }
                }
            }
        }
        let mut inner = self.lock();
        for &i in &returned {
            inner.slots[i].backed = false;
        }
        let e = inner.stats.elastic.get_or_insert_with(Default::default);
        if !retired.is_empty() {
            e.shrinks += 1;
            e.slots_retired += retired.len() as u64;
            e.bytes_returned += bytes;
        }
        e.memory_kept = !release;
        tracing::info!(
            slots = after,
            retired = retired.len(),
            returned = bytes,
            "elastic pool shrank to {after} slots, {:.1} MiB returned to the OS{}",
            bytes as f64 / (1u64 << 20) as f64,
            if release {
                ""
            } else {
                " (the backend maps the pool's memory: kept)"
            }
        );
        after
    }

    /// Slots in use whose pages were returned to the OS and not yet written again.
    pub fn unbacked_slots(&self) -> usize {
        self.lock()
            .slots
            .iter()
            .filter(|s| s.state != State::Retired && !s.backed)
            .count()
    }

    /// Whether a shrink may return retired slots' pages to the OS (true unless set
    /// otherwise: see [`crate::backend::Backend::pool_memory_releasable`]).
    pub fn set_releasable(&self, releasable: bool) {
        self.releasable
            .store(releasable, std::sync::atomic::Ordering::Relaxed);
    }

    /// Starts the pool's elastic counters (its capacity as the most slots, its floor) if
    /// they are not yet.
    fn elastic_stats(&self, inner: &mut super::Inner) {
        if inner.stats.elastic.is_none() {
            inner.stats.elastic = Some(ElasticStats {
                max_slots: inner.slots.len(),
                floor: self.floor,
                memory_kept: !self.releasable.load(std::sync::atomic::Ordering::Relaxed),
                ..Default::default()
            });
        }
    }
}

/// Reads a [`MemoryProbe`] and resizes a pool by its [`Governor`]: [`Watcher::step`] by
/// hand (tests), or [`Watcher::spawn`] as a task that reads every
/// [`ElasticOptions::interval`] while the pool lives.
pub struct Watcher {
    pool: Weak<SlotPool>,
    probe: Arc<dyn MemoryProbe>,
    governor: Governor,
}

impl Watcher {
    /// A watcher of `pool`, which grows up to the slots it has now (its plan's) and
    /// shrinks down to its floor.
    pub fn new(pool: &Arc<SlotPool>, probe: Arc<dyn MemoryProbe>, options: ElasticOptions) -> Self {
        let max_slots = pool.slots();
        let slot_bytes = pool.stride as u64;
        {
            let mut inner = pool.lock();
            pool.elastic_stats(&mut inner);
            if let Some(e) = inner.stats.elastic.as_mut() {
                e.max_slots = max_slots;
            }
        }
        Watcher {
            pool: Arc::downgrade(pool),
            probe,
            governor: Governor::new(options, max_slots, pool.floor(), slot_bytes),
        }
    }

    /// Reads the probe once at `now` (time since the watcher started) and resizes the
    /// pool as the governor decides. Returns the slots in use after it; `None` once the
    /// pool is gone. A probe that cannot be read leaves the pool as it is.
    pub fn step(&mut self, now: Duration) -> Option<usize> {
        let pool = self.pool.upgrade()?;
        let slots = pool.slots();
        let Some(reading) = self.probe.read() else {
            return Some(slots);
        };
        if let Some(e) = pool.lock().stats.elastic.as_mut() {
            e.last_room = Some(reading.memory.room());
        }
        let target = self
            .governor
            .decide(now, &reading, slots, pool.unbacked_slots());
        if target == slots {
            return Some(slots);
        }
        tracing::debug!(
            room = reading.memory.room(),
            pressure = ?reading.pressure,
            slots,
            target,
            "elastic pool: resizing"
        );
        Some(pool.resize(target))
    }

    /// Runs [`Watcher::step`] every `interval` on `runtime` until the pool is dropped.
    pub fn spawn(mut self, runtime: &tokio::runtime::Handle) {
        let interval = self.governor.options.interval;
        runtime.spawn(async move {
            let start = Instant::now();
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                if self.step(start.elapsed()).is_none() {
                    break;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::MachineMemory;
    use proptest::prelude::*;

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

    proptest! {
        /// On a machine whose other users take a fixed amount, the pool settles within a
        /// few readings and then stays: the memory left inside the band (or the pool at
        /// its floor or its plan), and no reading after that shrinks or grows it. (The
        /// machine has room for the whole pool beyond the others' share, `extra` over,
        /// so that a reading is never clipped at zero.)
        #[test]
        fn the_pool_settles_and_does_not_oscillate(
            slot_mib in 1u64..64,
            max_slots in 40usize..2000,
            floor in 8usize..40,
            others_gib in 0u64..64,
            extra_mib in 0u64..(64 << 10),
            low_gib in 1u64..4,
            hold in 0u64..4,
        ) {
            let slot = slot_mib << 20;
            let total = (others_gib << 30) + max_slots as u64 * slot + (extra_mib << 20);
            let options = ElasticOptions {
                low_water: low_gib << 30,
                high_water: 2 * (low_gib << 30),
                hold: Duration::from_secs(hold),
                interval: Duration::from_secs(1),
                pressure: 10.0,
            };
            let mut g = Governor::new(options, max_slots, floor, slot);
            let room = |slots: usize| total.saturating_sub((others_gib << 30) + slots as u64 * slot);
            let mut slots = max_slots;
            let mut history = Vec::new();
            for t in 0..40 {
                slots = g.decide(Duration::from_secs(t), &reading(room(slots), None), slots, 0);
                prop_assert!(slots >= floor && slots <= max_slots);
                history.push(slots);
            }
            let settled = history[history.len() - 1];
            prop_assert!(history[history.len() - 20..].iter().all(|&s| s == settled), "{:?}", history);
            let r = room(settled);
            prop_assert!(
                (options.low_water..=options.high_water).contains(&r)
                    || (settled == floor && r < options.low_water)
                    || (settled == max_slots && r > options.high_water),
                "settled at {} slots with {} left: {:?}", settled, r, history
            );
        }
    }

    /// Pressure sheds an eighth of the slots above the floor even with memory left, and
    /// blocks a grow; a grow waits for the hold and counts slots not yet filled as taken.
    #[test]
    fn pressure_and_the_hold() {
        let options = ElasticOptions {
            low_water: 10 << 20,
            high_water: 20 << 20,
            hold: Duration::from_secs(3),
            interval: Duration::from_secs(1),
            pressure: 10.0,
        };
        let mut g = Governor::new(options, 100, 20, 1 << 20);
        let s = |secs| Duration::from_secs(secs);
        assert_eq!(g.decide(s(0), &reading(15 << 20, Some(50.0)), 100, 0), 90);
        assert_eq!(g.decide(s(1), &reading(100 << 20, Some(9.0)), 90, 0), 90);
        assert_eq!(g.decide(s(3), &reading(100 << 20, None), 90, 0), 90);
        // Held 3 s: grow by what brings the memory left to the middle (15 MiB), capped.
        assert_eq!(g.decide(s(4), &reading(100 << 20, None), 90, 0), 100);
        let mut g = Governor::new(options, 100, 20, 1 << 20);
        assert_eq!(g.decide(s(0), &reading(30 << 20, None), 50, 0), 50);
        assert_eq!(g.decide(s(3), &reading(30 << 20, None), 50, 0), 65);
        // The 15 slots just brought back will take 15 MiB: 30 - 15 is inside the band.
        assert_eq!(g.decide(s(7), &reading(30 << 20, None), 65, 15), 65);
        // A dip inside the band restarts the hold.
        assert_eq!(g.decide(s(8), &reading(30 << 20, None), 65, 0), 65);
        assert_eq!(g.decide(s(9), &reading(12 << 20, None), 65, 0), 65);
        assert_eq!(g.decide(s(10), &reading(30 << 20, None), 65, 0), 65);
        assert_eq!(g.decide(s(12), &reading(30 << 20, None), 65, 0), 65);
        assert_eq!(g.decide(s(13), &reading(30 << 20, None), 65, 0), 80);
    }
}
