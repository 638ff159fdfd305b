//! Choosing the next token from logits, as mlx-lm 0.32.2 does it
//! (`mlx_lm/sample_utils.py`): the repetition penalty on the logits of the last
//! `repetition_context` tokens, log-softmax, then top-p, min-p and top-k filters in that
//! order, then a draw from `softmax(logprobs / temperature)`; temperature 0 is argmax.
//!
//! Logits that are not finite (NaN, +Inf or -Inf: a NaN in a weight is enough) are left
//! out of every path, as tokens of probability zero: an overflowed +Inf is no more a
//! prediction than a NaN. A step with no finite logit is an error
//! ([`Error::NoFiniteLogits`]), never a token chosen from nothing.
//!
//! [`SamplingInput`] reads the values users give (flags, request fields) alike for the
//! command line and the server.

use std::borrow::Cow;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use llguidance::toktrie::SimpleVob;

use crate::error::{Error, Result};

/// Sampling parameters. `Default` is greedy.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SamplingOptions {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most probable tokens (0: off; 1 keeps the most probable).
    pub top_k: usize,
    /// Keep the smallest set of most probable tokens whose mass reaches `top_p` (1: off;
    /// 0 keeps the most probable).
    pub top_p: f32,
    /// Drop tokens less probable than `min_p` times the most probable one (0: off).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recent tokens by this (1: off).
    pub repetition_penalty: f32,
    /// How many recent tokens the repetition penalty looks at (mlx-lm: 20).
    pub repetition_context: usize,
    /// Seed of the random stream (a fixed seed makes a run reproducible).
    pub seed: u64,
}

/// The repetition penalties accepted: beyond these bounds penalized logits overflow or
/// vanish in f32.
pub const REPETITION_PENALTY: std::ops::RangeInclusive<f32> = 1e-3..=1e3;

impl Default for SamplingOptions {
    fn default() -> Self {
        SamplingOptions {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repetition_context: 20,
            seed: 0,
        }
    }
}

impl SamplingOptions {
    /// Errors ([`Error::Sampling`]) name the first option out of range by its request
    /// field (`top_p`).
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, message: &str| {
            Err(Error::Sampling {
                field,
                message: message.to_string(),
            })
        };
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", "must be a finite number >= 0 (0: greedy)");
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad("top_p", "must be in [0, 1] (1: off)");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "must be in [0, 1] (0: off)");
        }
        if !REPETITION_PENALTY.contains(&self.repetition_penalty) {
            return bad("repetition_penalty", "must be in [0.001, 1000] (1: off)");
        }
        Ok(())
    }
}

/// Sampling values as a user gives them, on the command line or in a request; an absent
/// one keeps its default. [`SamplingInput::apply`] reads them the one way both take:
/// - `top_k` 0 or less is off (vLLM and llama.cpp clients send -1), 1 is greedy;
/// - `top_p` 1 is off, 0 keeps only the most probable token;
/// - `seed` is an integer from 0 to 2^64 - 1, or -1 for a random one (llama.cpp's
///   convention).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingInput {
    pub temperature: Option<f32>,
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<i128>,
}

impl SamplingInput {
    /// `defaults` with the given values set and normalized: `top_k <= 0` becomes 0 (off),
    /// `top_k` 1 makes the draw greedy (temperature 0), seed -1 becomes a random seed.
    /// Errors ([`Error::Sampling`], naming the field): a value out of range (see
    /// [`SamplingOptions::validate`]), a seed outside `-1 ..= 2^64 - 1`.
    pub fn apply(&self, defaults: &SamplingOptions) -> Result<SamplingOptions> {
        let mut o = defaults.clone();
        o.temperature = self.temperature.unwrap_or(o.temperature);
        if let Some(k) = self.top_k {
            o.top_k = usize::try_from(k.max(0)).unwrap_or(usize::MAX);
        }
        o.top_p = self.top_p.unwrap_or(o.top_p);
        o.min_p = self.min_p.unwrap_or(o.min_p);
        o.repetition_penalty = self.repetition_penalty.unwrap_or(o.repetition_penalty);
        o.seed = match self.seed {
            None => o.seed,
            Some(-1) => rand::random(),
            Some(s) => u64::try_from(s).map_err(|_| Error::Sampling {
                field: "seed",
                message: format!(
                    "{s} is not an integer from 0 to 2^64 - 1, or -1 for a random one"
                ),
            })?,
        };
        o.validate()?;
        if o.top_k == 1 {
            o.temperature = 0.0;
        }
        Ok(o)
    }
}

/// A sampler with its own random stream.
pub struct Sampler {
    options: SamplingOptions,
    rng: StdRng,
    ignored: NonFinite,
}

/// Logits left out because they were not finite, over the steps of one sampler.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NonFinite {
    /// Non-finite logits, summed over the steps.
    pub logits: u64,
    /// Steps that had at least one.
    pub steps: u64,
}

impl Sampler {
    /// Errors: options out of range (see [`SamplingOptions::validate`]).
    pub fn new(options: SamplingOptions) -> Result<Self> {
        options.validate()?;
        let rng = StdRng::seed_from_u64(options.seed);
        Ok(Sampler {
            options,
            rng,
            ignored: NonFinite::default(),
        })
    }

    /// The non-finite logits this sampler has left out so far.
    pub fn non_finite(&self) -> NonFinite {
        self.ignored
    }

    /// The next token given `logits` (one row, `[vocab]`) and the tokens so far; logits
    /// that are not finite are left out (and counted, [`Sampler::non_finite`]).
    /// Errors: [`Error::NoFiniteLogits`] when no logit is finite.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        self.sample_allowed(logits, history, None)
    }

    /// [`Sampler::sample`] among the tokens `allowed` holds (a grammar's mask, bit `id`
    /// set for an allowed id; `None`: every token): the others are left out of every path
    /// (greedy, temperature, the filters, the penalty) as logits of -inf, before anything
    /// else, so the filters see only the tokens the grammar allows. Errors:
    /// [`Error::NoFiniteLogits`] when no logit is finite, [`Error::NothingAllowed`] when
    /// the mask leaves none of the finite ones.
    pub fn sample_allowed(
        &mut self,
        logits: &[f32],
        history: &[u32],
        allowed: Option<&SimpleVob>,
    ) -> Result<u32> {
        let mut logits = self.finite_counted(logits)?;
        if let Some(allowed) = allowed {
            let masked = logits.to_mut();
            let mut left = 0usize;
            for (id, l) in masked.iter_mut().enumerate() {
                if id >= allowed.len() || !allowed.is_allowed(id as u32) {
                    *l = f32::NEG_INFINITY;
                } else if l.is_finite() {
                    left += 1;
                }
            }
            if left == 0 {
                return Err(Error::NothingAllowed);
            }
        }
        Ok(self.draw(&logits, history))
    }

    /// The distribution [`Sampler::sample`] draws from given `logits` (`[vocab]`) and the
    /// tokens so far, `[vocab]` probabilities summing to 1: after the penalty, the filters
    /// and the temperature; greedy (temperature 0) puts all the mass on its pick.
    /// Non-finite logits are left out and counted as [`Sampler::sample`] does. Errors:
    /// [`Error::NoFiniteLogits`] when no logit is finite.
    pub fn probabilities(&mut self, logits: &[f32], history: &[u32]) -> Result<Vec<f32>> {
        let logits = self.finite_counted(logits)?;
        if self.options.temperature == 0.0 {
            let mut probs = vec![0.0; logits.len()];
            probs[greedy(&self.penalized(&logits, history)) as usize] = 1.0;
            return Ok(probs);
        }
        Ok(self.tempered(&logits, history))
    }

    /// A token drawn from `probs` (`[vocab]`, summing to 1: [`Sampler::probabilities`]),
    /// with this sampler's random stream.
    pub fn draw_from(&mut self, probs: &[f32]) -> u32 {
        self.pick(probs, 1.0)
    }

    /// Speculative sampling's verdict on `draft`, a token drawn from `q` (the drafter's
    /// distribution), given `p` (the model's at the same position; both `[vocab]`, from
    /// [`Sampler::probabilities`] so that the same transforms apply): the draft is kept
    /// with probability `min(1, p(draft) / q(draft))` (`None`), else a token is drawn
    /// from `normalize(max(0, p - q))` (`Some`). Whatever `q` is, the token that comes
    /// out (the draft when kept) is distributed as `p` (Leviathan et al. 2023, "Fast
    /// Inference from Transformers via Speculative Decoding", appendix A.1; Chen et al.
    /// 2023). Greedy's one-hot distributions make this keep exactly the drafts equal to
    /// `p`'s pick and give that pick otherwise, with no randomness.
    pub fn speculate(&mut self, p: &[f32], q: &[f32], draft: u32) -> Option<u32> {
        let at = |d: &[f32]| d.get(draft as usize).copied().unwrap_or(0.0) as f64;
        // u < p/q, written without dividing so that q(draft) = 0 cannot make a NaN.
        if self.rng.random::<f64>() * at(q) < at(p) {
            return None;
        }
        let residual: Vec<f32> = p.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect();
        let total: f64 = residual.iter().map(|&r| r as f64).sum();
        // p = q up to rounding leaves no residual mass (and rejects only by rounding):
        // p itself is then the residual's limit.
        Some(match total > 0.0 {
            true => self.pick(&residual, total),
            false => self.pick(p, 1.0),
        })
    }

    /// `logits` with the non-finite ones set to -inf, counted for [`Sampler::non_finite`].
    /// Errors: [`Error::NoFiniteLogits`] when none is finite.
    fn finite_counted<'l>(&mut self, logits: &'l [f32]) -> Result<Cow<'l, [f32]>> {
        let (logits, bad) = finite(logits);
        if bad > 0 {
            self.ignored.logits += bad as u64;
            self.ignored.steps += 1;
        }
        if bad == logits.len() {
            return Err(Error::NoFiniteLogits { vocab: bad });
        }
        Ok(logits)
    }

    /// [`Sampler::sample`] on logits that are finite or -inf.
    fn draw(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.options.temperature == 0.0 {
            return greedy(&self.penalized(logits, history));
        }
        let probs = self.tempered(logits, history);
        self.pick(&probs, 1.0)
    }

    /// The probabilities of a draw at a temperature above 0, from logits that are finite
    /// or -inf.
    fn tempered(&self, logits: &[f32], history: &[u32]) -> Vec<f32> {
        let logprobs = self.logprobs(logits, history);
        let t = self.options.temperature;
        // Shift by the maximum before dividing, so a tiny temperature sends the others to
        // -inf instead of overflowing the largest to +inf (which would make NaNs).
        let top = logprobs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        softmax(&logprobs.iter().map(|l| (l - top) / t).collect::<Vec<_>>())
    }

    /// A token drawn from `weights` (`[vocab]`, non-negative, summing to `total`).
    fn pick(&mut self, weights: &[f32], total: f64) -> u32 {
        let mut u: f64 = self.rng.random::<f64>() * total;
        for (i, &w) in weights.iter().enumerate() {
            u -= w as f64;
            if u < 0.0 {
                return i as u32;
            }
        }
        // Rounding left a sliver of mass: the last token that can be drawn.
        weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
    }

    /// The logits after the repetition penalty over the last `repetition_context` tokens
    /// of `history` (borrowed when there is none).
    fn penalized<'l>(&self, logits: &'l [f32], history: &[u32]) -> Cow<'l, [f32]> {
        let o = &self.options;
        if o.repetition_penalty == 1.0 {
            return Cow::Borrowed(logits);
        }
        let mut logits = logits.to_vec();
        let start = history.len().saturating_sub(o.repetition_context);
        // Once per distinct token, as mlx-lm's gather/scatter does.
        let mut recent = history[start..].to_vec();
        recent.sort_unstable();
        recent.dedup();
        for id in recent {
            if let Some(l) = logits.get_mut(id as usize) {
                *l = if *l < 0.0 {
                    *l * o.repetition_penalty
                } else {
                    *l / o.repetition_penalty
                };
            }
        }
        Cow::Owned(logits)
    }

    /// Log-probabilities after the penalty and the filters (filtered and non-finite
    /// entries are -inf). This is the distribution a temperature-1 draw samples from.
    pub fn filtered_logprobs(&self, logits: &[f32], history: &[u32]) -> Vec<f32> {
        self.logprobs(&finite(logits).0, history)
    }

    /// [`Sampler::filtered_logprobs`] of logits that are finite or -inf.
    fn logprobs(&self, logits: &[f32], history: &[u32]) -> Vec<f32> {
        let o = &self.options;
        let mut lp = log_softmax(&self.penalized(logits, history));
        if o.temperature == 0.0 {
            return lp;
        }
        if o.top_p < 1.0 {
            // Keep tokens down to the one at which the mass above it first reaches top_p.
            let mut sorted: Vec<f32> = lp.clone();
            sorted.sort_by(|a, b| a.total_cmp(b));
            let probs: Vec<f32> = sorted.iter().map(|l| l.exp()).collect();
            let total: f32 = probs.iter().sum();
            let mut above = 0.0f32;
            let mut dropped = 0usize;
            for i in (0..probs.len()).rev() {
                // mass strictly above position i in ascending order
                if above >= o.top_p * total {
                    dropped += 1;
                }
                above += probs[i];
            }
            let threshold = sorted[dropped.min(sorted.len() - 1)];
            lp.iter_mut()
                .filter(|l| **l < threshold)
                .for_each(|l| *l = f32::NEG_INFINITY);
        }
        if o.min_p > 0.0 {
            let top = lp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let floor = top + o.min_p.ln();
            lp.iter_mut()
                .filter(|l| **l < floor)
                .for_each(|l| *l = f32::NEG_INFINITY);
        }
        if o.top_k > 0 && o.top_k < lp.len() {
            // The k most probable of the tokens still in play (ties: lower ids first).
            let mut order: Vec<usize> = (0..lp.len()).filter(|&i| lp[i].is_finite()).collect();
            order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
            let mut keep = vec![false; lp.len()];
            for &i in order.iter().take(o.top_k) {
                keep[i] = true;
            }
            for (l, k) in lp.iter_mut().zip(keep) {
                if !k {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        lp
    }
}

/// `logits` with every non-finite value (NaN, +Inf, -Inf) set to -inf, so it drops out of
/// the softmax, and how many there were; borrowed when all are finite.
fn finite(logits: &[f32]) -> (Cow<'_, [f32]>, usize) {
    let bad = logits.iter().filter(|v| !v.is_finite()).count();
    if bad == 0 {
        return (Cow::Borrowed(logits), 0);
    }
    let masked = logits
        .iter()
        .map(|&v| if v.is_finite() { v } else { f32::NEG_INFINITY })
        .collect();
    (Cow::Owned(masked), bad)
}

/// Index of the largest value (the first on ties).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// `argmax(log_softmax(x))`, mlx-lm's greedy pick (ties to the lowest id), without the
/// softmax over the whole vocabulary. `x - lse` rounds monotonically, so the pick is `x`'s
/// own argmax unless a lower id's logit is close enough to the maximum for the rounding to
/// tie them (`x_max - lse` lies in `[-ln n, 0]`, where an f32 ulp is at most 2^-19; 1e-5
/// leaves room), or a logit is not finite; then the log-softmax decides.
fn greedy(x: &[f32]) -> u32 {
    let best = argmax(x) as usize;
    let top = x.get(best).copied().unwrap_or(0.0);
    let near = x[..best].iter().any(|&v| top - v <= 1e-5);
    if near || !x.iter().all(|v| v.is_finite()) {
        return argmax(&log_softmax(x));
    }
    best as u32
}

/// The log-softmax of `logits` at token `id` and the `top` most probable tokens with
/// theirs, most probable first (ties: lower ids first): the model's own distribution,
/// before penalties, filters and masks (non-finite logits count as probability zero).
/// `top` is capped at the vocabulary.
pub fn token_logprobs(logits: &[f32], id: u32, top: usize) -> TokenLogprobs {
    let lp = log_softmax(&finite(logits).0);
    let mut order: Vec<u32> = (0..lp.len() as u32).collect();
    let by = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
    let top = top.min(order.len());
    if top > 0 && top < order.len() {
        order.select_nth_unstable_by(top - 1, by);
    }
    order.truncate(top);
    order.sort_by(by);
    TokenLogprobs {
        logprob: lp.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY),
        top: order.into_iter().map(|i| (i, lp[i as usize])).collect(),
    }
}

/// One generated token's log-probability and the most probable alternatives
/// ([`token_logprobs`]); natural logarithms.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's.
    pub logprob: f32,
    /// `(id, logprob)` of the most probable tokens, most probable first.
    pub top: Vec<(u32, f32)>,
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + x.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
    x.iter().map(|v| v - lse).collect()
}

fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = x.iter().map(|v| (v - max).exp()).collect();
    let s: f32 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(f: impl FnOnce(&mut SamplingOptions)) -> SamplingOptions {
        let mut o = SamplingOptions {
            temperature: 1.0,
            ..Default::default()
        };
        f(&mut o);
        o
    }

    fn kept(s: &Sampler, logits: &[f32]) -> Vec<usize> {
        s.filtered_logprobs(logits, &[])
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, _)| i)
            .collect()
    }

    // probs of [ln .5, ln .25, ln .15, ln .1] = .5 .25 .15 .1
    const L: [f32; 4] = [
        -std::f32::consts::LN_2,
        -2.0 * std::f32::consts::LN_2,
        -1.897_12,
        -std::f32::consts::LN_10,
    ];

    #[test]
    fn a_tiny_temperature_samples_the_argmax() {
        let logits: Vec<f32> = (0..100)
            .map(|_| rand::random::<f32>() * 40.0 - 20.0)
            .collect();
        let mut s = Sampler::new(opts(|o| o.temperature = 1e-30)).unwrap();
        for _ in 0..10 {
            assert_eq!(s.sample(&logits, &[]).unwrap(), argmax(&logits));
        }
    }

    /// Every path (greedy, temperature, top-k, top-p, min-p, the repetition penalty, and
    /// all at once) draws only tokens the mask allows, on fresh random logits and masks;
    /// greedy picks the best allowed one; a mask that allows nothing finite is an error.
    #[test]
    fn a_mask_holds_in_every_path() {
        let seed: u64 = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        let paths: [fn(&mut SamplingOptions); 7] = [
            |o| o.temperature = 0.0,
            |_| {},
            |o| o.top_k = 3,
            |o| o.top_p = 0.5,
            |o| o.min_p = 0.2,
            |o| o.repetition_penalty = 1.5,
            |o| {
                o.temperature = 0.7;
                o.top_k = 5;
                o.top_p = 0.9;
                o.min_p = 0.05;
                o.repetition_penalty = 1.3;
            },
        ];
        for (p, path) in paths.iter().enumerate() {
            let mut s = Sampler::new(opts(|o| {
                path(o);
                o.seed = rng.random();
            }))
            .unwrap();
            for _ in 0..50 {
                let n = rng.random_range(2..300);
                let logits: Vec<f32> = (0..n).map(|_| rng.random_range(-8.0..8.0)).collect();
                let mut mask = SimpleVob::alloc(n);
                for id in 0..n {
                    if rng.random_bool(0.1) {
                        mask.allow_token(id as u32);
                    }
                }
                let any = rng.random_range(0..n) as u32;
                mask.allow_token(any);
                let history: Vec<u32> = (0..10).map(|_| rng.random_range(0..n as u32)).collect();
                let id = s.sample_allowed(&logits, &history, Some(&mask)).unwrap();
                assert!(mask.is_allowed(id), "seed {seed} path {p}");
                if p == 0 {
                    let best = (0..n as u32)
                        .filter(|&i| mask.is_allowed(i))
                        .max_by(|&a, &b| {
                            logits[a as usize]
                                .total_cmp(&logits[b as usize])
                                .then(b.cmp(&a))
                        })
                        .unwrap();
                    assert_eq!(id, best, "seed {seed}");
                }
            }
        }
        let mut s = Sampler::new(opts(|_| {})).unwrap();
        let mut mask = SimpleVob::alloc(3);
        mask.allow_token(1);
        assert!(matches!(
            s.sample_allowed(&[0.0, f32::NAN, 1.0], &[], Some(&mask)),
            Err(Error::NothingAllowed)
        ));
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingOptions::default()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9], &[]).unwrap(), 1);
    }

    /// The shortcut picks what argmax over the log-softmax picks (mlx-lm's greedy), on
    /// fresh random logits with near-ties planted below and above the maximum, a NaN, and
    /// large magnitudes where `x - lse` rounds coarsely.
    #[test]
    fn greedy_matches_the_log_softmax_argmax() {
        let seed: u64 = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        for case in 0..400 {
            let n = rng.random_range(2..5000);
            let scale = [1.0f32, 30.0, 3e4][case % 3];
            let mut x: Vec<f32> = (0..n)
                .map(|_| rng.random_range(-1.0..1.0) * scale)
                .collect();
            let best = argmax(&x) as usize;
            if case % 4 != 0 {
                // A near-tie: the maximum less a few ulps (or exactly it), at a random id.
                let j = rng.random_range(0..n);
                let ulps = rng.random_range(0..4u32);
                x[j] = f32::from_bits(x[best].to_bits().saturating_sub(ulps)).min(x[best]);
            }
            if case % 50 == 7 {
                x[rng.random_range(0..n)] = f32::NAN;
            }
            assert_eq!(
                greedy(&x),
                argmax(&log_softmax(&x)),
                "seed {seed}, case {case}"
            );
        }
    }

    #[test]
    fn filters_keep_what_a_direct_computation_keeps() {
        // top-k 2: the two most probable.
        assert_eq!(
            kept(&Sampler::new(opts(|o| o.top_k = 2)).unwrap(), &L),
            vec![0, 1]
        );
        // top-p 0.7: .5 + .25 reaches .7 -> keep two; 0.8 -> keep three.
        assert_eq!(
            kept(&Sampler::new(opts(|o| o.top_p = 0.7)).unwrap(), &L),
            vec![0, 1]
        );
        assert_eq!(
            kept(&Sampler::new(opts(|o| o.top_p = 0.8)).unwrap(), &L),
            vec![0, 1, 2]
        );
        // min-p 0.4: keep p >= 0.2 -> .5 and .25.
        assert_eq!(
            kept(&Sampler::new(opts(|o| o.min_p = 0.4)).unwrap(), &L),
            vec![0, 1]
        );
    }

    #[test]
    fn filters_combine_like_a_direct_computation() {
        // min-p 0.4 keeps {0, 1}; top-k 3 then keeps those two, not three tokens.
        let s = Sampler::new(opts(|o| {
            o.min_p = 0.4;
            o.top_k = 3;
        }))
        .unwrap();
        assert_eq!(kept(&s, &L), vec![0, 1]);
        // top-p 0.7 keeps {0, 1}; top-k 1 keeps the most probable.
        let s = Sampler::new(opts(|o| {
            o.top_p = 0.7;
            o.top_k = 1;
        }))
        .unwrap();
        assert_eq!(kept(&s, &L), vec![0]);
    }

    #[test]
    fn repetition_penalty_scales_recent_logits() {
        let s = Sampler::new(opts(|o| o.repetition_penalty = 2.0)).unwrap();
        // Token 0 repeats: it is still penalised once (mlx-lm's [1, -4, 1]).
        let lp = s.filtered_logprobs(&[2.0, -2.0, 1.0], &[0, 0, 0, 1]);
        // Penalised logits are [1, -4, 1]: tokens 0 and 2 now tie.
        assert!((lp[0] - lp[2]).abs() < 1e-6 && lp[1] < lp[0] - 4.9);
    }

    #[test]
    fn draws_follow_the_distribution_and_the_seed() {
        let o = opts(|o| o.seed = 42);
        let draw = |o: &SamplingOptions| {
            let mut s = Sampler::new(o.clone()).unwrap();
            (0..4000)
                .map(|_| s.sample(&L, &[]).unwrap())
                .collect::<Vec<_>>()
        };
        let a = draw(&o);
        assert_eq!(a, draw(&o), "same seed, same draws");
        assert_ne!(a, draw(&opts(|o| o.seed = 43)), "another seed, other draws");
        for (i, p) in [0.5, 0.25, 0.15, 0.1].iter().enumerate() {
            let f = a.iter().filter(|&&t| t == i as u32).count() as f64 / a.len() as f64;
            assert!(
                (f - p).abs() < 0.03,
                "token {i}: frequency {f} vs probability {p}"
            );
        }
        // Temperature 0.5 sharpens: p_i proportional to p_i^2 -> .5^2/(sum) = .6135.
        let mut s = Sampler::new(opts(|o| o.temperature = 0.5)).unwrap();
        let f0 = (0..4000)
            .filter(|_| s.sample(&L, &[]).unwrap() == 0)
            .count() as f64
            / 4000.0;
        let want = 0.25 / (0.25 + 0.0625 + 0.0225 + 0.01);
        assert!((f0 - want).abs() < 0.03, "{f0} vs {want}");
    }

    /// Every path (greedy, temperature, top-k, top-p, min-p, repetition penalty, and
    /// their combination) on fresh random logits with NaN, +Inf and -Inf planted: the
    /// pick is the one made on the same logits with the planted entries removed (the same
    /// seed, ids mapped back), never a planted id, and the planted entries are counted.
    #[test]
    fn non_finite_logits_are_left_out_of_every_path() {
        let seed: u64 = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        type Path = (&'static str, fn(&mut SamplingOptions));
        let paths: [Path; 7] = [
            ("greedy", |o| o.temperature = 0.0),
            ("temperature", |o| o.temperature = 0.7),
            ("top-k", |o| o.top_k = 5),
            ("top-p", |o| o.top_p = 0.6),
            ("min-p", |o| o.min_p = 0.05),
            ("repetition penalty", |o| o.repetition_penalty = 1.3),
            ("all", |o| {
                o.temperature = 1.3;
                o.top_k = 40;
                o.top_p = 0.9;
                o.min_p = 0.02;
                o.repetition_penalty = 0.8;
            }),
        ];
        for case in 0..300 {
            let (name, set) = paths[case % paths.len()];
            let n = rng.random_range(8..600);
            let scale = [1.0f32, 8.0][case % 2];
            let logits: Vec<f32> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
            let mut planted = logits.clone();
            let bad = rng.random_range(1..n / 2);
            for _ in 0..bad {
                let at = rng.random_range(0..n);
                planted[at] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][at % 3];
            }
            let kept: Vec<usize> = (0..n).filter(|&i| planted[i].is_finite()).collect();
            let compact: Vec<f32> = kept.iter().map(|&i| logits[i]).collect();
            // Within the penalty's 20-token window, which removing ids would otherwise shift.
            let history: Vec<u32> = (0..20).map(|_| rng.random_range(0..n as u32)).collect();
            let compact_history: Vec<u32> = history
                .iter()
                .filter_map(|&h| kept.iter().position(|&k| k == h as usize).map(|p| p as u32))
                .collect();
            let o = opts(|o| {
                o.seed = rng.random();
                set(o)
            });
            let mut s = Sampler::new(o.clone()).unwrap();
            let mut reference = Sampler::new(o).unwrap();
            for step in 1..=3u64 {
                let got = s.sample(&planted, &history).unwrap() as usize;
                let want = reference.sample(&compact, &compact_history).unwrap() as usize;
                assert_eq!(
                    got, kept[want],
                    "seed {seed}, case {case} ({name}), step {step}"
                );
                assert_eq!(
                    s.non_finite(),
                    NonFinite {
                        logits: step * (n - kept.len()) as u64,
                        steps: step
                    }
                );
            }
            assert_eq!(reference.non_finite(), NonFinite::default());
        }
    }

    /// A step whose logits are all NaN or infinite fails on every path with
    /// `NoFiniteLogits` (it used to give token 0).
    #[test]
    fn no_finite_logit_is_an_error_not_token_zero() {
        let paths: [fn(&mut SamplingOptions); 3] = [
            |_| {},
            |o| o.temperature = 0.0,
            |o| {
                o.top_k = 3;
                o.top_p = 0.5;
                o.min_p = 0.1;
                o.repetition_penalty = 1.5;
            },
        ];
        for set in paths {
            for row in [
                vec![f32::NAN; 64],
                (0..64)
                    .map(|i| [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][i % 3])
                    .collect(),
            ] {
                let mut s = Sampler::new(opts(set)).unwrap();
                let e = s.sample(&row, &[0, 1, 2]).unwrap_err();
                assert!(matches!(e, Error::NoFiniteLogits { vocab: 64 }), "{e}");
                assert!(e.to_string().contains("64"), "{e}");
            }
        }
    }

    /// The command line and the server read edge values through `SamplingInput::apply`:
    /// top-k 0 or less is off, 1 is greedy; top-p 1 is off and 0 keeps the most probable;
    /// seed -1 is random, other seeds 0 to 2^64 - 1; out-of-range values name the field.
    #[test]
    fn sampling_input_reads_edge_values_alike() {
        let base = SamplingOptions {
            temperature: 0.8,
            ..Default::default()
        };
        let apply = |i: SamplingInput| i.apply(&base);
        for k in [0, -1, -40, i64::MIN] {
            let o = apply(SamplingInput {
                top_k: Some(k),
                ..Default::default()
            })
            .unwrap();
            assert_eq!((o.top_k, o.temperature), (0, 0.8), "top_k {k}");
        }
        let o = apply(SamplingInput {
            top_k: Some(1),
            ..Default::default()
        })
        .unwrap();
        assert_eq!((o.top_k, o.temperature), (1, 0.0), "top_k 1 is greedy");
        let o = apply(SamplingInput {
            top_k: Some(7),
            ..Default::default()
        })
        .unwrap();
        assert_eq!((o.top_k, o.temperature), (7, 0.8));
        // top-p 0 keeps the most probable token; 1 keeps everything.
        for (p, want) in [(0.0, vec![0]), (1.0, vec![0, 1, 2, 3])] {
            let o = apply(SamplingInput {
                top_p: Some(p),
                ..Default::default()
            })
            .unwrap();
            let s = Sampler::new(SamplingOptions {
                temperature: 1.0,
                ..o
            })
            .unwrap();
            assert_eq!(kept(&s, &L), want, "top_p {p}");
        }
        for (seed, want) in [(0, 0u64), (42, 42), (u64::MAX as i128, u64::MAX)] {
            let o = apply(SamplingInput {
                seed: Some(seed),
                ..Default::default()
            })
            .unwrap();
            assert_eq!(o.seed, want);
        }
        let random: Vec<u64> = (0..4)
            .map(|_| {
                apply(SamplingInput {
                    seed: Some(-1),
                    ..Default::default()
                })
                .unwrap()
                .seed
            })
            .collect();
        assert!(
            random.windows(2).any(|w| w[0] != w[1]),
            "-1 is a fresh seed: {random:?}"
        );
        // Absent values keep the defaults.
        assert_eq!(apply(SamplingInput::default()).unwrap(), base);
        for (input, field) in [
            (
                SamplingInput {
                    seed: Some(-2),
                    ..Default::default()
                },
                "seed",
            ),
            (
                SamplingInput {
                    seed: Some(u64::MAX as i128 + 1),
                    ..Default::default()
                },
                "seed",
            ),
            (
                SamplingInput {
                    top_p: Some(1.5),
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingInput {
                    top_p: Some(f32::NAN),
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingInput {
                    temperature: Some(-0.5),
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingInput {
                    temperature: Some(f32::INFINITY),
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingInput {
                    min_p: Some(-0.1),
                    ..Default::default()
                },
                "min_p",
            ),
            (
                SamplingInput {
                    repetition_penalty: Some(0.0),
                    ..Default::default()
                },
                "repetition_penalty",
            ),
        ] {
            match apply(input) {
                Err(Error::Sampling { field: f, .. }) => assert_eq!(f, field, "{input:?}"),
                other => panic!("{input:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn bad_options_are_errors() {
        assert!(Sampler::new(opts(|o| o.top_p = 1.5)).is_err());
        assert!(Sampler::new(opts(|o| o.temperature = -1.0)).is_err());
        assert!(Sampler::new(opts(|o| o.repetition_penalty = 0.0)).is_err());
    }
}
