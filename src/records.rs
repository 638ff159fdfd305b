//! The records contract between storage and compute: what a backend and the model know of
//! routed-expert records and of the memory they live in, without the slot pool or the
//! sources that supply them.
//!
//! An [`ExpertSource`] hands out [`HeldRecord`]s (the slot pool's pinned slots, or copies
//! from the mapped checkpoint); the backend reads them as [`ExpertRecord`]s, whose
//! [`SlotTag`] says which slot and which load of it a record is; and [`PoolMemory`]
//! describes the pool's memory, for a backend that places it (a GPU reads the slots in
//! place or mirrors them, the CPU moves them to huge pages).

use std::ops::Deref;
use std::sync::Arc;

use crate::error::Result;
use crate::io::{AlignedBuf, RangeRead};

/// Identifies the contents of a pool slot: which slot, and which load of it. A backend
/// that mirrors the pool in device memory copies a slot again only when its generation
/// changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotTag {
    /// Unique per pool in this process, so a device mirror never serves another pool.
    pub pool: u64,
    /// The slot's index in the pool.
    pub slot: usize,
    /// Incremented on every load into the slot.
    pub generation: u64,
    /// Slots in the pool (to size a mirror).
    pub slots: usize,
    /// Distance between slots in bytes.
    pub stride: usize,
    /// Records per MoE layer: a pool of every record keeps each layer's in consecutive
    /// slots from a multiple of this, so a mirror whose arenas hold whole layers binds
    /// one arena per layer.
    pub layer_records: usize,
}

/// A held expert record: its bytes, and the slot it lives in when it comes from a pool.
pub trait HeldRecord: Deref<Target = [u8]> + Send + Sync {
    /// The slot the record lives in; `None` (the default) for a record outside a pool.
    fn slot(&self) -> Option<SlotTag> {
        None
    }
}

impl HeldRecord for Vec<u8> {}

/// One routed expert's record as the backend sees it.
#[derive(Clone, Copy, Debug)]
pub struct ExpertRecord<'a> {
    /// The record, laid out by [`crate::checkpoint::RecordLayout`].
    pub bytes: &'a [u8],
    /// The slot it lives in, when it comes from a pool.
    pub slot: Option<SlotTag>,
}

/// Every expert record of one layer, held together (see [`ExpertSource::resident_layer`]).
pub trait LayerRecords: Send + Sync {
    /// The records in expert order: element `e` is expert `e`'s.
    fn records(&self) -> Vec<ExpertRecord<'_>>;
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
    fn fetch_prefill(
        &self,
        layer: usize,
        experts: &[u32],
        _uses: &[u32],
    ) -> Result<Vec<Self::Record<'_>>> {
        self.fetch(layer, experts)
    }

    /// Called when a prompt's prefill is done (before decoding starts), or was cancelled
    /// (`admit` false: nothing worth keeping warm, and nobody waiting to decode).
    fn end_prefill(&self, _admit: bool) {}

    /// Whether the model should run lookahead routers and call [`ExpertSource::prefetch`].
    fn lookahead(&self) -> bool {
        false
    }

    /// Whether the source streams: it cannot hold every record at once, so a layer's
    /// records are read again for each pass that routes to them. A forward call of several
    /// prefill chunks then runs layer by layer over all of them (`Model::forward`), so
    /// that each layer's routed records are fetched once per call; `false` (the default)
    /// for a source that holds everything (a mapped checkpoint, a pool of every record).
    fn streams(&self) -> bool {
        false
    }

    /// A hint that `experts` of `layer` will probably be asked for soon. Never fails:
    /// a source may ignore it.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}

    /// Every record of `layer`, held, when all of them are resident now (a pool that holds
    /// every record), so that the backend can pick the routed ones itself and the routing
    /// never has to be read back per layer; `None` (the default) otherwise. Counts no
    /// lookups: the caller reports them through [`ExpertSource::count_lookups`].
    fn resident_layer(&self, _layer: usize) -> Option<Box<dyn LayerRecords + '_>> {
        None
    }

    /// Counts lookups of `experts` (distinct ids) of `layer` that were served from
    /// [`ExpertSource::resident_layer`]'s records (statistics and trace).
    fn count_lookups(&self, _layer: usize, _experts: &[u32]) {}

    /// Reads `reads` that the model needs besides expert records (n-gram table rows),
    /// returning their bytes in order. A source with a bounded reader runs them through it,
    /// concurrently and within the same queue depth as its expert reads; the default reads
    /// them one after another. Errors: the first failed read, naming its file and offset.
    fn read_ranges(&self, reads: Vec<RangeRead>) -> Result<Vec<Vec<u8>>> {
        reads.iter().map(RangeRead::read).collect()
    }
}

/// The slot pool's memory as a backend places it: which pool, how its slots lie, and the
/// memory itself, which lives as long as any descriptor of it (a GPU that imports it keeps
/// one for as long as its buffers read it).
#[derive(Clone)]
pub struct PoolMemory {
    /// The pool's process-unique id ([`SlotTag::pool`]).
    pub pool: u64,
    /// Number of slots.
    pub slots: usize,
    /// Distance between slots in bytes (a multiple of 4096).
    pub stride: usize,
    /// Records per MoE layer ([`SlotTag::layer_records`]).
    pub layer_records: usize,
    /// The slots, `slots * stride` bytes from the start of an allocation of whole pages
    /// (page-aligned), shared with the pool.
    pub memory: Arc<AlignedBuf>,
}
