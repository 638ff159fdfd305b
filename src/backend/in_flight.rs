//! [`InFlight`]: what recorded device work reads (a step's pinned expert records), held
//! until the device has finished that work.
//!
//! A backend may run an operation after the call that records it returns (a GPU runs its
//! command encoder at the next submission), so a record handed to it must stay in its
//! slot until then: a miss that overwrote the slot earlier would silently corrupt the
//! output. The records therefore go into an [`InFlight`] of the backend that reads them,
//! and only that backend's waits release them.

use std::sync::Arc;

use super::{Backend, Routing};
use crate::error::Result;

/// Values that recorded device work may still read (a step's pinned expert records),
/// held until the backend has finished every operation recorded before they are released.
///
/// # Invariant
///
/// A value kept here ([`InFlight::keep`]) is dropped only after the device has finished
/// every operation recorded so far:
/// - by a read-back through this guard ([`InFlight::read_back`], [`InFlight::router_top_k`]):
///   a backend's read-back of at least one value returns only after the device finished
///   everything recorded before it (see [`Backend::download_many`]), and a read-back of
///   nothing waits with [`Backend::finish`];
/// - or, when the guard is dropped still holding values (an error or a panic part-way
///   through a step), after [`Backend::finish`] has waited for the device.
///
/// Nothing takes a value back out, and the handle [`InFlight::keep`] returns only shares
/// it, so no caller can release a kept value before one of those waits. Forgetting the
/// guard (`std::mem::forget`) leaks its values, which never releases them early.
pub struct InFlight<'a, B: Backend + ?Sized> {
    backend: &'a B,
    held: Vec<Box<dyn Send + 'a>>,
}

impl<'a, B: Backend + ?Sized> InFlight<'a, B> {
    /// An empty guard for work recorded on `backend`.
    pub fn new(backend: &'a B) -> Self {
        InFlight {
            backend,
            held: Vec::new(),
        }
    }

    /// Keeps `value` until the device has finished the work recorded so far and after
    /// (see the type's invariant), and returns a shared handle on it to record work with:
    /// the value is held before anything reads it, so no path between its use and its
    /// hold can drop it. The handle may be dropped at any time; the guard's share keeps
    /// the value alive.
    pub fn keep<T: Send + Sync + 'a>(&mut self, value: T) -> Arc<T> {
        let value = Arc::new(value);
        self.held.push(Box::new(value.clone()));
        value
    }

    /// Moves `other`'s values into this guard (released with this one's), without waiting
    /// or releasing anything.
    pub fn absorb(&mut self, mut other: InFlight<'a, B>) {
        self.held.append(&mut other.held);
    }

    /// Values held now (each [`InFlight::keep`] is one).
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Reads `tensors` back ([`Backend::download_many`], which waits for every operation
    /// recorded so far), then releases everything held. Errors: a failed read-back (the
    /// values stay held; dropping the guard waits for the device before releasing them).
    pub fn read_back(&mut self, tensors: &[&B::Tensor]) -> Result<Vec<Vec<f32>>> {
        let values = self.backend.download_many(tensors)?;
        // A backend may answer a read-back of no bytes without waiting for the device.
        if values.iter().all(Vec::is_empty) {
            self.backend.finish()?;
        }
        self.held.clear();
        Ok(values)
    }

    /// [`Backend::router_top_k`], whose read-back waits for every operation recorded so
    /// far, then releases everything held. Errors: as [`Backend::router_top_k`] (the
    /// values stay held, as with [`InFlight::read_back`]).
    pub fn router_top_k(
        &mut self,
        logits: &B::Tensor,
        k: usize,
        renormalize: bool,
    ) -> Result<Routing> {
        let routing = self.backend.router_top_k(logits, k, renormalize)?;
        // The routing's ids are what the device computed from `logits`: none means the
        // read-back read nothing (an empty input), and did not wait.
        if routing.ids.is_empty() {
            self.backend.finish()?;
        }
        self.held.clear();
        Ok(routing)
    }
}

impl<B: Backend + ?Sized> Drop for InFlight<'_, B> {
    /// Waits for the device before the held values are dropped (with the guard's fields,
    /// after this returns). A failed wait means a lost device, which runs nothing more.
    fn drop(&mut self) {
        if self.held.is_empty() {
            return;
        }
        if let Err(e) = self.backend.finish() {
            tracing::warn!(error = %e, "waiting for the device before releasing what its work read");
        }
    }
}
