//! `slotstream bench`: decode and prefill speed of a model at several pool sizes, each row
//! beside the limit it is measured against, both measured in the same run:
//! - a pool that holds every record (all experts resident, loaded before timing) against
//!   the time to read one token's active bytes at the backend's memory read bandwidth (a
//!   streaming-read kernel on a GPU, a copy on the CPU: [`Backend::read_bandwidth`]);
//! - a streamed pool against the time to read the bytes it read per token at the disk's
//!   raw direct-read bandwidth (plain threads doing `O_DIRECT` `pread`s of random
//!   records, no pool).
//!
//! Each row prefills a prompt of random ids, then decodes greedily (end-of-sequence ids
//! ignored, so every row decodes the same number of tokens). Decode figures cover the
//! tokens after a warm-up (default 32), while the pool fills. With every record resident,
//! prefill is timed after one untimed pass over the prompt, as llama-bench warms up. Each
//! row starts with a new pool and, for Flash-Next, an empty n-gram row cache.
//!
//! With a reuse tail ([`BenchOptions::reuse_tail`]), each row also times the first token
//! of the prompt with prompt reuse ([`crate::prompt_cache`]): cold, repeated, and with its
//! last tokens replaced (a shared prefix), counting the tokens each runs.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::backend::Backend;
use crate::checkpoint::{slot_stride, Checkpoint, ExpertIndex, ALIGN};
use crate::error::{Error, Result};
use crate::experts::{open_source, PoolSize, SourceOptions};
use crate::generate::{generate, generate_replayed, GenerateOptions, Replay, Sampled};
use crate::io::AlignedBuf;
use crate::model::{Logits, Model};
use crate::ngram::{self, NgramCounts};
use crate::pack::PACK_FILE;
use crate::plan::{human, parse_size, peak_rss, resident_tensors, Plan};
use crate::pool::{check_floor, floor_slots, PoolStats, DEFAULT_SPECULATIVE_CAP};
use crate::prompt_cache::{PromptCache, PromptCacheOptions};
use crate::records::ExpertSource;

/// One pool size to measure.
#[derive(Clone, Debug, PartialEq)]
pub enum Budget {
    /// The smallest pool the engine accepts.
    Floor,
    /// Every record resident (loaded before timing).
    All,
    /// This share of the records (0-100).
    Percent(f64),
    /// What a memory budget of this many bytes leaves ([`crate::plan::Plan`]).
    Bytes(u64),
}

impl std::str::FromStr for Budget {
    type Err = String;

    /// `floor`, `all`, `30%` or a size such as `8GiB`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "floor" => Ok(Budget::Floor),
            "all" => Ok(Budget::All),
            p if p.ends_with('%') => match p[..p.len() - 1].trim().parse::<f64>() {
                Ok(v) if v > 0.0 && v <= 100.0 => Ok(Budget::Percent(v)),
                _ => Err(format!(
                    "`{p}`: a share of the records must be in (0, 100]%"
                )),
            },
            size => parse_size(size).map(Budget::Bytes).map_err(|e| {
                format!("{e}; a budget is `floor`, `all`, a share such as `30%`, or a size")
            }),
        }
    }
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Floor => write!(f, "floor"),
            Budget::All => write!(f, "all"),
            Budget::Percent(p) => write!(f, "{p}%"),
            Budget::Bytes(b) => write!(f, "{}", human(*b)),
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub budgets: Vec<Budget>,
    /// Lookahead settings to run each budget with.
    pub lookahead: Vec<bool>,
    /// Prompt length in tokens (random ids).
    pub prompt_len: usize,
    /// Tokens decoded per row, warm-up included.
    pub tokens: usize,
    /// Decoded tokens left out of the decode figures.
    pub warmup: usize,
    /// Everything else about the expert source (I/O mode, queue depth, context,
    /// placement); its `pool` and `lookahead` are set per row.
    pub source: SourceOptions,
    /// Seed of the prompt's ids.
    pub seed: u64,
    /// Also time prompt reuse, with this many tokens at the end of the prompt replaced
    /// for the shared-prefix prompt ([`ReuseRow`]).
    pub reuse_tail: Option<usize>,
    /// Replay acceptances ([`Replay`]): for each, and each of `draft_tokens`, a drafted row
    /// after the plain one, the drafts replaying the plain row's tokens, then a plain row
    /// again. Needs the checkpoint's MTP head (`synth --mtp-head`), which runs for its cost.
    pub replay: Vec<f64>,
    /// Drafts per step of the replay rows (1 to 4).
    pub draft_tokens: Vec<usize>,
    /// Repetitions of the verify-pass timing ([`verify_cost`]) after each budget's first
    /// plain row (0: none).
    pub verify_cost: usize,
}

/// Time to the first token of a prompt (from the request to its first sampled id,
/// snapshot lookup and restore included) with prompt reuse, and the prompt tokens run.
#[derive(Clone, Debug, Serialize)]
pub struct ReuseRow {
    pub prompt_tokens: usize,
    /// Tokens at the end replaced for the shared-prefix prompt.
    pub tail_tokens: usize,
    /// Tokens between snapshots of a long prefill ([`PromptCache::every`]).
    pub every: usize,
    /// The prompt with an empty cache.
    pub cold_seconds: f64,
    /// The same prompt again.
    pub repeat_seconds: f64,
    pub repeat_run: usize,
    /// The shared-prefix prompt with an empty cache.
    pub shared_cold_seconds: f64,
    /// The shared-prefix prompt after the first.
    pub shared_seconds: f64,
    pub shared_run: usize,
}

/// Measures a [`ReuseRow`] for `prompt` and the same with its last `tail` ids redrawn.
fn reuse_row<B: Backend, E: ExpertSource>(
    ckpt: &Checkpoint,
    model: &Model<B>,
    backend: &B,
    experts: &E,
    prompt: &[u32],
    tail: usize,
    rng: &mut impl Rng,
) -> Result<ReuseRow> {
    let tail = tail.clamp(1, prompt.len());
    let mut shared = prompt[..prompt.len() - tail].to_vec();
    shared.extend((0..tail).map(|_| rng.random_range(0..model.config.vocab_size as u32)));
    let options = GenerateOptions {
        max_tokens: 1,
        sampling: Default::default(),
        eos_ids: Vec::new(),
        cancel: None,
        prefilled: None,
        draft_tokens: 0,
        logprobs: None,
        constraint: None,
    };
    let open = || PromptCache::open(ckpt, model, backend, &PromptCacheOptions::default());
    // Seconds to the first token and prompt tokens run.
    let first_token = |cache: &mut PromptCache<B>, prompt: &[u32]| -> Result<(f64, usize)> {
        let start = Instant::now();
        let mut first = 0.0;
        let g = cache.generate(model, backend, experts, prompt, &options, |_| {
            first = start.elapsed().as_secs_f64();
            Ok(true)
        })?;
        Ok((first, g.stats.prompt_tokens))
    };
    let mut cache = open()?;
    let (cold_seconds, _) = first_token(&mut cache, prompt)?;
    let (repeat_seconds, repeat_run) = first_token(&mut cache, prompt)?;
    let (shared_seconds, shared_run) = first_token(&mut cache, &shared)?;
    let (shared_cold_seconds, _) = first_token(&mut open()?, &shared)?;
    Ok(ReuseRow {
        prompt_tokens: prompt.len(),
        tail_tokens: tail,
        every: cache.every(),
        cold_seconds,
        repeat_seconds,
        repeat_run,
        shared_cold_seconds,
        shared_seconds,
        shared_run,
    })
}

/// One measured row. Decode figures cover the tokens after the warm-up.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    pub budget: String,
    pub slots: usize,
    pub pool_bytes: u64,
    pub lookahead: bool,
    pub prefill_tokens: usize,
    pub prefill_tps: f64,
    pub decode_tokens: usize,
    pub decode_tps: f64,
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    pub hit_rate: f64,
    /// Demand plus speculative bytes read while decoding.
    pub bytes_read: u64,
    pub speculative_bytes: u64,
    pub mb_read_per_token: f64,
    /// Share of decode time spent waiting on expert reads.
    pub wait_share: f64,
    pub prefetches_used: u64,
    pub prefetches_wasted: u64,
    /// Seconds spent loading every record before timing (the `all` row).
    pub preload_seconds: f64,
    /// Peak resident memory of the process during the row (Linux; elsewhere since start).
    pub peak_rss: Option<u64>,
    /// `copy` (all resident: active bytes at the copy bandwidth) or `read` (bytes read per
    /// token at the raw disk bandwidth).
    pub limit_kind: &'static str,
    /// Tokens per second the limit allows (`None` when nothing was read).
    pub limit_tps: Option<f64>,
    /// The n-gram table's row lookups and reads while decoding (models with a PLE layer).
    pub ngram: Option<NgramCounts>,
    /// Prompt reuse, when asked for (the first plain row of a budget).
    pub reuse: Option<ReuseRow>,
    /// Drafts per decode step (0: plain decoding).
    pub draft_tokens: usize,
    /// The replay's acceptance ([`Replay`]) of a drafted row.
    pub replay_acceptance: Option<f64>,
    /// Drafts made, drafts accepted, verify passes (the whole decode).
    pub drafted: usize,
    pub accepted: usize,
    pub verify_passes: usize,
    /// Milliseconds per generated token over the whole decode (warm-up included).
    pub step_ms: f64,
    /// A drafted row's milliseconds per verify pass in the MTP head making the drafts, in
    /// the verify pass (the rewind point's copy included), and in rewinds and reruns
    /// after rejections, over the whole decode (warm-up included).
    pub draft_ms: Option<f64>,
    pub verify_ms: Option<f64>,
    pub rewind_ms: Option<f64>,
    /// A drafted row's decode tok/s over the mean of the plain rows just before and after
    /// it (same budget and lookahead).
    pub speedup: Option<f64>,
    /// The cost of verify passes of 2 to 5 positions against plain decode steps
    /// ([`BenchOptions::verify_cost`]; the first plain row of a budget).
    pub verify_cost: Vec<VerifyCost>,
}

/// Verify passes of `positions` positions (the rewind point's copy included) against
/// one-token decode steps, timed alternately from the same state, over the same
/// repetitions ([`verify_cost`]).
#[derive(Clone, Debug, Serialize)]
pub struct VerifyCost {
    pub positions: usize,
    /// Mean milliseconds per verify pass.
    pub verify_ms: f64,
    /// Mean milliseconds per decode step, timed between the verify passes.
    pub step_ms: f64,
    /// `verify_ms / step_ms`: plain steps a verify pass costs.
    pub ratio: f64,
}

/// Times `reps` rounds, each of a decode step and then a verify pass of 2, 3, 4 and 5
/// positions (a step's token and 1 to 4 drafts) alternately, from `state` (put back after
/// each with a rewind), every pass on fresh random ids so that each routes anew. The
/// verify pass takes its rewind point (a copy of the DeltaNet states) and all its logits,
/// as [`crate::generate::generate`]'s does. Errors: a forward pass's.
fn verify_cost<B: Backend, E: ExpertSource>(
    model: &Model<B>,
    backend: &B,
    experts: &E,
    state: &mut crate::model::SequenceState<B>,
    reps: usize,
    rng: &mut impl Rng,
) -> Result<Vec<VerifyCost>> {
    let vocab = model.config.vocab_size as u32;
    let mut seconds = [[0.0f64; 2]; 4];
    for _ in 0..reps {
        for (k, cost) in seconds.iter_mut().enumerate() {
            let point = state.rewind_point(backend)?;
            let start = Instant::now();
            model.forward(
                backend,
                state,
                &[rng.random_range(0..vocab)],
                experts,
                Logits::Last,
            )?;
            cost[0] += start.elapsed().as_secs_f64();
            state.rewind(backend, &point);
            let run: Vec<u32> = (0..k + 2).map(|_| rng.random_range(0..vocab)).collect();
            let start = Instant::now();
            let point = state.rewind_point(backend)?;
            model.forward(backend, state, &run, experts, Logits::All)?;
            cost[1] += start.elapsed().as_secs_f64();
            state.rewind(backend, &point);
        }
    }
    let n = reps.max(1) as f64;
    Ok(seconds
        .iter()
        .enumerate()
        .map(|(k, [step, verify])| VerifyCost {
            positions: k + 2,
            verify_ms: 1e3 * verify / n,
            step_ms: 1e3 * step / n,
            ratio: verify / step.max(f64::MIN_POSITIVE),
        })
        .collect())
}

/// The whole run: what was measured against, and the rows.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub backend: String,
    pub layers: usize,
    pub moe_layers: usize,
    pub experts: usize,
    pub top_k: usize,
    pub records: usize,
    pub record_bytes: usize,
    /// Non-expert weight bytes read per token (as held: bf16 widened to f32, the embedding
    /// table counted as one row) plus top-k records per MoE layer.
    pub active_bytes_per_token: u64,
    /// The backend's large copy, read plus written bytes per second.
    pub copy_bytes_per_second: f64,
    /// What a bandwidth-bound kernel reads per second ([`Backend::read_bandwidth`]): the
    /// limit of rows with every record resident.
    pub memory_read_bytes_per_second: f64,
    /// Raw `O_DIRECT` reads of random records at the run's queue depth.
    pub raw_read_bytes_per_second: f64,
    pub raw_read_source: String,
    pub queue_depth: usize,
    pub rows: Vec<BenchRow>,
    /// The budgets not run, each with why (below the pool's floor).
    pub skipped: Vec<String>,
}

/// Runs every budget x lookahead row on `backend`. `progress` receives a line per step.
/// A budget below the pool's floor is skipped, with why in [`BenchReport::skipped`].
/// Errors: every budget below the floor, an I/O or forward-pass error.
pub fn run<B: Backend>(
    backend: &B,
    ckpt: &Arc<Checkpoint>,
    options: &BenchOptions,
    runtime: &tokio::runtime::Runtime,
    mut progress: impl FnMut(&str),
) -> Result<BenchReport> {
    if options.tokens <= options.warmup {
        return Err(Error::InvalidInput(format!(
            "--tokens {} must exceed the warm-up of {} tokens",
            options.tokens, options.warmup
        )));
    }
    let mut model = Model::load(ckpt, backend)?;
    if !options.replay.is_empty() {
        if !Model::<B>::has_mtp(ckpt) {
            return Err(Error::InvalidInput(format!(
                "--replay drafts with the checkpoint's MTP head, and {} has none \
                 (write one with `slotstream synth --mtp-head`)",
                ckpt.dir.display()
            )));
        }
        if let Some(bad) = options.replay.iter().find(|p| !(0.0..=1.0).contains(*p)) {
            return Err(Error::InvalidInput(format!(
                "--replay {bad}: an acceptance is in [0, 1]"
            )));
        }
        if let Some(bad) = options.draft_tokens.iter().find(|k| !(1..=4).contains(*k)) {
            return Err(Error::InvalidInput(format!(
                "--draft-tokens {bad}: from 1 to 4 drafts per step"
            )));
        }
        model.load_mtp(ckpt, backend)?;
    }
    let model = model;
    let index = Arc::new(model.experts.clone());
    let cfg = &ckpt.config;
    let records = index.records();
    let record_bytes = index.layout.record_bytes;
    progress("measuring the copy bandwidth");
    tracing::info!("bench: model loaded; measuring the copy bandwidth");
    let copy = backend.copy_bandwidth()?;
    let memory = backend.read_bandwidth()?;
    // Measured with the first pool, which knows whether the pack is usable.
    let mut raw: Option<(f64, String)> = None;
    let mut rng = rand::rngs::StdRng::seed_from_u64(options.seed);
    let prompt: Vec<u32> = (0..options.prompt_len)
        .map(|_| rng.random_range(0..cfg.vocab_size as u32))
        .collect();
    let active = active_bytes_per_token(ckpt, &index);
    let tables = model.ngram_tables();
    // Every budget is checked before the first row runs: one below the floor is skipped
    // with a note (on a checkpoint of few layers a small share is), the others run.
    let mut budgets = Vec::new();
    let mut skipped = Vec::new();
    for budget in &options.budgets {
        let below = match pool_size(budget, &index) {
            PoolSize::Slots(n) => check_floor(n, index.num_experts, DEFAULT_SPECULATIVE_CAP)
                .err()
                .map(|e| format!("{e}; try `floor` or a larger share")),
            PoolSize::Budget(bytes) => Plan::new(
                ckpt,
                &index,
                bytes,
                options.source.context,
                options.source.queue_depth,
                crate::backend::prefill_chunk(backend, cfg, false),
                options.source.prompt_cache,
            )
            .err()
            .map(|e| e.to_string()),
            _ => None,
        };
        match below {
            Some(why) => {
                tracing::warn!(%budget, "skipped: {why}");
                skipped.push(format!("budget {budget} skipped: {why}"));
            }
            None => budgets.push(budget),
        }
    }
    if budgets.is_empty() {
        return Err(Error::InvalidInput(format!(
            "no budget can run: {}",
            skipped.join("; ")
        )));
    }
    let mut rows = Vec::new();
    for budget in budgets {
        for &lookahead in &options.lookahead {
            // One row: plain decoding, or drafts from a replay (`draft`: the replay and
            // drafts per step); its generated ids come with it.
            let mut measure = |draft: Option<(&Replay, usize)>,
                               with_reuse: bool|
             -> Result<(BenchRow, Vec<u32>)> {
                let drafts = match draft {
                    Some((replay, k)) => format!(", {k} drafts replayed at {}", replay.acceptance),
                    None => String::new(),
                };
                progress(&format!(
                    "budget {budget}, lookahead {}{drafts}",
                    if lookahead { "on" } else { "off" }
                ));
                tracing::info!(%budget, lookahead, drafts, "bench row");
                let mut source = options.source.clone();
                source.lookahead = lookahead;
                source.pool = Some(pool_size(budget, &index));
                reset_peak_rss();
                let opened = open_source(
                    backend,
                    ckpt,
                    index.clone(),
                    &source,
                    runtime.handle().clone(),
                )
                .map_err(|e| Error::InvalidInput(format!("budget {budget}: {e}")))?;
                let pool = opened
                    .pool
                    .clone()
                    .ok_or_else(|| Error::Pool("bench needs a pool".into()))?;
                if raw.is_none() {
                    progress("measuring raw direct reads");
                    raw = Some(raw_bandwidth(
                        ckpt,
                        &index,
                        pool.packed(),
                        options.source.queue_depth,
                        options.seed,
                    )?);
                }
                let raw_bps = raw.as_ref().map_or(0.0, |r| r.0);
                let mut preload_seconds = 0.0;
                if pool.slots() >= records {
                    let start = Instant::now();
                    for &layer in &index.moe_layers {
                        let all: Vec<u32> = (0..index.num_experts as u32).collect();
                        drop(opened.experts.fetch(layer, &all)?);
                        // Where the backend computes from a copy (a GPU's device arenas), make
                        // it now rather than on the records' first use while decoding.
                        if let Some(held) = opened.experts.resident_layer(layer) {
                            backend.prepare_records(&held.records())?;
                        }
                    }
                    preload_seconds = start.elapsed().as_secs_f64();
                }
                if preload_seconds > 0.0 {
                    tracing::info!(seconds = preload_seconds, "every record loaded");
                    // One untimed pass over the prompt first, as llama-bench warms up, so the
                    // timed prefill leaves out kernel compilation and first allocations. Only
                    // with every record resident: it would change a streaming row's pool.
                    let mut warm = model.new_state(backend);
                    model.forward(backend, &mut warm, &prompt, &opened.experts, Logits::Last)?;
                }
                pool.reset_stats();
                for table in &tables {
                    table.clear_cache()?;
                }
                let generate_options = GenerateOptions {
                    max_tokens: options.tokens,
                    sampling: Default::default(),
                    eos_ids: Vec::new(),
                    cancel: None,
                    prefilled: None,
                    draft_tokens: draft.map_or(0, |(_, k)| k),
                    logprobs: None,
                    constraint: None,
                };
                let mut state = model.new_state(backend);
                let mut at_warmup: Option<(Instant, PoolStats, Option<NgramCounts>)> = None;
                let mut count = 0;
                let on_token = |_: &Sampled| {
                    count += 1;
                    // The first token comes from prefill; decode steps follow it.
                    if count == options.warmup + 1 {
                        at_warmup = Some((Instant::now(), pool.stats(), ngram::total(&tables)));
                    }
                    Ok(true)
                };
                let (ids, stats) = match draft {
                    Some((replay, _)) => generate_replayed(
                        &model,
                        backend,
                        &opened.experts,
                        &mut state,
                        &prompt,
                        &generate_options,
                        replay,
                        on_token,
                    )?,
                    None => generate(
                        &model,
                        backend,
                        &opened.experts,
                        &mut state,
                        &prompt,
                        &generate_options,
                        on_token,
                    )?,
                };
                let end = (Instant::now(), pool.stats(), ngram::total(&tables));
                let (t0, s0, n0) = at_warmup.ok_or_else(|| {
                    Error::InvalidInput("generation ended before the warm-up".into())
                })?;
                let seconds = end.0.duration_since(t0).as_secs_f64();
                let s1 = end.1;
                let decode_tokens = stats.generated_tokens - options.warmup - 1;
                let (hits, misses) = (s1.hits - s0.hits, s1.misses - s0.misses);
                let speculative_bytes = s1.speculative_bytes - s0.speculative_bytes;
                let bytes_read = s1.demand_bytes - s0.demand_bytes + speculative_bytes;
                let per_token = bytes_read as f64 / decode_tokens.max(1) as f64;
                let all = pool.slots() >= records;
                let verify_cost = match options.verify_cost {
                    reps if reps > 0 && with_reuse => {
                        progress("timing verify passes");
                        verify_cost(&model, backend, &opened.experts, &mut state, reps, &mut rng)?
                    }
                    _ => Vec::new(),
                };
                let reuse = match options.reuse_tail.filter(|_| with_reuse) {
                    Some(tail) => {
                        progress("timing prompt reuse");
                        Some(reuse_row(
                            ckpt,
                            &model,
                            backend,
                            &opened.experts,
                            &prompt,
                            tail,
                            &mut rng,
                        )?)
                    }
                    None => None,
                };
                tracing::info!(
                    prefill_tps = stats.prefill_tps,
                    decode_tps = decode_tokens as f64 / seconds,
                    hit_rate = hits as f64 / (hits + misses).max(1) as f64,
                    "bench row done"
                );
                // Whole-decode means (warm-up included) of the drafted steps' parts.
                let passes = stats.verify_passes.max(1) as f64;
                let per_pass = |seconds: f64| draft.map(|_| 1e3 * seconds / passes);
                let row = BenchRow {
                    budget: budget.to_string(),
                    slots: pool.slots(),
                    pool_bytes: (pool.slots() * pool.stride()) as u64,
                    lookahead,
                    prefill_tokens: stats.prompt_tokens,
                    prefill_tps: stats.prefill_tps,
                    decode_tokens,
                    decode_tps: decode_tokens as f64 / seconds,
                    lookups: hits + misses,
                    hits,
                    misses,
                    hit_rate: if hits + misses == 0 {
                        1.0
                    } else {
                        hits as f64 / (hits + misses) as f64
                    },
                    bytes_read,
                    speculative_bytes,
                    mb_read_per_token: per_token / 1e6,
                    wait_share: (s1.decode_wait_seconds - s0.decode_wait_seconds) / seconds,
                    prefetches_used: s1.prefetches_used - s0.prefetches_used,
                    prefetches_wasted: s1.prefetches_wasted - s0.prefetches_wasted,
                    preload_seconds,
                    peak_rss: peak_rss(),
                    limit_kind: if all { "memory" } else { "read" },
                    limit_tps: if all {
                        Some(memory / active as f64)
                    } else if per_token > 0.0 {
                        Some(raw_bps / per_token)
                    } else {
                        None
                    },
                    ngram: end.2.zip(n0).map(|(n1, n0)| n1 - n0),
                    reuse,
                    draft_tokens: draft.map_or(0, |(_, k)| k),
                    replay_acceptance: draft.map(|(r, _)| r.acceptance),
                    drafted: stats.drafted,
                    accepted: stats.accepted,
                    verify_passes: stats.verify_passes,
                    step_ms: 1e3 * stats.decode_seconds
                        / stats.generated_tokens.saturating_sub(1).max(1) as f64,
                    draft_ms: per_pass(stats.draft_seconds),
                    verify_ms: per_pass(stats.verify_seconds),
                    rewind_ms: per_pass(stats.rewind_seconds),
                    speedup: None,
                    verify_cost,
                };
                Ok((row, ids))
            };
            let (plain, tokens) = measure(None, true)?;
            rows.push(plain);
            // Each drafted row between two plain ones, against their mean: the machine's
            // load drifts.
            for &acceptance in &options.replay {
                for &k in &options.draft_tokens {
                    let replay = Replay {
                        tokens: tokens.clone(),
                        acceptance,
                        seed: options.seed,
                    };
                    let (mut drafted, _) = measure(Some((&replay, k)), false)?;
                    let (plain, _) = measure(None, false)?;
                    let before = rows
                        .last()
                        .map_or(plain.decode_tps, |r: &BenchRow| r.decode_tps);
                    drafted.speedup = Some(2.0 * drafted.decode_tps / (before + plain.decode_tps));
                    rows.push(drafted);
                    rows.push(plain);
                }
            }
        }
    }
    let (raw_read_bytes_per_second, raw_read_source) = raw.unwrap_or_default();
    Ok(BenchReport {
        model: ckpt.dir.display().to_string(),
        backend: backend.name(),
        layers: cfg.num_hidden_layers,
        moe_layers: index.moe_layers.len(),
        experts: index.num_experts,
        top_k: cfg.num_experts_per_tok,
        records,
        record_bytes,
        active_bytes_per_token: active,
        copy_bytes_per_second: copy,
        memory_read_bytes_per_second: memory,
        raw_read_bytes_per_second,
        raw_read_source,
        queue_depth: options.source.queue_depth,
        rows,
        skipped,
    })
}

/// The pool a budget asks for.
fn pool_size(budget: &Budget, index: &ExpertIndex) -> PoolSize {
    let records = index.records();
    match budget {
        Budget::Floor => PoolSize::Slots(floor_slots(index.num_experts, DEFAULT_SPECULATIVE_CAP)),
        // At least the floor: with few layers, every record is fewer slots than it.
        Budget::All => {
            PoolSize::Slots(records.max(floor_slots(index.num_experts, DEFAULT_SPECULATIVE_CAP)))
        }
        Budget::Percent(p) => {
            PoolSize::Slots(((records as f64 * p / 100.0).round() as usize).max(1))
        }
        Budget::Bytes(b) => PoolSize::Budget(*b),
    }
}

impl BenchReport {
    /// The rows as a Markdown table, with the limits in a header line.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{} on {}: {} MoE layers x {} experts (top-{}), records of {}; active bytes per token {}; \
             memory reads {:.1} GB/s, copy {:.1} GB/s; raw direct reads {:.2} GB/s (queue depth {}, {})\n\n",
            self.model,
            self.backend,
            self.moe_layers,
            self.experts,
            self.top_k,
            human(self.record_bytes as u64),
            human(self.active_bytes_per_token),
            self.memory_read_bytes_per_second / 1e9,
            self.copy_bytes_per_second / 1e9,
            self.raw_read_bytes_per_second / 1e9,
            self.queue_depth,
            self.raw_read_source
        );
        s += "| budget | slots | lookahead | prefill tok/s | decode tok/s | limit tok/s | of limit | hit rate | MB read/token | wait share | prefetch used/wasted | peak RSS |\n";
        s += "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
        for r in &self.rows {
            let (limit, of) = match r.limit_tps {
                Some(l) => (
                    format!("{l:.1} ({})", r.limit_kind),
                    format!("{:.2}", r.decode_tps / l),
                ),
                None => (format!("- ({})", r.limit_kind), "-".into()),
            };
            let budget = match r.replay_acceptance {
                Some(p) => format!("{} ({} drafts, replay {p})", r.budget, r.draft_tokens),
                None => r.budget.clone(),
            };
            s += &format!(
                "| {} | {} | {} | {:.1} | {:.2} | {} | {} | {:.3} | {:.2} | {:.1}% | {}/{} | {} |\n",
                budget,
                r.slots,
                if r.lookahead { "on" } else { "off" },
                r.prefill_tps,
                r.decode_tps,
                limit,
                of,
                r.hit_rate,
                r.mb_read_per_token,
                100.0 * r.wait_share,
                r.prefetches_used,
                r.prefetches_wasted,
                r.peak_rss.map_or("-".into(), human)
            );
        }
        s += &self.drafted_table();
        s += &self.verify_table();
        if self.rows.iter().any(|r| r.ngram.is_some()) || !self.skipped.is_empty() {
            s += "\n";
        }
        for note in &self.skipped {
            s += &format!("{note}\n");
        }
        for r in &self.rows {
            if let Some(n) = r.ngram {
                let lookups = (n.row_hits + n.row_misses).max(1);
                s += &format!(
                    "n-gram table, budget {} (lookahead {}): {} row lookups while decoding, \
                     hit rate {:.3}, {} rows read ({:.1} KB per token)\n",
                    r.budget,
                    if r.lookahead { "on" } else { "off" },
                    n.row_hits + n.row_misses,
                    n.row_hits as f64 / lookups as f64,
                    n.row_misses,
                    n.bytes_read as f64 / 1e3 / r.decode_tokens.max(1) as f64
                );
            }
        }
        let reuse: Vec<_> = self
            .rows
            .iter()
            .filter_map(|r| Some((r, r.reuse.as_ref()?)))
            .collect();
        if let Some((_, first)) = reuse.first() {
            s += &format!(
                "\nTime to first token of the {}-token prompt with prompt reuse (snapshots every {} tokens); \
                 the shared-prefix prompt replaces its last {} tokens:\n\n",
                first.prompt_tokens, first.every, first.tail_tokens
            );
            s += "| budget | lookahead | cold s | repeated s (tokens run) | shared prefix, cold s | shared prefix s (tokens run) |\n";
            s += "|---|---|---:|---:|---:|---:|\n";
        }
        for (r, u) in reuse {
            s += &format!(
                "| {} | {} | {:.3} | {:.3} ({}) | {:.3} | {:.3} ({}) |\n",
                r.budget,
                if r.lookahead { "on" } else { "off" },
                u.cold_seconds,
                u.repeat_seconds,
                u.repeat_run,
                u.shared_cold_seconds,
                u.shared_seconds,
                u.shared_run
            );
        }
        s
    }
}

impl BenchReport {
    /// The verify-pass costs ([`BenchRow::verify_cost`]) as a Markdown table (empty
    /// without them).
    fn verify_table(&self) -> String {
        let mut s = String::new();
        for r in self.rows.iter().filter(|r| !r.verify_cost.is_empty()) {
            if s.is_empty() {
                s += "\nVerify passes against decode steps, timed alternately from the same state:\n\n";
                s += "| budget | lookahead | positions | verify ms | step ms | steps per pass |\n";
                s += "|---|---|---:|---:|---:|---:|\n";
            }
            for c in &r.verify_cost {
                s += &format!(
                    "| {} | {} | {} | {:.1} | {:.1} | {:.2} |\n",
                    r.budget,
                    if r.lookahead { "on" } else { "off" },
                    c.positions,
                    c.verify_ms,
                    c.step_ms,
                    c.ratio
                );
            }
        }
        s
    }

    /// The drafted rows ([`BenchOptions::replay`]) beside the plain rows around them, as
    /// a Markdown table (empty without drafted rows).
    fn drafted_table(&self) -> String {
        let mut s = String::new();
        for (i, r) in self.rows.iter().enumerate() {
            let (Some(p), Some(speedup)) = (r.replay_acceptance, r.speedup) else {
                continue;
            };
            if s.is_empty() {
                s += "\nDrafted rows (replay drafter), each against the mean of the plain rows before and after it; \
                      ms per verify pass, per pass of the MTP head and per rewind, beside ms per plain step, over the whole decode:\n\n";
                s += "| budget | lookahead | drafts | replay p | accepted | decode tok/s | plain tok/s | speedup | verify ms | head ms | rewind ms | plain step ms |\n";
                s += "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
            }
            let plain: Vec<&BenchRow> = [i.checked_sub(1), Some(i + 1)]
                .into_iter()
                .flatten()
                .filter_map(|j| self.rows.get(j))
                .filter(|p| p.replay_acceptance.is_none())
                .collect();
            let n = plain.len().max(1) as f64;
            let plain_tps = plain.iter().map(|p| p.decode_tps).sum::<f64>() / n;
            let plain_ms = plain.iter().map(|p| p.step_ms).sum::<f64>() / n;
            let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
            s += &format!(
                "| {} | {} | {} | {p} | {:.3} | {:.2} | {:.2} | {:.2}x | {} | {} | {} | {:.1} |\n",
                r.budget,
                if r.lookahead { "on" } else { "off" },
                r.draft_tokens,
                r.accepted as f64 / r.drafted.max(1) as f64,
                r.decode_tps,
                plain_tps,
                speedup,
                ms(r.verify_ms),
                ms(r.draft_ms),
                ms(r.rewind_ms),
                plain_ms
            );
        }
        s
    }
}

/// Non-expert bytes a decode step reads (as the backends hold them: bf16/f16 tensors
/// without scales widened to f32; the embedding table counted as one row), plus the
/// top-k records of every MoE layer.
pub fn active_bytes_per_token(ckpt: &Checkpoint, index: &ExpertIndex) -> u64 {
    let cfg = &ckpt.config;
    let dense: u64 = resident_tensors(ckpt)
        .map(|(t, held)| {
            if t.name.contains("embed_tokens") {
                held / cfg.vocab_size.max(1) as u64
            } else {
                held
            }
        })
        .sum();
    dense + (cfg.num_experts_per_tok * index.moe_layers.len() * index.layout.record_bytes) as u64
}

/// Raw direct-read bandwidth over up to 512 random records (bytes per second), and what
/// was read.
fn raw_bandwidth(
    ckpt: &Checkpoint,
    index: &ExpertIndex,
    packed: bool,
    depth: usize,
    seed: u64,
) -> Result<(f64, String)> {
    let mut keys: Vec<(usize, usize)> = index
        .moe_layers
        .iter()
        .flat_map(|&l| (0..index.num_experts).map(move |e| (l, e)))
        .collect();
    keys.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed));
    keys.truncate(512);
    let mut files: Vec<PathBuf> = ckpt.shards().iter().map(|s| s.path.clone()).collect();
    files.push(ckpt.dir.join(PACK_FILE));
    let ranges: Vec<_> = keys
        .iter()
        .map(|&k| raw_ranges(ckpt, index, k, packed))
        .collect::<Result<Vec<_>>>()?
        .concat();
    if ranges.is_empty() {
        return Err(Error::InvalidInput(
            "the model has no expert records to read".into(),
        ));
    }
    let seconds = raw_read(&files, &ranges, depth)?;
    let bytes = (keys.len() * index.layout.record_bytes) as f64;
    let what = format!(
        "{} records from {}",
        keys.len(),
        if packed { "experts.pack" } else { "the shards" }
    );
    Ok((bytes / seconds, what))
}

/// The byte ranges `(file, offset, len)` a raw reader fetches for record `key` = (layer,
/// expert): the packed record (file index = number of shards, i.e. the pack after the
/// shards), or each piece's range aligned outward to [`ALIGN`].
/// Errors: a record the index lacks.
pub fn raw_ranges(
    ckpt: &Checkpoint,
    index: &ExpertIndex,
    key: (usize, usize),
    packed: bool,
) -> Result<Vec<(usize, u64, usize)>> {
    let a = ALIGN as u64;
    let missing = || Error::InvalidInput(format!("no expert record ({}, {})", key.0, key.1));
    if packed {
        let position = index.moe_position(key.0).ok_or_else(missing)?;
        let stride = slot_stride(index.layout.record_bytes);
        let at = (position * index.num_experts + key.1) * stride;
        return Ok(vec![(ckpt.shards().len(), at as u64, stride)]);
    }
    Ok(index
        .ranges(key.0, key.1)
        .ok_or_else(missing)?
        .iter()
        .map(|r| {
            let start = r.offset / a * a;
            let end = (r.offset + r.len).next_multiple_of(a);
            (r.shard, start, (end - start) as usize)
        })
        .collect())
}

/// Plain threads doing `O_DIRECT` (Linux; `F_NOCACHE` on macOS) `pread`s of `ranges`,
/// `depth` at a time: the baseline the engine's reads are compared with. Returns seconds.
/// Errors: a file that cannot be opened or read.
pub fn raw_read(files: &[PathBuf], ranges: &[(usize, u64, usize)], depth: usize) -> Result<f64> {
    use std::os::unix::fs::FileExt;
    let mut handles = Vec::with_capacity(files.len());
    for p in files {
        let mut o = std::fs::OpenOptions::new();
        o.read(true);
        #[cfg(target_os = "linux")]
        std::os::unix::fs::OpenOptionsExt::custom_flags(&mut o, libc::O_DIRECT);
        // A file that is not used (the pack when reading shards) may be absent.
        let file = o.open(p).or_else(|_| std::fs::File::open(p)).ok();
        #[cfg(target_os = "macos")]
        if let Some(f) = &file {
            // SAFETY: fcntl on an open descriptor; F_NOCACHE only changes caching.
            unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(f), libc::F_NOCACHE, 1) };
        }
        handles.push(file);
    }
    let next = AtomicUsize::new(0);
    let start = Instant::now();
    let failures: Vec<Error> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..depth.max(1))
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    let longest = ranges.iter().map(|r| r.2).max().unwrap_or(ALIGN);
                    let mut buf = AlignedBuf::zeroed(longest)?;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(f, offset, len)) = ranges.get(i) else {
                            return Ok(());
                        };
                        let file = handles[f].as_ref().ok_or_else(|| {
                            Error::io(&files[f], std::io::ErrorKind::NotFound.into())
                        })?;
                        let dst = &mut buf.as_mut_slice()[..len];
                        let mut done = 0;
                        while done < len {
                            match file.read_at(&mut dst[done..], offset + done as u64) {
                                Ok(0) => break,
                                Ok(n) => done += n,
                                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                                Err(e) => return Err(Error::io(&files[f], e)),
                            }
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .filter_map(|w| w.join().ok().and_then(|r| r.err()))
            .collect()
    });
    if let Some(e) = failures.into_iter().next() {
        return Err(e);
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Starts a new peak-RSS window (Linux: writing 5 to `clear_refs` resets `VmHWM`).
fn reset_peak_rss() {
    #[cfg(target_os = "linux")]
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}
