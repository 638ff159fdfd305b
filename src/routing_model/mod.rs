//! Synthetic routing: an explicit model of which experts a trained router picks, carried
//! by synthetic checkpoints so that their expert traffic looks like a real model's.
//!
//! A synthetic checkpoint has random router weights, and a random router routes almost
//! uniformly: every expert is about equally likely at every token, which no trained model
//! does. Cache and I/O benchmarks on such a model measure the wrong thing. When a model
//! directory holds [`ROUTING_FILE`], `model::Model` keeps the mixing weights its
//! router computes but replaces the routed expert **ids** with the ones this model picks.
//!
//! # The model
//!
//! For each layer `l` (its own seeded draw, so layers differ):
//! - an *active set*: `A = round(active_fraction * num_experts)` experts (at least
//!   `top_k`), a seeded random subset; the others are never routed to. One prompt of a
//!   trained model touches only part of each layer's experts (about 40% over 220 decode
//!   steps in the reference traces), and their count distribution stops abruptly rather
//!   than thinning out smoothly, which an active subset reproduces and a smooth popularity
//!   law does not;
//! - a popularity rank `r = 0..A` over the active set (seeded order) and a static score
//!   `b_r = -zipf_exponent * ln(1 + min(r, H))` with `H = round(head_fraction *
//!   num_experts)`: a Zipf-like head of popular experts, then a flat tail. The traces need
//!   both: the best fixed 30 experts a layer serve 60% of selections (the offline hot-set
//!   bound of reference-system.md B.4) and the best 51 (10%) about 70%, so popularity falls
//!   steeply over the first few dozen ranks and hardly at all after.
//!
//! At each token, each active expert `r` gets
//!
//! ```text
//! c_r(t) = rho * c_r(t-1) + sqrt(1 - rho^2) * n1      (context, unit variance, AR(1))
//! s_r(t) = b_r + sqrt(w) * c_r(t) + sqrt(1 - w) * n2   (score)
//! ```
//!
//! with `rho = context_correlation`, `w = context_weight` and `n1`, `n2` standard normal,
//! and the layer routes to the `top_k` highest scores, best first (so rank `j` of the
//! router's mixing weights goes with the `j`-th best score). The context term is what
//! makes routing correlated from token to token: an expert whose context is high stays
//! likely for a few tokens (about `1 / (1 - rho)`), so rarely used experts come in short
//! bursts, which recency-based caches (CLOCK, LRU) catch and an optimal one exploits
//! further. The noise is a hash of `(seed, layer, position, token id, expert)`, so routing
//! is deterministic, the same prompt routes the same way, and a sequence routed in one
//! pass or token by token gives the same ids.
//!
//! The per-sequence state is the context vector of every layer ([`RoutingState`]), kept in
//! the model's `model::SequenceState`.
//!
//! # Lookahead forecast
//!
//! The engine guesses layer `L+2`'s experts on layer `L`'s hidden state. With this model a
//! guess from the random router would be worthless, so a forecast stands in for it
//! ([`RoutingModel::route_chunk`]): it takes the selection layer `L+2` will make and keeps
//! each of its ids with probability `forecast_accuracy`, replacing the others with
//! popularity draws from the rest of the active set. That accuracy is an assumption, not a measurement (the
//! reference only reports the speed-up its forecast gives); it makes `--lookahead on|off`
//! comparisons mean something, and can be set per checkpoint. A forecast never changes
//! the routing state or what is computed.
//!
//! # Calibration
//!
//! [`RoutingModel::trace`] generates decode steps straight from the model (no forward
//! pass), and the cache simulator's `Figures::measure` (`slotstream::tools::cachesim`,
//! a tool the engine does not import) replays them. The defaults of
//! [`RoutingParams::calibrated`] were fitted to its `TARGETS`, the reference's published
//! summaries of real traces (48 layers x 512 experts, top-10, 220 decode steps):
//! `slotstream routing-calibration` prints both (BENCHMARKS.md, "Synthetic routing
//! calibration").

mod params;

pub use params::{RoutingParams, DEFAULT_FORECAST_ACCURACY, DEFAULT_SEED, ROUTING_FILE, VERSION};

use std::path::Path;

pub use crate::error::RoutingModelError;

/// One layer's fixed part: its active experts by rank and their static scores.
#[derive(Clone, Debug)]
struct LayerModel {
    /// `experts[r]`: the expert of popularity rank `r`.
    experts: Vec<u32>,
    /// `bias[r] = -zipf_exponent * ln(1 + r)`.
    bias: Vec<f32>,
    /// Running sums of `exp(bias)`, for popularity draws (forecast replacements).
    cumulative: Vec<f64>,
}

/// A routing model for one geometry: [`RoutingParams`] expanded into per-layer tables.
#[derive(Clone, Debug)]
pub struct RoutingModel {
    pub params: RoutingParams,
    pub num_experts: usize,
    pub top_k: usize,
    layers: Vec<LayerModel>,
}

/// The per-sequence state: each layer's context vector (one value per active expert, in
/// rank order), as of the last position routed.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingState {
    context: Vec<Vec<f32>>,
}

impl RoutingState {
    /// Each layer's context vector (for a prompt-cache snapshot on disk).
    pub fn contexts(&self) -> &[Vec<f32>] {
        &self.context
    }

    /// The same, to restore a snapshot's values (each vector keeps its length).
    pub(crate) fn contexts_mut(&mut self) -> &mut [Vec<f32>] {
        &mut self.context
    }
}

/// One layer's routing of a chunk of tokens ([`RoutingModel::route_chunk`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkRouting {
    /// Expert ids `[T, top_k]`, row-major, each token's best first.
    pub ids: Vec<u32>,
    /// The lookahead forecast of those selections: distinct ids, ascending.
    pub forecast: Vec<u32>,
}

/// Hash streams: which draw a hash feeds (keeps draws of one step independent).
const STREAM_LAYER: u64 = 1;
const STREAM_INIT: u64 = 2;
const STREAM_CONTEXT: u64 = 3;
const STREAM_NOISE: u64 = 4;
const STREAM_KEEP: u64 = 5;
const STREAM_DRAW: u64 = 6;

/// splitmix64's finalizer: a bijective 64-bit mix. Draws come from hashes rather than a
/// sequential generator so that a draw depends only on what it is for (layer, position,
/// token, expert), not on how many draws came before; `rand`'s generators are also not
/// promised to stay the same across versions, and a checkpoint's routing should.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A hash of several words, each mixed in turn.
fn hash(words: &[u64]) -> u64 {
    words.iter().fold(0u64, |h, &w| mix(h ^ w))
}

/// Uniform in `(0, 1)` from the high 53 bits of `h`.
fn uniform(h: u64) -> f64 {
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Standard normal from one hash (Box-Muller on its two 32-bit halves).
fn normal(h: u64) -> f32 {
    let u1 = ((h >> 32) as f64 + 0.5) / 4_294_967_296.0;
    let u2 = (h & 0xFFFF_FFFF) as f64 / 4_294_967_296.0;
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

impl RoutingModel {
    /// Expands `params` for a model of `layers` layers of `num_experts` experts routing
    /// `top_k` per token. Every layer index gets a table (dense layers simply never ask).
    /// Errors: `top_k` is 0 or more than `num_experts`.
    pub fn new(
        params: RoutingParams,
        layers: usize,
        num_experts: usize,
        top_k: usize,
    ) -> crate::Result<Self> {
        if top_k == 0 || top_k > num_experts {
            return Err(crate::Error::InvalidInput(format!(
                "synthetic routing needs 0 < top_k <= experts, got top-{top_k} of {num_experts}"
            )));
        }
        let active = ((params.active_fraction * num_experts as f64).round() as usize)
            .clamp(top_k, num_experts);
        let head = (params.head_fraction * num_experts as f64).round() as usize;
        let layers = (0..layers)
            .map(|l| {
                // A seeded Fisher-Yates shuffle: its first `active` entries are the active
                // set, in rank order.
                let mut order: Vec<u32> = (0..num_experts as u32).collect();
                for i in (1..num_experts).rev() {
                    let j = (hash(&[params.seed, STREAM_LAYER, l as u64, i as u64])
                        % (i as u64 + 1)) as usize;
                    order.swap(i, j);
                }
                order.truncate(active);
                let bias: Vec<f32> = (0..active)
                    .map(|r| (-params.zipf_exponent * (1.0 + r.min(head) as f64).ln()) as f32)
                    .collect();
                let cumulative = bias
                    .iter()
                    .scan(0.0f64, |acc, &b| {
                        *acc += (b as f64).exp();
                        Some(*acc)
                    })
                    .collect();
                LayerModel {
                    experts: order,
                    bias,
                    cumulative,
                }
            })
            .collect();
        Ok(RoutingModel {
            params,
            num_experts,
            top_k,
            layers,
        })
    }

    /// Reads `dir`/[`ROUTING_FILE`] for a model of the given geometry; `Ok(None)` when the
    /// directory has none. Errors: those of [`RoutingParams::load`] and [`RoutingModel::new`].
    pub fn open(
        dir: &Path,
        layers: usize,
        num_experts: usize,
        top_k: usize,
    ) -> crate::Result<Option<Self>> {
        let path = dir.join(ROUTING_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let params = RoutingParams::load(&path)?;
        Ok(Some(RoutingModel::new(params, layers, num_experts, top_k)?))
    }

    /// Experts each layer routes to at all.
    pub fn active_experts(&self) -> usize {
        self.layers.first().map_or(0, |l| l.experts.len())
    }

    /// A fresh sequence's state: every context drawn from its stationary distribution
    /// (standard normal), the same for every sequence of this model.
    pub fn new_state(&self) -> RoutingState {
        let context = self
            .layers
            .iter()
            .enumerate()
            .map(|(l, m)| {
                (0..m.experts.len())
                    .map(|r| normal(hash(&[self.params.seed, STREAM_INIT, l as u64, r as u64])))
                    .collect()
            })
            .collect();
        RoutingState { context }
    }

    fn layer(&self, layer: usize) -> crate::Result<&LayerModel> {
        self.layers.get(layer).ok_or_else(|| {
            crate::Error::InvalidInput(format!(
                "synthetic routing has {} layers, asked for layer {layer}",
                self.layers.len()
            ))
        })
    }

    /// Advances `context` (one layer's, in rank order) to `position` with `token` and
    /// returns the `top_k` chosen ranks, best score first (ties: lower rank first).
    fn step(
        &self,
        m: &LayerModel,
        layer: usize,
        context: &mut [f32],
        position: u64,
        token: u32,
    ) -> Vec<usize> {
        let p = &self.params;
        let rho = p.context_correlation as f32;
        let fresh = (1.0 - rho * rho).sqrt();
        let (wc, wn) = (
            (p.context_weight as f32).sqrt(),
            (1.0 - p.context_weight as f32).sqrt(),
        );
        let key = hash(&[p.seed, layer as u64, position, token as u64]);
        let scores: Vec<f32> = context
            .iter_mut()
            .zip(&m.bias)
            .enumerate()
            .map(|(r, (c, &b))| {
                *c = rho * *c + fresh * normal(hash(&[key, STREAM_CONTEXT, r as u64]));
                b + wc * *c + wn * normal(hash(&[key, STREAM_NOISE, r as u64]))
            })
            .collect();
        let mut ranks: Vec<usize> = (0..scores.len()).collect();
        let by_score = |&a: &usize, &b: &usize| scores[b].total_cmp(&scores[a]).then(a.cmp(&b));
        if self.top_k < ranks.len() {
            ranks.select_nth_unstable_by(self.top_k - 1, by_score);
            ranks.truncate(self.top_k);
        }
        ranks.sort_unstable_by(by_score);
        ranks
    }

    /// Routes one token: advances `state` at `layer` to `position` (the token's index in
    /// its sequence) and returns the `top_k` distinct expert ids (each `< num_experts`),
    /// best first. Positions must be routed in order, each once, for the sequence to
    /// route as one pass would. Errors: `layer` beyond the model's layers.
    pub fn route(
        &self,
        state: &mut RoutingState,
        layer: usize,
        position: u64,
        token: u32,
    ) -> crate::Result<Vec<u32>> {
        Ok(self
            .route_chunk(state, layer, position, &[token], false)?
            .ids)
    }

    /// Routes the tokens `tokens` at positions `start..` through `layer` (advancing
    /// `state` as [`RoutingModel::route`] token by token would) and returns their ids,
    /// with the lookahead forecast of the same selections when `forecast` is set (else an
    /// empty one): per token, each true id is kept with probability `forecast_accuracy`
    /// and otherwise replaced by a popularity draw among the active experts outside that
    /// token's selection. The forecast is what a lookahead guessed before the layer ran;
    /// it is computed here, from the same steps, so that a step's routing can be computed
    /// ahead in one pass ([`StepRoutes`]). Errors: `layer` beyond the model's layers.
    pub fn route_chunk(
        &self,
        state: &mut RoutingState,
        layer: usize,
        start: u64,
        tokens: &[u32],
        forecast: bool,
    ) -> crate::Result<ChunkRouting> {
        let (m, context) = self.layer_state(state, layer)?;
        Ok(self.route_layer(m, context, layer, start, tokens, forecast))
    }

    /// [`RoutingModel::route_chunk`] on `layer`'s tables `m` and its `context`.
    fn route_layer(
        &self,
        m: &LayerModel,
        context: &mut [f32],
        layer: usize,
        start: u64,
        tokens: &[u32],
        forecast: bool,
    ) -> ChunkRouting {
        let mut ids = Vec::with_capacity(tokens.len() * self.top_k);
        let mut guesses = Vec::new();
        for (i, &token) in tokens.iter().enumerate() {
            let position = start + i as u64;
            let truth = self.step(m, layer, context, position, token);
            ids.extend(truth.iter().map(|&r| m.experts[r]));
            if !forecast {
                continue;
            }
            let key = hash(&[self.params.seed, layer as u64, position, token as u64]);
            let mut taken = vec![false; m.experts.len()];
            for &r in &truth {
                taken[r] = true;
            }
            for (j, &r) in truth.iter().enumerate() {
                if uniform(hash(&[key, STREAM_KEEP, j as u64])) < self.params.forecast_accuracy {
                    guesses.push(m.experts[r]);
                } else if let Some(d) =
                    popularity_draw(m, &taken, hash(&[key, STREAM_DRAW, j as u64]))
                {
                    taken[d] = true;
                    guesses.push(m.experts[d]);
                }
            }
        }
        guesses.sort_unstable();
        guesses.dedup();
        ChunkRouting {
            ids,
            forecast: guesses,
        }
    }

    /// `layer`'s tables and its context in `state`. Errors: as [`RoutingModel::layer_context`].
    fn layer_state<'s>(
        &self,
        state: &'s mut RoutingState,
        layer: usize,
    ) -> crate::Result<(&LayerModel, &'s mut [f32])> {
        self.layer_context(layer, state.context.get_mut(layer))
    }

    /// `layer`'s tables with its `context` (the state's, if it has the layer). Errors:
    /// `layer` beyond the model's layers, or a state made by another model.
    fn layer_context<'s>(
        &self,
        layer: usize,
        context: Option<&'s mut Vec<f32>>,
    ) -> crate::Result<(&LayerModel, &'s mut [f32])> {
        let m = self.layer(layer)?;
        match context {
            Some(c) if c.len() == m.experts.len() => Ok((m, c)),
            _ => Err(crate::Error::InvalidInput(format!(
                "routing state has no layer {layer} (made by another model)"
            ))),
        }
    }

    /// `steps` decode steps of a fresh sequence through `layers` (the MoE layers, in
    /// order) at each step, as cache lookups (token `t`, layer, the routed experts),
    /// straight from the model with no forward pass. The token id fed to each step is 0:
    /// it only reseeds the noise, so any value gives statistically the same trace.
    /// Errors: a layer beyond the model's layers.
    pub fn trace(&self, layers: &[usize], steps: usize) -> crate::Result<Vec<Request>> {
        let mut state = self.new_state();
        let mut out = Vec::with_capacity(steps * layers.len());
        for t in 0..steps {
            for &l in layers {
                out.push(Request {
                    token: t as u64,
                    layer: l as u32,
                    experts: self.route(&mut state, l, t as u64, 0)?,
                });
            }
        }
        Ok(out)
    }
}

/// One layer's lookups for one token, as [`RoutingModel::trace`] generates them and the
/// cache simulator (`slotstream::tools::cachesim`) replays them. It lives here, not with
/// the simulator, so that the engine does not import a tool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub token: u64,
    pub layer: u32,
    pub experts: Vec<u32>,
}

/// Tokens from which [`StepRoutes`] routes a chunk's layers on several threads.
const PARALLEL_MIN_TOKENS: usize = 64;

/// One chunk's synthetic routing for every MoE layer, computed ahead on helper threads
/// ([`StepRoutes::spawn`]) while the forward pass records the layers: the model's steps
/// cost the host tens of microseconds a layer, which would otherwise sit between a layer's
/// dispatches (a real model's router runs on the device). The forward pass takes each
/// layer's forecast (for its lookahead) and ids (for its MoE block) as it gets there.
pub struct StepRoutes {
    rx: std::sync::mpsc::Receiver<(usize, crate::Result<ChunkRouting>)>,
    /// Layers received so far, by layer index.
    ready: Vec<Option<ChunkRouting>>,
}

impl StepRoutes {
    /// Starts routing `tokens` (positions `start..`) through `layers` (ascending) on a
    /// thread of `scope`, advancing `state`; with the lookahead forecasts if `forecast`
    /// (see [`RoutingModel::route_chunk`]). From [`PARALLEL_MIN_TOKENS`] tokens the layers
    /// are handed out in order to as many workers as the host has cores (at most one per
    /// layer), so a layer may finish after a later one; an error reaches the forward pass
    /// when it asks for that layer.
    pub fn spawn<'scope, 'env>(
        scope: &'scope std::thread::Scope<'scope, 'env>,
        model: &'env RoutingModel,
        state: &'env mut RoutingState,
        layers: Vec<usize>,
        (start, tokens): (u64, &'env [u32]),
        forecast: bool,
    ) -> StepRoutes {
        let (tx, rx) = std::sync::mpsc::channel();
        let num_layers = layers.iter().max().map_or(0, |&l| l + 1);
        scope.spawn(move || {
            // Each layer's context is its own, so layers route in parallel; the workers take
            // them in order, so the first layers the forward pass asks for come first. A
            // long chunk costs each layer milliseconds (2,048 tokens x 512 experts); a
            // short one is not worth a thread.
            let mut contexts: Vec<Option<&mut Vec<f32>>> =
                state.context.iter_mut().map(Some).collect();
            let jobs: Vec<_> = layers
                .into_iter()
                .map(|l| {
                    (
                        l,
                        model.layer_context(l, contexts.get_mut(l).and_then(Option::take)),
                    )
                })
                .collect();
            let workers = if tokens.len() >= PARALLEL_MIN_TOKENS {
                std::thread::available_parallelism()
                    .map_or(1, |n| n.get())
                    .min(jobs.len())
            } else {
                1
            };
            let queue = std::sync::Mutex::new(jobs.into_iter());
            let work = |tx: std::sync::mpsc::Sender<_>| loop {
                let Some((layer, job)) = queue.lock().unwrap_or_else(|p| p.into_inner()).next()
                else {
                    return;
                };
                let routed =
                    job.map(|(m, c)| model.route_layer(m, c, layer, start, tokens, forecast));
                let failed = routed.is_err();
                // A closed channel: the forward pass stopped early (its own error).
                if tx.send((layer, routed)).is_err() || failed {
                    return;
                }
            };
            std::thread::scope(|workers_scope| {
                for _ in 1..workers {
                    let tx = tx.clone();
                    workers_scope.spawn(|| work(tx));
                }
                work(tx);
            });
        });
        StepRoutes {
            rx,
            ready: vec![None; num_layers],
        }
    }

    /// `layer`'s routing, waiting for the helper to get there. Errors: the routing
    /// model's, or `layer` not among the spawned layers.
    fn layer(&mut self, layer: usize) -> crate::Result<&mut ChunkRouting> {
        let missing =
            || crate::Error::Internal(format!("synthetic routing: layer {layer} was not routed"));
        if layer >= self.ready.len() {
            return Err(missing());
        }
        while self.ready[layer].is_none() {
            let (l, routed) = self.rx.recv().map_err(|_| missing())?;
            *self.ready.get_mut(l).ok_or_else(missing)? = Some(routed?);
        }
        self.ready[layer].as_mut().ok_or_else(missing)
    }

    /// `layer`'s lookahead forecast (taken: a second call gets none; empty when spawned
    /// without forecasts).
    pub fn forecast(&mut self, layer: usize) -> crate::Result<Vec<u32>> {
        Ok(std::mem::take(&mut self.layer(layer)?.forecast))
    }

    /// `layer`'s expert ids `[T, top_k]` (taken: a second call gets none).
    pub fn ids(&mut self, layer: usize) -> crate::Result<Vec<u32>> {
        Ok(std::mem::take(&mut self.layer(layer)?.ids))
    }
}

/// A rank drawn with probability proportional to `exp(bias)` among those not `taken`
/// (rejection sampling on the running sums, then the most popular free rank), or `None`
/// when every rank is taken.
fn popularity_draw(m: &LayerModel, taken: &[bool], seed: u64) -> Option<usize> {
    let total = *m.cumulative.last()?;
    for attempt in 0..32u64 {
        let x = uniform(hash(&[seed, attempt])) * total;
        let r = m
            .cumulative
            .partition_point(|&c| c <= x)
            .min(m.cumulative.len() - 1);
        if !taken[r] {
            return Some(r);
        }
    }
    taken.iter().position(|&t| !t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(seed: u64) -> RoutingModel {
        let mut p = RoutingParams::calibrated();
        p.seed = seed;
        RoutingModel::new(p, 48, 512, 10).unwrap()
    }

    #[test]
    fn routing_is_deterministic_and_distinct() {
        let seed: u64 = rand::random();
        let (a, b) = (model(seed), model(seed));
        let layers: Vec<usize> = (0..48).collect();
        let trace = |m: &RoutingModel| m.trace(&layers, 20).unwrap();
        assert_eq!(trace(&a), trace(&b), "seed {seed}");
        assert_ne!(trace(&a), trace(&model(seed ^ 1)), "seed {seed}");
        for r in trace(&a) {
            let mut ids = r.experts.clone();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), 10, "seed {seed}: {r:?}");
            assert!(ids.iter().all(|&e| e < 512), "seed {seed}: {r:?}");
        }
    }

    #[test]
    fn token_by_token_equals_one_pass() {
        let seed: u64 = rand::random();
        let m = model(seed);
        let tokens = [5u32, 9, 9, 100, 7];
        let (mut s1, mut s2) = (m.new_state(), m.new_state());
        let chunk = m.route_chunk(&mut s1, 3, 0, &tokens, true).unwrap();
        assert!(!chunk.forecast.is_empty() && chunk.forecast.len() <= 50);
        assert!(
            chunk.forecast.windows(2).all(|w| w[0] < w[1]),
            "seed {seed}"
        );
        let mut ids = Vec::new();
        for (t, &tok) in tokens.iter().enumerate() {
            ids.extend(m.route(&mut s2, 3, t as u64, tok).unwrap());
        }
        assert_eq!(chunk.ids, ids, "seed {seed}");
        assert_eq!(s1, s2, "seed {seed}");
        // The same positions split in two chunks route and forecast the same.
        let mut s3 = m.new_state();
        let a = m.route_chunk(&mut s3, 3, 0, &tokens[..2], true).unwrap();
        let b = m.route_chunk(&mut s3, 3, 2, &tokens[2..], true).unwrap();
        assert_eq!([a.ids, b.ids].concat(), chunk.ids, "seed {seed}");
        let mut both = [a.forecast, b.forecast].concat();
        both.sort_unstable();
        both.dedup();
        assert_eq!(both, chunk.forecast, "seed {seed}");
        assert!(m.route(&mut s1, 48, 0, 0).is_err());
        assert!(m.route_chunk(&mut s1, 48, 0, &tokens, true).is_err());
    }

    /// The helper thread's routing equals `route_chunk` layer by layer, whichever order
    /// the layers are asked for; a layer it did not route, or a state from another model,
    /// is an error rather than a hang.
    #[test]
    fn step_routes_match_route_chunk() {
        let seed: u64 = rand::random();
        let m = model(seed);
        let tokens = [3u32, 1, 4, 1, 5];
        let layers = vec![0usize, 2, 5, 9];
        let mut reference = m.new_state();
        let want: Vec<ChunkRouting> = layers
            .iter()
            .map(|&l| m.route_chunk(&mut reference, l, 7, &tokens, true).unwrap())
            .collect();
        let mut state = m.new_state();
        std::thread::scope(|scope| {
            let mut routes =
                StepRoutes::spawn(scope, &m, &mut state, layers.clone(), (7, &tokens), true);
            assert_eq!(routes.forecast(5).unwrap(), want[2].forecast, "seed {seed}");
            assert_eq!(routes.ids(2).unwrap(), want[1].ids, "seed {seed}");
            assert_eq!(routes.ids(0).unwrap(), want[0].ids, "seed {seed}");
            assert_eq!(routes.ids(9).unwrap(), want[3].ids, "seed {seed}");
            assert!(routes.ids(9).unwrap().is_empty(), "taken once");
            assert!(routes.ids(4).is_err(), "layer 4 was not routed");
            assert!(routes.ids(10).is_err(), "layer 10 was not routed");
        });
        assert_eq!(state, reference, "seed {seed}");
        // Without forecasts: the same ids, no guesses.
        let mut state = m.new_state();
        std::thread::scope(|scope| {
            let mut routes = StepRoutes::spawn(scope, &m, &mut state, vec![2], (7, &tokens), false);
            assert!(routes.forecast(2).unwrap().is_empty());
            assert_eq!(routes.ids(2).unwrap(), want[1].ids, "seed {seed}");
        });
        // A state made by a 4-layer model: its error comes through.
        let small = RoutingModel::new(RoutingParams::calibrated(), 4, 512, 10).unwrap();
        let mut foreign = small.new_state();
        std::thread::scope(|scope| {
            let mut routes =
                StepRoutes::spawn(scope, &m, &mut foreign, vec![1, 6], (0, &tokens), true);
            assert!(routes.ids(1).is_ok());
            let e = routes.ids(6).unwrap_err().to_string();
            assert!(e.contains("another model"), "{e}");
        });
    }

    #[test]
    fn forecast_accuracy_is_as_stated() {
        let seed: u64 = rand::random();
        let mut p = RoutingParams::calibrated();
        p.seed = seed;
        p.forecast_accuracy = 0.7;
        let m = RoutingModel::new(p, 4, 512, 10).unwrap();
        let mut state = m.new_state();
        let (mut right, mut total) = (0usize, 0usize);
        for t in 0..400u64 {
            let chunk = m.route_chunk(&mut state, 2, t, &[t as u32], true).unwrap();
            right += chunk
                .forecast
                .iter()
                .filter(|g| chunk.ids.contains(g))
                .count();
            total += chunk.ids.len();
        }
        let acc = right as f64 / total as f64;
        assert!((acc - 0.7).abs() < 0.04, "seed {seed}: accuracy {acc}");
    }
}
