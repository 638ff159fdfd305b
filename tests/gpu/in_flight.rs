//! The GPU's `InFlight` guard: what it holds is released only after the device has
//! finished the work recorded before (the pin rule, ARCHITECTURE.md).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use slotstream::backend::gpu::GpuBackend;
use slotstream::backend::{Backend, InFlight};

/// Stands for a pinned record: notes the device's wait count when it is released.
struct Probe<'g> {
    gpu: &'g GpuBackend,
    released_after_waits: Arc<AtomicU64>,
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        let waits = self.gpu.gpu.counters().waits;
        self.released_after_waits.store(waits, Ordering::SeqCst);
    }
}

/// Kept values outlive the work recorded while they were held: the guard's read-back is
/// the one wait and releases them after it; a guard dropped with values (a failed step)
/// submits and waits before releasing them. Dropping `keep`'s handle releases nothing.
#[test]
fn in_flight_releases_only_after_the_device_has_waited() {
    let g = crate::common::gpu();
    let x = g.upload(&[1.0, -2.0, 3.0], 1, 3);
    for read_back in [true, false] {
        let seen = Arc::new(AtomicU64::new(u64::MAX));
        let mut in_flight = InFlight::new(&g);
        drop(in_flight.keep(Probe {
            gpu: &g,
            released_after_waits: seen.clone(),
        }));
        assert_eq!(seen.load(Ordering::SeqCst), u64::MAX, "released early");
        let before = g.gpu.counters().waits;
        // Recorded, not yet run: it sits in the pending encoder.
        let y = g.add(&x, &x);
        if read_back {
            let values = in_flight.read_back(&[&y]).unwrap();
            assert_eq!(values, vec![vec![2.0, -4.0, 6.0]]);
            assert!(in_flight.is_empty());
            assert_eq!(g.gpu.counters().waits, before + 1, "one wait, no other");
            drop(in_flight);
        } else {
            drop(in_flight);
            assert_eq!(g.gpu.counters().waits, before + 1, "the drop waited once");
        }
        assert_eq!(
            seen.load(Ordering::SeqCst),
            before + 1,
            "released before the device had finished (read_back: {read_back})"
        );
    }
}
