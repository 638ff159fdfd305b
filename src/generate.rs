//! The generation loop: prefill the prompt, then sample one token at a time until an
//! end-of-sequence id, the token limit or the context ([`Model::context`]), reporting
//! each token as it is produced.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::backend::Backend;
use crate::constraint::Constraint;
use crate::error::{Error, Result};
use crate::model::{Logits, Model, SequenceState};
use crate::records::ExpertSource;
use crate::sampling::{token_logprobs, Sampler, SamplingOptions, TokenLogprobs};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// At most this many new tokens.
    pub max_tokens: usize,
    pub sampling: SamplingOptions,
    /// Stop when one of these is sampled; it is not emitted.
    pub eos_ids: Vec<u32>,
    /// When set to true (by another thread), generation stops at the next prefill chunk
    /// or token with finish reason "stopped"; the state stays consistent.
    pub cancel: Option<Arc<AtomicBool>>,
    /// When set, the prompt tokens run so far, stored after each prefill chunk, or each
    /// layer of a prefill run layer by layer, as tokens' worth of work
    /// ([`Model::forward_with_progress`]; for a progress display; tokens reused from a
    /// snapshot are not run, so not counted).
    pub prefilled: Option<Arc<AtomicUsize>>,
    /// Draft tokens per decode step from the model's MTP head (0: plain decoding), each
    /// step's drafts verified in one forward pass ([`generate`]). Used on a model whose
    /// head is loaded ([`Model::load_mtp`]) without a constraint or log-probabilities,
    /// else ignored.
    pub draft_tokens: usize,
    /// When set, each token comes with its log-probability and this many of the most
    /// probable tokens' ([`Sampled::logprobs`]).
    pub logprobs: Option<usize>,
    /// When set, every token is sampled among those the grammar allows (a clone of it
    /// follows the run; end of sequence only where the grammar accepts).
    pub constraint: Option<Constraint>,
}

/// A generated token, as `on_token` receives it.
#[derive(Clone, Debug)]
pub struct Sampled {
    pub id: u32,
    /// The log-softmax of the model's logits at this step, before the penalty, the
    /// filters and a grammar's mask, when [`GenerateOptions::logprobs`] asks.
    pub logprobs: Option<TokenLogprobs>,
}

impl GenerateOptions {
    fn cancelled(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::SeqCst))
    }
}

/// Timings and counts of one generation.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Prompt tokens per second of prefill.
    pub prefill_tps: f64,
    /// Generated tokens per second after the first (the first comes from prefill).
    pub decode_tps: f64,
    /// Why generation ended: "eos", "length" or "stopped".
    pub finish_reason: String,
    /// Draft tokens the MTP head proposed ([`GenerateOptions::draft_tokens`]).
    pub drafted: usize,
    /// Drafts that verification accepted (emitted without a decode step of their own).
    pub accepted: usize,
    /// Verify passes: forward passes of a sampled token and its drafts.
    pub verify_passes: usize,
    /// Seconds spent computing a grammar's token masks ([`GenerateOptions::constraint`]),
    /// on the mask's thread or not.
    pub mask_seconds: f64,
    /// Seconds of decode the masks were not hidden behind a forward pass: the first
    /// mask, each step's wait for its mask after the forward pass ended, and following
    /// the chosen tokens (the mask's overhead per token, over `generated_tokens`).
    pub mask_wait_seconds: f64,
    /// Seconds in the MTP head making drafts (part of `decode_seconds`).
    pub draft_seconds: f64,
    /// Seconds in verify passes, the rewind point's copy included (part of
    /// `decode_seconds`).
    pub verify_seconds: f64,
    /// Seconds putting the sequence back after rejections: the rewind and the pass that
    /// runs the accepted prefix again (part of `decode_seconds`).
    pub rewind_seconds: f64,
}

impl GenerateStats {
    /// Accepted drafts over drafted ones (0 without drafts).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// Runs `prompt` after the tokens already in `state` and generates. `on_token` receives
/// each new token and may return `false` to stop early (finish reason "stopped").
///
/// With drafts ([`GenerateOptions::draft_tokens`] `k`, the model's MTP head loaded) each
/// decode step proposes `k` tokens with the head ([`Model::draft`]), each drawn from the
/// head's distribution `q` after the sampler's transforms ([`Sampler::probabilities`]),
/// and runs the sampled token and the drafts through the model in one pass of `k + 1`
/// positions. Each draft in turn is kept or replaced by speculative sampling against the
/// model's distribution `p` at its position ([`Sampler::speculate`]); the walk stops at
/// the first replaced one, whose replacement is the next token, and after `k` kept ones
/// the token after them is drawn from the pass's last `p`. So each token is distributed
/// as plain sampling's; greedy sampling keeps exactly the drafts that greedy decoding
/// picks, so its output is plain greedy decoding's token for token. On a
/// rejection the sequence is put back where the pass began ([`SequenceState::rewind`]:
/// the DeltaNet states copied before the pass, the KV caches cut back) and the accepted
/// prefix is run again, so that the state is what plain decoding leaves (a copy of the
/// DeltaNet states per pass, and a pass of the accepted tokens per rejection). Drafts
/// are not used with a constraint or log-probabilities.
///
/// Generation stops with finish reason "length" after `options.max_tokens` new tokens or
/// when the sequence (the tokens in `state`, the prompt and the new tokens) reaches the
/// model's context ([`Model::context`]). With a constraint, each step's mask is computed
/// on a CPU thread while that step's forward pass runs (the first, after the prefill,
/// before sampling), and joined before sampling. Non-finite logits are left out of sampling, with
/// one warning for the request giving their count ([`Sampler::sample`]).
/// Returns the new ids and the stats.
/// Errors: an empty prompt; a prompt that leaves no room in the context
/// ([`Error::ContextFull`]); a forward-pass error (expert read, bad token id); bad
/// sampling options; a step with no finite logit ([`Error::NoFiniteLogits`]) or none the
/// grammar allows ([`Error::NothingAllowed`]).
pub fn generate<B: Backend, E: ExpertSource>(
    model: &Model<B>,
    backend: &B,
    experts: &E,
    state: &mut SequenceState<B>,
    prompt: &[u32],
    options: &GenerateOptions,
    on_token: impl FnMut(&Sampled) -> Result<bool>,
) -> Result<(Vec<u32>, GenerateStats)> {
    generate_with(
        model,
        backend,
        experts,
        state,
        prompt,
        options,
        no_stops(),
        on_token,
    )
}

/// Where a prefill pauses so that the caller can look at the state (the prompt cache
/// takes its snapshots there): after `at[i]` tokens of the prompt (ascending, each below
/// the prompt's length), `on_stop` is called with the state.
pub struct PrefillStops<'a, F> {
    pub at: &'a [usize],
    pub on_stop: F,
    /// The state was restored from a snapshot: the first forward pass's logits must all
    /// be finite, else the run ends with [`Error::BrokenSnapshot`] before any stop or
    /// token (a snapshot with a NaN in it gives no finite logit from then on).
    pub restored: bool,
}

/// A prefill that runs through: no stops, the state not restored.
fn no_stops<B: Backend>() -> PrefillStops<'static, impl FnMut(&SequenceState<B>) -> Result<()>> {
    PrefillStops {
        at: &[],
        on_stop: |_: &SequenceState<B>| Ok(()),
        restored: false,
    }
}

/// [`generate`], pausing the prefill at `stops`. The prompt runs in pieces of
/// [`Model::prefill_piece`] between stops. Errors: as [`generate`], stops that are not
/// ascending or not inside the prompt, what `on_stop` returns, and
/// [`Error::BrokenSnapshot`] (see [`PrefillStops::restored`]).
#[allow(clippy::too_many_arguments)]
pub fn generate_with<B: Backend, E: ExpertSource>(
    model: &Model<B>,
    backend: &B,
    experts: &E,
    state: &mut SequenceState<B>,
    prompt: &[u32],
    options: &GenerateOptions,
    stops: PrefillStops<'_, impl FnMut(&SequenceState<B>) -> Result<()>>,
    on_token: impl FnMut(&Sampled) -> Result<bool>,
) -> Result<(Vec<u32>, GenerateStats)> {
    run_generation(
        model, backend, experts, state, prompt, options, stops, None, on_token,
    )
}

/// A benchmark's stand-in for the MTP head's proposals, which random weights almost never
/// get right (`slotstream bench --replay`; not a user feature): draft `i` of a run is
/// `tokens[i]` (the `i`-th token a plain greedy run of the same prompt generated) with
/// probability `acceptance`, and another token otherwise, so that greedy verification
/// keeps about that share. The head still runs and its drafts are replaced, so that a
/// step costs what drafting costs.
#[derive(Clone, Debug)]
pub struct Replay {
    /// The plain greedy run's generated ids, in order.
    pub tokens: Vec<u32>,
    /// Probability that a draft is the plain run's token, in [0, 1].
    pub acceptance: f64,
    /// Seed of the draws.
    pub seed: u64,
}

/// [`generate`] with the drafts a [`Replay`] proposes in place of the MTP head's (with
/// greedy sampling, each kept exactly when it is the plain run's token). Errors: as
/// [`generate`], and an acceptance outside [0, 1].
#[allow(clippy::too_many_arguments)]
pub fn generate_replayed<B: Backend, E: ExpertSource>(
    model: &Model<B>,
    backend: &B,
    experts: &E,
    state: &mut SequenceState<B>,
    prompt: &[u32],
    options: &GenerateOptions,
    replay: &Replay,
    on_token: impl FnMut(&Sampled) -> Result<bool>,
) -> Result<(Vec<u32>, GenerateStats)> {
    if !(0.0..=1.0).contains(&replay.acceptance) {
        return Err(Error::InvalidInput(format!(
            "a replay's acceptance {} is not in [0, 1]",
            replay.acceptance
        )));
    }
    let replaying = Replaying {
        replay,
        rng: StdRng::seed_from_u64(replay.seed),
        vocab: model.config.vocab_size as u32,
    };
    run_generation(
        model,
        backend,
        experts,
        state,
        prompt,
        options,
        no_stops(),
        Some(replaying),
        on_token,
    )
}

/// A [`Replay`] being drawn from.
struct Replaying<'a> {
    replay: &'a Replay,
    rng: StdRng,
    vocab: u32,
}

impl Replaying<'_> {
    /// The draft for generated token `at`: the plain run's with probability
    /// `acceptance`, else another id (any other, uniformly).
    fn propose(&mut self, at: usize) -> u32 {
        let right = self.replay.tokens.get(at).copied();
        match right {
            Some(t) if self.rng.random::<f64>() < self.replay.acceptance => t,
            Some(t) => (t + self.rng.random_range(1..self.vocab.max(2))) % self.vocab,
            None => self.rng.random_range(0..self.vocab),
        }
    }
}

/// [`generate_with`], with the drafts `replay` proposes when given.
#[allow(clippy::too_many_arguments)]
fn run_generation<B: Backend, E: ExpertSource>(
    model: &Model<B>,
    backend: &B,
    experts: &E,
    state: &mut SequenceState<B>,
    prompt: &[u32],
    options: &GenerateOptions,
    mut stops: PrefillStops<'_, impl FnMut(&SequenceState<B>) -> Result<()>>,
    mut replay: Option<Replaying<'_>>,
    mut on_token: impl FnMut(&Sampled) -> Result<bool>,
) -> Result<(Vec<u32>, GenerateStats)> {
    let mut sampler = Sampler::new(options.sampling.clone())?;
    if prompt.is_empty() {
        return Err(Error::InvalidInput(
            "the prompt is empty (nothing to continue from)".into(),
        ));
    }
    if stops.at.windows(2).any(|w| w[0] >= w[1]) || stops.at.last() >= Some(&prompt.len()) {
        return Err(Error::Internal(format!(
            "prefill stops {:?} in a prompt of {} tokens",
            stops.at,
            prompt.len()
        )));
    }
    let room = crate::context::room(state.tokens.len() + prompt.len(), model.context())?;
    // Drafts are verified against unmasked distributions, without log-probabilities.
    let drafting = options.draft_tokens > 0
        && options.constraint.is_none()
        && options.logprobs.is_none()
        && model.drafts();
    if drafting {
        model.start_drafting(backend, state)?;
    }
    let max_tokens = options.max_tokens.min(room);
    let restored_tokens = state.tokens.len();
    // The prefill and decode loop, in a closure so that the warning below is logged
    // however it ends.
    let mut run = || -> Result<(Vec<u32>, GenerateStats)> {
        let mut stats = GenerateStats {
            prompt_tokens: prompt.len(),
            finish_reason: "length".into(),
            ..Default::default()
        };
        let mut out = Vec::new();
        if max_tokens == 0 {
            return Ok((out, stats));
        }
        let start = Instant::now();
        // In pieces of the model's choice (`Model::prefill_piece`): chunk by chunk, as the
        // model would, so a cancelled request stops within one chunk, unless the experts
        // stream: then each stretch between stops is one call, which reads each routed
        // record once (layer by layer) and stops at its end when cancelled. (An earlier
        // piece's last-position logits cost one lm_head row; they are dropped.)
        let mut logits = Vec::new();
        let mut done = 0;
        let piece_len = model.prefill_piece(backend, experts);
        for end in stops.at.iter().copied().chain([prompt.len()]) {
            for piece in prompt[done..end].chunks(piece_len) {
                let mut progress = |n| {
                    if let Some(prefilled) = &options.prefilled {
                        prefilled.store(done + n, Ordering::Relaxed);
                    }
                };
                logits = model
                    .forward_with_progress(
                        backend,
                        state,
                        piece,
                        experts,
                        Logits::Last,
                        &mut progress,
                    )
                    // The prefill is over: the source frees what it kept for it.
                    .inspect_err(|_| experts.end_prefill(false))?;
                if done == 0 && stops.restored && !logits.iter().all(|v| v.is_finite()) {
                    experts.end_prefill(false);
                    return Err(Error::BrokenSnapshot {
                        tokens: restored_tokens,
                    });
                }
                done += piece.len();
                if options.cancelled() {
                    experts.end_prefill(false);
                    stats.finish_reason = "stopped".into();
                    stats.prefill_seconds = start.elapsed().as_secs_f64();
                    stats.prefill_tps = rate(done, stats.prefill_seconds);
                    return Ok((out, stats));
                }
            }
            if end < prompt.len() {
                (stops.on_stop)(state).inspect_err(|_| experts.end_prefill(false))?;
            }
        }
        experts.end_prefill(true);
        stats.prefill_seconds = start.elapsed().as_secs_f64();
        let decode_start = Instant::now();
        let mut constraint = options.constraint.clone();
        let first_mask = Instant::now();
        let mut mask = match &mut constraint {
            Some(c) => c.mask()?,
            None => None,
        };
        if constraint.is_some() {
            stats.mask_seconds += first_mask.elapsed().as_secs_f64();
            stats.mask_wait_seconds += first_mask.elapsed().as_secs_f64();
        }
        // A token sampled by a verify pass's walk, not yet emitted.
        let mut carried = None;
        loop {
            let next = match carried.take() {
                Some(t) => t,
                None => sampler.sample_allowed(&logits, &state.tokens, mask.as_ref())?,
            };
            let logprobs = options.logprobs.map(|n| token_logprobs(&logits, next, n));
            if options.eos_ids.contains(&next) {
                stats.finish_reason = "eos".into();
                break;
            }
            out.push(next);
            if let Some(c) = &mut constraint {
                let commit = Instant::now();
                c.commit(next)?;
                stats.mask_wait_seconds += commit.elapsed().as_secs_f64();
            }
            if !on_token(&Sampled { id: next, logprobs })? || options.cancelled() {
                stats.finish_reason = "stopped".into();
                break;
            }
            if out.len() >= max_tokens {
                break;
            }
            // Drafts only where plain decoding would run as many tokens.
            let k = match drafting {
                true => options.draft_tokens.min(max_tokens - 1 - out.len()),
                false => 0,
            };
            if k == 0 {
                let Some(c) = &mut constraint else {
                    logits = model.forward(backend, state, &[next], experts, Logits::Last)?;
                    continue;
                };
                // The next step's mask on another thread while the model computes its logits.
                let (forward, next_mask, masked, waited) = std::thread::scope(|scope| {
                    let masking = scope.spawn(|| {
                        let start = Instant::now();
                        c.mask().map(|m| (m, start.elapsed()))
                    });
                    let forward = model.forward(backend, state, &[next], experts, Logits::Last);
                    let wait = Instant::now();
                    let next_mask = masking.join().unwrap_or_else(|_| {
                        Err(Error::Internal("the mask's thread panicked".into()))
                    });
                    let waited = wait.elapsed();
                    let (next_mask, masked) = match next_mask {
                        Ok((m, t)) => (Ok(m), t),
                        Err(e) => (Err(e), Default::default()),
                    };
                    (forward, next_mask, masked, waited)
                });
                stats.mask_seconds += masked.as_secs_f64();
                stats.mask_wait_seconds += waited.as_secs_f64();
                logits = forward?;
                mask = next_mask?;
                continue;
            }
            // The head's distributions, with the history a draw at each draft's position
            // sees (the penalty's), for speculative sampling.
            let mut history = state.tokens.clone();
            history.push(next);
            let mut q = Vec::with_capacity(k);
            let drafting_start = Instant::now();
            let mut drafts = model.draft(backend, state, next, k, |logits| {
                let probs = sampler.probabilities(logits, &history)?;
                let draft = sampler.draw_from(&probs);
                history.push(draft);
                q.push(probs);
                Ok(draft)
            })?;
            if let Some(replay) = &mut replay {
                for (j, (draft, q)) in drafts.iter_mut().zip(&mut q).enumerate() {
                    *draft = replay.propose(out.len() + j);
                    q.fill(0.0);
                    q[*draft as usize] = 1.0;
                }
            }
            let verify_start = Instant::now();
            stats.draft_seconds += (verify_start - drafting_start).as_secs_f64();
            let point = state.rewind_point(backend)?;
            let base = state.tokens.len();
            let run: Vec<u32> = [next].into_iter().chain(drafts.iter().copied()).collect();
            let rows = model.forward(backend, state, &run, experts, Logits::All)?;
            stats.verify_seconds += verify_start.elapsed().as_secs_f64();
            let vocab = rows.len() / run.len();
            stats.drafted += k;
            stats.verify_passes += 1;
            // Row j holds the logits after run[..=j]; `fed` counts the tokens of `run`
            // that plain decoding would have run by the end of the walk.
            let mut fed = run.len();
            let mut stop = None;
            for (j, &draft) in drafts.iter().enumerate() {
                let row = &rows[j * vocab..(j + 1) * vocab];
                let p = sampler.probabilities(row, &state.tokens[..base + j + 1])?;
                if let Some(t) = sampler.speculate(&p, &q[j], draft) {
                    carried = Some(t);
                    fed = j + 1;
                    break;
                }
                let t = draft;
                stats.accepted += 1;
                if options.eos_ids.contains(&t) {
                    stop = Some("eos");
                } else {
                    out.push(t);
                    if !on_token(&Sampled {
                        id: t,
                        logprobs: None,
                    })? || options.cancelled()
                    {
                        stop = Some("stopped");
                    } else if out.len() >= max_tokens {
                        stop = Some("length");
                    }
                }
                if stop.is_some() {
                    fed = j + 1;
                    break;
                }
            }
            if fed == run.len() {
                logits = rows[k * vocab..].to_vec();
            } else {
                let again = Instant::now();
                state.rewind(backend, &point);
                model.forward(backend, state, &run[..fed], experts, Logits::Last)?;
                stats.rewind_seconds += again.elapsed().as_secs_f64();
            }
            if let Some(reason) = stop {
                stats.finish_reason = reason.into();
                break;
            }
        }
        stats.generated_tokens = out.len();
        stats.decode_seconds = decode_start.elapsed().as_secs_f64();
        stats.prefill_tps = rate(prompt.len(), stats.prefill_seconds);
        stats.decode_tps = rate(out.len().saturating_sub(1), stats.decode_seconds);
        Ok((out, stats))
    };
    let result = run();
    let ignored = sampler.non_finite();
    if ignored.steps > 0 {
        tracing::warn!(
            non_finite_logits = ignored.logits,
            steps = ignored.steps,
            "logits that were NaN or infinite were left out of sampling; the model's weights or the backend may be faulty"
        );
    }
    result
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}
