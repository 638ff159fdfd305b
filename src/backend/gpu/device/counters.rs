//! Counts of what the device was asked to do ([`GpuCounters`]).

use std::sync::atomic::{AtomicU64, Ordering};

use super::Gpu;

/// Counts of what the device was asked to do (see [`Gpu::counters`]).
#[derive(Default)]
pub(super) struct Counters {
    pub(super) dispatches: AtomicU64,
    pub(super) submits: AtomicU64,
    pub(super) waits: AtomicU64,
    pub(super) buffers_created: AtomicU64,
    pub(super) bind_groups_created: AtomicU64,
    pub(super) wait_ns: AtomicU64,
    pub(super) record_ns: AtomicU64,
    pub(super) submit_ns: AtomicU64,
    pub(super) write_bytes: AtomicU64,
}

/// A snapshot of [`Gpu`]'s counters since it was opened, for profiles.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuCounters {
    /// Compute dispatches recorded.
    pub dispatches: u64,
    /// Command encoders submitted.
    pub submits: u64,
    /// Waits for the device (read-backs and syncs).
    pub waits: u64,
    /// wgpu buffers created (kernel outputs the pool could not serve, uploads, read-back
    /// staging).
    pub buffers_created: u64,
    /// Bind groups created (the cache missed).
    pub bind_groups_created: u64,
    /// Nanoseconds spent waiting for the device.
    pub wait_ns: u64,
    /// Nanoseconds spent recording dispatches ([`Gpu::dispatch_with`], submissions it
    /// forces excluded).
    pub record_ns: u64,
    /// Nanoseconds spent ending passes, finishing encoders and submitting them.
    pub submit_ns: u64,
    /// Bytes written through the queue ([`Gpu::write`]).
    pub write_bytes: u64,
}

impl std::ops::Sub for GpuCounters {
    type Output = GpuCounters;
    fn sub(self, o: GpuCounters) -> GpuCounters {
        GpuCounters {
            dispatches: self.dispatches - o.dispatches,
            submits: self.submits - o.submits,
            waits: self.waits - o.waits,
            buffers_created: self.buffers_created - o.buffers_created,
            bind_groups_created: self.bind_groups_created - o.bind_groups_created,
            wait_ns: self.wait_ns - o.wait_ns,
            record_ns: self.record_ns - o.record_ns,
            submit_ns: self.submit_ns - o.submit_ns,
            write_bytes: self.write_bytes - o.write_bytes,
        }
    }
}

impl Gpu {
    /// What the device was asked to do since it was opened.
    pub fn counters(&self) -> GpuCounters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        GpuCounters {
            dispatches: get(&c.dispatches),
            submits: get(&c.submits),
            waits: get(&c.waits),
            buffers_created: get(&c.buffers_created),
            bind_groups_created: get(&c.bind_groups_created),
            wait_ns: get(&c.wait_ns),
            record_ns: get(&c.record_ns),
            submit_ns: get(&c.submit_ns),
            write_bytes: get(&c.write_bytes),
        }
    }

    pub(super) fn count(a: &AtomicU64) {
        a.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn add_ns(counter: &AtomicU64, since: std::time::Instant) {
        counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}
