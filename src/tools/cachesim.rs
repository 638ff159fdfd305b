//! Replaying a routing trace under CLOCK, LRU and Belady's optimal policy, to see how far
//! the pool's policy is from the best possible on the same lookups.
//!
//! A trace is a CSV file `token,layer,expert,outcome` (one line per lookup, as the pool
//! records it). Consecutive lines with the same `(token, layer)` form one request: as in
//! the pool, a request's experts stay pinned until the request is complete, so none of
//! them can be evicted to make room for another.
//!
//! [`Figures`] summarizes a trace by its counts and three replays; the synthetic routing
//! model ([`crate::routing_model`]) is calibrated by comparing a trace of its own with the
//! [`TARGETS`] of real ones (`slotstream routing-calibration`).

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufWriter, Write};
use std::path::Path;

use serde::Serialize;

use crate::atomic_file::AtomicFile;
use crate::error::{Error, Result};
use crate::pool::{Key, TraceEvent};
use crate::routing_model::Request;

/// Replacement policies the simulator knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Second chance, as the pool runs (without its near-floor same-layer preference).
    Clock,
    /// Least recently used.
    Lru,
    /// Belady's MIN: evict the key used furthest in the future (needs the whole trace).
    Belady,
}

impl Policy {
    pub const ALL: [Policy; 3] = [Policy::Clock, Policy::Lru, Policy::Belady];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Clock => "CLOCK",
            Policy::Lru => "LRU",
            Policy::Belady => "Belady",
        }
    }
}

/// Hits and misses of one replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimResult {
    pub hits: u64,
    pub misses: u64,
}

impl SimResult {
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

/// Writes trace events as CSV (atomically: temporary file, then rename).
pub fn write_trace(path: &Path, events: &[TraceEvent]) -> Result<()> {
    let file = AtomicFile::create(path)?;
    {
        let mut out = BufWriter::new(file.file());
        writeln!(out, "token,layer,expert,outcome").map_err(|e| Error::io(path, e))?;
        for e in events {
            writeln!(
                out,
                "{},{},{},{}",
                e.token,
                e.layer,
                e.expert,
                e.outcome.as_str()
            )
            .map_err(|e| Error::io(path, e))?;
        }
        out.flush().map_err(|e| Error::io(path, e))?;
    }
    file.commit()
}

/// Writes requests as a trace CSV without outcomes (`token,layer,expert`), atomically; for
/// traces that no pool served, such as [`crate::routing_model::RoutingModel::trace`].
pub fn write_requests(path: &Path, requests: &[Request]) -> Result<()> {
    let file = AtomicFile::create(path)?;
    {
        let mut out = BufWriter::new(file.file());
        writeln!(out, "token,layer,expert").map_err(|e| Error::io(path, e))?;
        for r in requests {
            for e in &r.experts {
                writeln!(out, "{},{},{}", r.token, r.layer, e).map_err(|e| Error::io(path, e))?;
            }
        }
        out.flush().map_err(|e| Error::io(path, e))?;
    }
    file.commit()
}

/// Reads a trace CSV into requests. Errors name the line that is malformed.
pub fn read_trace(path: &Path) -> Result<Vec<Request>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut requests: Vec<Request> = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| Error::io(path, e))?;
        if n == 0 && line.starts_with("token") || line.trim().is_empty() {
            continue;
        }
        let bad = || {
            Error::InvalidInput(format!(
                "{}: line {}: expected token,layer,expert[,outcome]",
                path.display(),
                n + 1
            ))
        };
        let mut f = line.split(',');
        let token: u64 = f
            .next()
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(bad)?;
        let layer: u32 = f
            .next()
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(bad)?;
        let expert: u32 = f
            .next()
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(bad)?;
        match requests.last_mut() {
            Some(r) if r.token == token && r.layer == layer => r.experts.push(expert),
            _ => requests.push(Request {
                token,
                layer,
                experts: vec![expert],
            }),
        }
    }
    if requests.is_empty() {
        return Err(Error::InvalidInput(format!(
            "{}: the trace has no lookups",
            path.display()
        )));
    }
    Ok(requests)
}

/// Replays `requests` on a cache of `slots` records under `policy`.
/// With no slots every lookup misses.
pub fn simulate(requests: &[Request], slots: usize, policy: Policy) -> SimResult {
    if slots == 0 {
        let n = requests.iter().map(|r| r.experts.len() as u64).sum();
        return SimResult { hits: 0, misses: n };
    }
    // More slots than distinct keys never evict: the rest would only cost memory.
    let distinct: std::collections::HashSet<(u32, u32)> = requests
        .iter()
        .flat_map(|r| r.experts.iter().map(move |&e| (r.layer, e)))
        .collect();
    let slots = slots.min(distinct.len().max(1));
    let accesses: Vec<Key> = requests
        .iter()
        .flat_map(|r| r.experts.iter().map(move |&e| (r.layer, e)))
        .collect();
    // next_use[i]: position of the next access to the same key after i.
    let mut next_use = vec![usize::MAX; accesses.len()];
    let mut seen: HashMap<Key, usize> = HashMap::new();
    for i in (0..accesses.len()).rev() {
        if let Some(&j) = seen.get(&accesses[i]) {
            next_use[i] = j;
        }
        seen.insert(accesses[i], i);
    }

    let mut result = SimResult::default();
    // Per key: its slot. Per slot: key, CLOCK bit. Ordered sets for LRU and Belady.
    let mut slot_of: HashMap<Key, usize> = HashMap::new();
    let mut keys: Vec<Option<Key>> = vec![None; slots];
    let mut referenced = vec![false; slots];
    let mut hand = 0usize;
    let mut order: BTreeSet<(usize, usize)> = BTreeSet::new(); // (priority, slot)
    let mut priority = vec![0usize; slots];
    let mut free: Vec<usize> = (0..slots).rev().collect();
    let mut pos = 0usize;
    for r in requests {
        let mut pinned: Vec<usize> = Vec::with_capacity(r.experts.len());
        for &e in &r.experts {
            let key = (r.layer, e);
            let i = pos;
            pos += 1;
            // LRU orders by last use (evict smallest); Belady by next use (evict largest).
            let prio = match policy {
                Policy::Lru => i,
                Policy::Belady => usize::MAX - next_use[i].min(usize::MAX - 1),
                Policy::Clock => 0,
            };
            if let Some(&s) = slot_of.get(&key) {
                result.hits += 1;
                referenced[s] = true;
                order.remove(&(priority[s], s));
                priority[s] = prio;
                order.insert((prio, s));
                pinned.push(s);
                continue;
            }
            result.misses += 1;
            let victim = free.pop().or_else(|| match policy {
                Policy::Clock => {
                    let mut found = None;
                    for _ in 0..2 * slots + 1 {
                        let s = hand;
                        hand = (hand + 1) % slots;
                        if pinned.contains(&s) {
                            continue;
                        }
                        if referenced[s] {
                            referenced[s] = false;
                            continue;
                        }
                        found = Some(s);
                        break;
                    }
                    found
                }
                Policy::Lru | Policy::Belady => {
                    order.iter().map(|&(_, s)| s).find(|s| !pinned.contains(s))
                }
            });
            // With every slot pinned by this request, the record is used without caching.
            let Some(s) = victim else { continue };
            if let Some(old) = keys[s].take() {
                slot_of.remove(&old);
            }
            order.remove(&(priority[s], s));
            keys[s] = Some(key);
            slot_of.insert(key, s);
            referenced[s] = true;
            priority[s] = prio;
            order.insert((prio, s));
            pinned.push(s);
        }
    }
    result
}

/// The published summaries of real Qwen3-Next traces (48 layers x 512 experts, top-10,
/// 220 decode steps), as the benchmark issue quotes the reference's trace study
/// (reference-system.md B.4 has its CLOCK figure, 0.557 at 30 experts a layer).
pub const TARGETS: Figures = Figures {
    records: 48 * 512,
    touched: 9_956,
    top_decile_share: 0.70,
    clock: 0.56,
    lru: 0.71,
    belady: 0.85,
};

/// Decode steps of the reference traces.
pub const TARGET_STEPS: usize = 220;

/// The five figures of a trace that the calibration compares.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Figures {
    /// Records (layers x experts) of the model.
    pub records: usize,
    /// Distinct records looked up at least once.
    pub touched: usize,
    /// Share of all lookups that go to the 10% most looked-up records.
    pub top_decile_share: f64,
    /// CLOCK hit rate with 30 slots per layer for 512 experts ([`Figures::pools`]).
    pub clock: f64,
    /// LRU hit rate with 60 slots per layer for 512 experts.
    pub lru: f64,
    /// Belady hit rate with 17% of the records.
    pub belady: f64,
}

impl Figures {
    /// Pool sizes (total slots) of the three hit rates for `layers` x `experts`: CLOCK 30
    /// and LRU 60 experts a layer for 512 experts (scaled by `experts / 512`, at least 1),
    /// Belady 17% of the records, as the reference study reports them.
    pub fn pools(layers: usize, experts: usize) -> [usize; 3] {
        let per_layer =
            |n: usize| ((n * experts) as f64 / 512.0).round().max(1.0) as usize * layers;
        [
            per_layer(30),
            per_layer(60),
            ((0.17 * (layers * experts) as f64).round() as usize).max(1),
        ]
    }

    /// Measures a trace of a model with `layers` MoE layers of `experts` experts: counts,
    /// then the three replays of [`simulate`] at the sizes of
    /// [`Figures::pools`].
    pub fn measure(requests: &[Request], layers: usize, experts: usize) -> Figures {
        let records = layers * experts;
        let mut counts: HashMap<(u32, u32), u64> = HashMap::new();
        for r in requests {
            for &e in &r.experts {
                *counts.entry((r.layer, e)).or_default() += 1;
            }
        }
        let total: u64 = counts.values().sum();
        let mut counts: Vec<u64> = counts.into_values().collect();
        counts.sort_unstable_by(|a, b| b.cmp(a));
        let decile: u64 = counts.iter().take(records.div_ceil(10)).sum();
        let [clock, lru, belady] = Self::pools(layers, experts);
        Figures {
            records,
            touched: counts.len(),
            top_decile_share: if total == 0 {
                0.0
            } else {
                decile as f64 / total as f64
            },
            clock: simulate(requests, clock, Policy::Clock).hit_rate(),
            lru: simulate(requests, lru, Policy::Lru).hit_rate(),
            belady: simulate(requests, belady, Policy::Belady).hit_rate(),
        }
    }

    /// Share of the records touched.
    pub fn touched_share(&self) -> f64 {
        self.touched as f64 / self.records.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing_model::{RoutingModel, RoutingParams};

    fn req(token: u64, experts: &[u32]) -> Request {
        Request {
            token,
            layer: 0,
            experts: experts.to_vec(),
        }
    }

    /// The calibration: a trace of the 80B preset's defaults lands near every target, for
    /// a fresh seed each run (printed on failure).
    #[test]
    fn calibrated_trace_lands_near_the_targets() {
        let seed: u64 = rand::random();
        let mut params = RoutingParams::calibrated();
        params.seed = seed;
        let m = RoutingModel::new(params, 48, 512, 10).unwrap();
        let layers: Vec<usize> = (0..48).collect();
        let f = Figures::measure(&m.trace(&layers, TARGET_STEPS).unwrap(), 48, 512);
        let t = TARGETS;
        // Seed to seed the figures vary by about 0.002 (touched by about 20 records); the
        // tolerances leave room for that around the fit (Belady is the furthest, +0.016).
        let checks = [
            (
                "touched share",
                f.touched_share(),
                t.touched_share(),
                0.03 * t.touched_share(),
            ),
            (
                "top-decile share",
                f.top_decile_share,
                t.top_decile_share,
                0.02,
            ),
            ("CLOCK", f.clock, t.clock, 0.02),
            ("LRU", f.lru, t.lru, 0.02),
            ("Belady", f.belady, t.belady, 0.025),
        ];
        for (name, got, want, tol) in checks {
            assert!(
                (got - want).abs() <= tol,
                "seed {seed}: {name} {got:.3}, target {want:.3} +- {tol}: {f:?}"
            );
        }
    }

    #[test]
    fn hand_computed_hits() {
        // Two slots, one expert per request: 1 2 3 1 2 3 1.
        let trace: Vec<Request> = [1, 2, 3, 1, 2, 3, 1]
            .iter()
            .enumerate()
            .map(|(t, &e)| req(t as u64, &[e]))
            .collect();
        // LRU thrashes on a cycle longer than the cache: no hits.
        assert_eq!(
            simulate(&trace, 2, Policy::Lru),
            SimResult { hits: 0, misses: 7 }
        );
        // CLOCK (all bits set on insert) degenerates to FIFO here: no hits either.
        assert_eq!(
            simulate(&trace, 2, Policy::Clock),
            SimResult { hits: 0, misses: 7 }
        );
        // MIN: miss 1, miss 2, miss 3 (evict 2, used after 1), hit 1, miss 2 (evict 1?
        // next uses: 3 at 5, 1 at 6 -> evict 1), hit 3, miss 1 -> 2 hits.
        assert_eq!(
            simulate(&trace, 2, Policy::Belady),
            SimResult { hits: 2, misses: 5 }
        );
    }

    #[test]
    fn pinned_request_keys_are_not_evicted() {
        // One request of three experts in two slots: the third cannot evict the first two.
        let trace = vec![req(0, &[1, 2, 3]), req(1, &[1, 2])];
        for p in Policy::ALL {
            assert_eq!(
                simulate(&trace, 2, p),
                SimResult { hits: 2, misses: 3 },
                "{p:?}"
            );
        }
    }

    #[test]
    fn clock_gives_second_chance() {
        // Slots 2. 1,2 then 1 (hit, bit set), 3: hand at slot 0 (key 1, bit set -> clear),
        // slot 1 (key 2, bit set from insert -> clear), slot 0 (clear) -> evict 1.
        // Then 2 hits.
        let trace: Vec<Request> = [1, 2, 1, 3, 2]
            .iter()
            .enumerate()
            .map(|(t, &e)| req(t as u64, &[e]))
            .collect();
        assert_eq!(
            simulate(&trace, 2, Policy::Clock),
            SimResult { hits: 2, misses: 3 }
        );
        // LRU evicts 2 (least recent) for 3, so the final 2 misses.
        assert_eq!(
            simulate(&trace, 2, Policy::Lru),
            SimResult { hits: 1, misses: 4 }
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, failure_persistence: None, ..Default::default() })]
        /// Belady's MIN is never beaten by CLOCK or LRU on the same trace and pool size.
        #[test]
        fn belady_is_never_beaten(
            steps in proptest::collection::vec((0u32..3, proptest::collection::btree_set(0u32..12, 1..4)), 1..120),
            slots in 3usize..20,
        ) {
            let trace: Vec<Request> = steps
                .into_iter()
                .enumerate()
                .map(|(t, (layer, experts))| Request { token: t as u64, layer, experts: experts.into_iter().collect() })
                .collect();
            let best = simulate(&trace, slots, Policy::Belady).hits;
            for p in [Policy::Clock, Policy::Lru] {
                let h = simulate(&trace, slots, p).hits;
                proptest::prop_assert!(h <= best, "{:?} {} > Belady {}", p, h, best);
            }
        }
    }
}
