//! The pool's counters and routing trace: how each lookup was served ([`Outcome`]), the
//! per-layer and pool-wide counts ([`PoolStats`]), the trace events, and which records are
//! in slots now ([`ResidentSet`]).

use serde::Serialize;

use crate::io::MirrorStats;

use super::{ElasticStats, Inner, SlotPool, State};

/// How a lookup was served, as written to the routing trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Hit,
    Miss,
    /// Served by a lookahead read (landed or still in flight).
    Prefetched,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Hit => "hit",
            Outcome::Miss => "miss",
            Outcome::Prefetched => "prefetched",
        }
    }
}

/// One lookup in the routing trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TraceEvent {
    pub token: u64,
    pub layer: u32,
    pub expert: u32,
    pub outcome: Outcome,
}

/// Per-layer lookup counts.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct LayerCounts {
    pub hits: u64,
    pub misses: u64,
}

/// Counters of a pool since it was built (or since [`SlotPool::reset_stats`]).
///
/// Invariants: `hits + misses` = lookups; `demand_bytes = misses * record_bytes`;
/// `bytes_read = demand_bytes + speculative_bytes + sweep_bytes + admitted_bytes +
/// range_bytes`, everything read from the disk through the pool's reader (a packed
/// record that fails its checksum is read again from the shards and counted once).
#[derive(Clone, Debug, Default, Serialize)]
pub struct PoolStats {
    /// Slots in use now ([`SlotPool::slots`]).
    pub slots: usize,
    pub record_bytes: usize,
    /// Lookups served without a new demand read (resident, or joining a read in flight).
    pub hits: u64,
    /// Lookups that issued a demand read.
    pub misses: u64,
    pub hit_rate: f64,
    /// Every byte read from the disk: the sum of the `*_bytes` counters below but
    /// `wasted_bytes` (which is part of `speculative_bytes`).
    pub bytes_read: u64,
    /// Bytes read by lookups that missed (prefill chunks through the pool, and decode).
    pub demand_bytes: u64,
    pub speculative_reads: u64,
    /// Bytes read ahead of their lookup (lookahead).
    pub speculative_bytes: u64,
    /// Prefetched records later asked for.
    pub prefetches_used: u64,
    /// Prefetched records evicted (or failed) without being asked for.
    pub prefetches_wasted: u64,
    pub wasted_bytes: u64,
    /// Seconds callers of `ensure` spent waiting for reads.
    pub wait_seconds: f64,
    /// The part of `wait_seconds` after the last prefill ended (decode waits).
    pub decode_wait_seconds: f64,
    pub max_in_flight: usize,
    /// Mean reads in flight, sampled at each read start.
    pub mean_in_flight: f64,
    /// Records read from the shards because the pack was unusable for them.
    pub pack_fallbacks: u64,
    /// Bytes read for prefill chunks outside the pool (not part of hits and misses).
    pub sweep_bytes: u64,
    /// Bytes read to admit a prompt's hottest experts at the end of its prefill (those a
    /// sweep did not already put in slots, see `sweep_admitted`).
    pub admitted_bytes: u64,
    /// Records a sweep read ahead of its layer's chunk (while the layer before computed)
    /// that the chunk did not take: not routed to, resident by then, or the whole read
    /// ahead when no sweep of that layer came (their bytes are part of `sweep_bytes`).
    pub sweep_unused: u64,
    /// Seconds prefill chunks waited for their sweeps' reads (those read ahead included).
    pub sweep_wait_seconds: f64,
    /// Records a prefill sweep copied into slots as it read them, for the admission at
    /// the end of the prompt (not read a second time, and not part of `bytes_read`).
    pub sweep_admitted: u64,
    /// Small reads made for the model besides expert records (n-gram table rows: packed
    /// words, scales and biases), through the same reader.
    pub range_reads: u64,
    /// Bytes of `range_reads`.
    pub range_bytes: u64,
    pub per_layer: Vec<LayerCounts>,
    /// An elastic pool's resizes since it was built (not zeroed by
    /// [`SlotPool::reset_stats`]); `None` for a pool of fixed size.
    pub elastic: Option<ElasticStats>,
    /// With `--mirror`, what each copy read since the pool was opened (the model
    /// directory first; not zeroed by [`SlotPool::reset_stats`]); empty otherwise.
    pub mirrors: Vec<MirrorStats>,
    #[serde(skip)]
    pub(super) in_flight_samples: u64,
    #[serde(skip)]
    pub(super) in_flight_sum: u64,
}

impl PoolStats {
    /// Adds `other`'s counters to these, as if both periods had been counted without a
    /// reset between them (a chat's turns, each a request the engine counts apart):
    /// counts, bytes and seconds add, `max_in_flight` is the larger, the rates are
    /// computed again from the sums; `slots`, `record_bytes`, `elastic` and `mirrors`
    /// (counted since the pool was built) are `other`'s.
    pub fn add(&mut self, other: &PoolStats) {
        self.slots = other.slots;
        self.elastic = other.elastic.clone();
        self.mirrors = other.mirrors.clone();
        self.record_bytes = other.record_bytes;
        self.hits += other.hits;
        self.misses += other.misses;
        self.demand_bytes += other.demand_bytes;
        self.speculative_reads += other.speculative_reads;
        self.speculative_bytes += other.speculative_bytes;
        self.prefetches_used += other.prefetches_used;
        self.prefetches_wasted += other.prefetches_wasted;
        self.wasted_bytes += other.wasted_bytes;
        self.wait_seconds += other.wait_seconds;
        self.decode_wait_seconds += other.decode_wait_seconds;
        self.max_in_flight = self.max_in_flight.max(other.max_in_flight);
        self.pack_fallbacks += other.pack_fallbacks;
        self.sweep_bytes += other.sweep_bytes;
        self.admitted_bytes += other.admitted_bytes;
        self.sweep_admitted += other.sweep_admitted;
        self.sweep_unused += other.sweep_unused;
        self.sweep_wait_seconds += other.sweep_wait_seconds;
        self.range_reads += other.range_reads;
        self.range_bytes += other.range_bytes;
        if self.per_layer.len() < other.per_layer.len() {
            self.per_layer
                .resize(other.per_layer.len(), LayerCounts::default());
        }
        for (sum, l) in self.per_layer.iter_mut().zip(&other.per_layer) {
            sum.hits += l.hits;
            sum.misses += l.misses;
        }
        self.in_flight_samples += other.in_flight_samples;
        self.in_flight_sum += other.in_flight_sum;
        self.derive();
    }

    /// The fields computed from the others: `bytes_read`, `hit_rate`, `mean_in_flight`.
    fn derive(&mut self) {
        self.bytes_read = self.demand_bytes
            + self.speculative_bytes
            + self.sweep_bytes
            + self.admitted_bytes
            + self.range_bytes;
        let lookups = self.hits + self.misses;
        self.hit_rate = if lookups == 0 {
            0.0
        } else {
            self.hits as f64 / lookups as f64
        };
        self.mean_in_flight = if self.in_flight_samples == 0 {
            0.0
        } else {
            self.in_flight_sum as f64 / self.in_flight_samples as f64
        };
    }
}

/// Which records are in slots at one moment: a bit per (MoE layer, expert), for a live
/// view of the pool (`slotstream serve`'s `/stats/stream`). Taking one costs a pass over
/// the pool's map under its lock, about a microsecond per thousand slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResidentSet {
    /// Decoder-layer indices that have routed experts, in order: the rows.
    pub moe_layers: Vec<usize>,
    /// Experts per layer: the columns.
    pub num_experts: usize,
    /// Whether the records stream through a pool (false: every record is mapped, all
    /// resident).
    pub streamed: bool,
    /// Row-major bits, [`ResidentSet::words_per_layer`] `u64`s per layer; bit `e % 64` of
    /// word `e / 64` of a row is expert `e`.
    bits: Vec<u64>,
}

impl ResidentSet {
    /// No record resident, for a pool over `moe_layers` x `num_experts`.
    pub fn empty(moe_layers: Vec<usize>, num_experts: usize) -> Self {
        let words = moe_layers.len() * num_experts.div_ceil(64);
        ResidentSet {
            moe_layers,
            num_experts,
            streamed: true,
            bits: vec![0; words],
        }
    }

    /// Every record resident (a mapped checkpoint, no pool).
    pub fn all(moe_layers: Vec<usize>, num_experts: usize) -> Self {
        let mut set = ResidentSet::empty(moe_layers, num_experts);
        set.streamed = false;
        for row in 0..set.moe_layers.len() {
            for e in 0..num_experts {
                set.set(row, e);
            }
        }
        set
    }

    /// `u64` words per layer's row: `ceil(num_experts / 64)`.
    pub fn words_per_layer(&self) -> usize {
        self.num_experts.div_ceil(64)
    }

    fn set(&mut self, row: usize, expert: usize) {
        let w = self.words_per_layer();
        self.bits[row * w + expert / 64] |= 1 << (expert % 64);
    }

    /// Whether expert `expert` of the MoE layer in row `row` (its position in
    /// `moe_layers`) is resident; false out of range.
    pub fn contains(&self, row: usize, expert: usize) -> bool {
        let w = self.words_per_layer();
        row < self.moe_layers.len()
            && expert < self.num_experts
            && self.bits[row * w + expert / 64] & (1 << (expert % 64)) != 0
    }

    /// The words of row `row` (`words_per_layer` of them). Panics: `row` out of range.
    pub fn row(&self, row: usize) -> &[u64] {
        let w = self.words_per_layer();
        &self.bits[row * w..(row + 1) * w]
    }

    /// Records resident.
    pub fn count(&self) -> usize {
        self.bits.iter().map(|w| w.count_ones() as usize).sum()
    }
}

impl Inner {
    /// Marks resident slot `i` referenced for a lookup: a hit, or a prefetch used when a
    /// lookahead read brought it in.
    pub(super) fn touch(&mut self, i: usize) -> Outcome {
        let s = &mut self.slots[i];
        s.referenced = true;
        if std::mem::take(&mut s.speculative) {
            Outcome::Prefetched
        } else {
            Outcome::Hit
        }
    }

    /// Counts one lookup of `expert` of `layer`: the pool's and the layer's hits or
    /// misses, prefetches used, and the routing trace.
    pub(super) fn count(&mut self, layer: usize, expert: u32, outcome: Outcome) {
        let miss = outcome == Outcome::Miss;
        if miss {
            self.stats.misses += 1;
        } else {
            self.stats.hits += 1;
        }
        if outcome == Outcome::Prefetched {
            self.stats.prefetches_used += 1;
        }
        if let Some(per_layer) = self.stats.per_layer.get_mut(layer) {
            if miss {
                per_layer.misses += 1;
            } else {
                per_layer.hits += 1;
            }
        }
        let token = self.token;
        if let Some(trace) = self.trace.as_mut() {
            trace.push(TraceEvent {
                token,
                layer: layer as u32,
                expert,
                outcome,
            });
        }
    }
}

impl SlotPool {
    /// A snapshot of the counters.
    pub fn stats(&self) -> PoolStats {
        let inner = self.lock();
        let mut s = inner.stats.clone();
        s.derive();
        s.mirrors = self.reader.mirror_stats();
        s
    }

    /// The records in slots now, loaded ([`ResidentSet`]; reads in flight are not
    /// counted).
    pub fn resident_set(&self) -> ResidentSet {
        let index = &self.index;
        let mut set = ResidentSet::empty(index.moe_layers.clone(), index.num_experts);
        let inner = self.lock();
        for (&(layer, expert), &i) in &inner.map {
            if inner.slots[i].state != State::Ready {
                continue;
            }
            if let Some(row) = index.moe_layers.iter().position(|&l| l == layer as usize) {
                if (expert as usize) < index.num_experts {
                    set.set(row, expert as usize);
                }
            }
        }
        set
    }

    /// Slots pinned now: held by a caller, or in flight (0 when no request runs and no
    /// read is pending).
    pub fn pinned_slots(&self) -> usize {
        self.lock().slots.iter().filter(|s| s.pins > 0).count()
    }

    /// Zeroes the counters (the pool's contents stay, and so do an elastic pool's
    /// resize counters).
    pub fn reset_stats(&self) {
        let mut inner = self.lock();
        let layers = inner.stats.per_layer.len();
        inner.stats = PoolStats {
            slots: inner.active,
            record_bytes: self.index.layout.record_bytes,
            per_layer: vec![LayerCounts::default(); layers],
            elastic: inner.stats.elastic.take(),
            ..Default::default()
        };
    }

    /// Starts recording every lookup; [`SlotPool::take_trace`] returns them.
    pub fn enable_trace(&self) {
        self.lock().trace = Some(Vec::new());
    }

    /// The lookups recorded since tracing was enabled (or last taken).
    pub fn take_trace(&self) -> Vec<TraceEvent> {
        self.lock()
            .trace
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Advances the token counter used in the trace (one per forward step).
    pub fn begin_step(&self) {
        self.lock().token += 1;
    }
}
