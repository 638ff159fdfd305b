//! Where the forward pass gets routed-expert records from.
//!
//! The model asks an [`ExpertSource`] for the records of one layer's routed experts and
//! holds them until that layer's expert compute is done. [`MappedExperts`] copies them
//! out of the memory-mapped checkpoint (every expert effectively resident, as mlx-lm
//! runs); the slot pool streams them from disk into a bounded set of slots.

use std::ops::Deref;
use std::sync::Arc;

use crate::checkpoint::{Checkpoint, ExpertIndex};
use crate::error::Result;

/// Identifies the contents of a pool slot: which slot, and which load of it. A backend
/// that mirrors the pool in device memory copies a slot again only when its generation
/// changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotTag {
    /// Unique per pool in this process, so a device mirror never serves another pool.
    pub pool: u64,
    pub slot: usize,
    /// Incremented on every load into the slot.
    pub generation: u64,
    /// Slots in the pool and their stride in bytes (to size a mirror).
    pub slots: usize,
    pub stride: usize,
}

/// A held expert record: its bytes, and the slot it lives in when it comes from a pool.
pub trait HeldRecord: Deref<Target = [u8]> + Send + Sync {
    fn slot(&self) -> Option<SlotTag> {
        None
    }
}

impl HeldRecord for Vec<u8> {}

/// One routed expert's record as the backend sees it.
#[derive(Clone, Copy, Debug)]
pub struct ExpertRecord<'a> {
    pub bytes: &'a [u8],
    pub slot: Option<SlotTag>,
}

/// Supplies expert records laid out by [`crate::checkpoint::RecordLayout`].
pub trait ExpertSource: Send + Sync {
    /// A held record; the source may not reuse its memory until this is dropped.
    type Record<'a>: HeldRecord
    where
        Self: 'a;

    /// The records of `experts` (distinct ids) of decoder layer `layer`, in the same order.
    /// Errors: an I/O failure reading a record, or an expert the checkpoint lacks.
    fn fetch(&self, layer: usize, experts: &[u32]) -> Result<Vec<Self::Record<'_>>>;

    /// Called once at the start of each forward step, so a source that records a
    /// routing trace can tell tokens apart.
    fn begin_step(&self) {}

    /// The records of a prefill chunk: `uses[i]` routes of the chunk go to `experts[i]`.
    /// A source may read them outside its cache (the default fetches them as usual).
    fn fetch_prefill(&self, layer: usize, experts: &[u32], _uses: &[u32]) -> Result<Vec<Self::Record<'_>>> {
        self.fetch(layer, experts)
    }

    /// Called when a prompt's prefill is done (before decoding starts).
    fn end_prefill(&self) {}

    /// Whether the model should run lookahead routers and call [`ExpertSource::prefetch`].
    fn lookahead(&self) -> bool {
        false
    }

    /// A hint that `experts` of `layer` will probably be asked for soon. Never fails:
    /// a source may ignore it.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}
}

/// Reads records straight from the memory-mapped checkpoint (page cache), with no pool.
pub struct MappedExperts {
    ckpt: Arc<Checkpoint>,
    index: Arc<ExpertIndex>,
}

impl MappedExperts {
    pub fn new(ckpt: Arc<Checkpoint>, index: Arc<ExpertIndex>) -> Self {
        MappedExperts { ckpt, index }
    }
}

impl ExpertSource for MappedExperts {
    type Record<'a> = Vec<u8>;

    fn fetch(&self, layer: usize, experts: &[u32]) -> Result<Vec<Vec<u8>>> {
        experts
            .iter()
            .map(|&e| {
                let mut buf = vec![0u8; self.index.layout.record_bytes];
                self.index.copy_record(&self.ckpt, layer, e as usize, &mut buf)?;
                Ok(buf)
            })
            .collect()
    }
}

/// Either expert source, chosen at run time (the CLI's `--pool-slots`).
pub enum AnyExperts {
    Mapped(MappedExperts),
    Pool(crate::pool::PoolExperts),
}

/// A record from [`AnyExperts`].
pub enum AnyRecord {
    Mapped(Vec<u8>),
    Pool(crate::pool::PoolRecord),
}

impl Deref for AnyRecord {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            AnyRecord::Mapped(v) => v,
            AnyRecord::Pool(r) => r,
        }
    }
}

impl HeldRecord for AnyRecord {
    fn slot(&self) -> Option<SlotTag> {
        match self {
            AnyRecord::Mapped(_) => None,
            AnyRecord::Pool(r) => HeldRecord::slot(r),
        }
    }
}

impl ExpertSource for AnyExperts {
    type Record<'a> = AnyRecord;

    fn fetch(&self, layer: usize, experts: &[u32]) -> Result<Vec<AnyRecord>> {
        Ok(match self {
            AnyExperts::Mapped(m) => m.fetch(layer, experts)?.into_iter().map(AnyRecord::Mapped).collect(),
            AnyExperts::Pool(p) => p.fetch(layer, experts)?.into_iter().map(AnyRecord::Pool).collect(),
        })
    }

    fn fetch_prefill(&self, layer: usize, experts: &[u32], uses: &[u32]) -> Result<Vec<AnyRecord>> {
        Ok(match self {
            AnyExperts::Mapped(m) => m.fetch(layer, experts)?.into_iter().map(AnyRecord::Mapped).collect(),
            AnyExperts::Pool(p) => p.fetch_prefill(layer, experts, uses)?.into_iter().map(AnyRecord::Pool).collect(),
        })
    }

    fn end_prefill(&self) {
        if let AnyExperts::Pool(p) = self {
            p.end_prefill();
        }
    }

    fn begin_step(&self) {
        if let AnyExperts::Pool(p) = self {
            p.begin_step();
        }
    }

    fn lookahead(&self) -> bool {
        matches!(self, AnyExperts::Pool(p) if p.lookahead())
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        if let AnyExperts::Pool(p) = self {
            p.prefetch(layer, experts);
        }
    }
}
