//! Pins: handles on records held in slots ([`SlotRecord`] for one, [`LayerPin`] for a
//! whole layer), which keep their slots from eviction until dropped.

use std::sync::Arc;

use crate::records::{ExpertRecord, HeldRecord, LayerRecords, SlotTag};

use super::{Inner, SlotPool, State};

impl SlotPool {
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
    pub(super) fn slot_record(self: &Arc<Self>, inner: &Inner, slot: usize) -> SlotRecord {
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
