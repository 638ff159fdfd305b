//! The memory planner: how much of a budget the fixed parts of a run take, and how many
//! pool slots the rest buys (../shared/DESIGN.md, "Memory planner"; the reference
//! system's Plan.swift splits its budget the same way, reference-system.md B.3).
//!
//! budget = resident weights + KV cache and recurrent state for the context
//!        + a prompt's hidden states (streamed plans) + activations and workspaces
//!        + read staging + runtime + prompt cache + pool

use serde::Serialize;

use crate::checkpoint::{slot_stride, Checkpoint, ExpertIndex, TensorEntry};
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::machine::MachineMemory;
use crate::pool::{floor_slots, DEFAULT_SPECULATIVE_CAP};

/// Bytes the process needs beyond what the plan itemizes: code, allocator, tokenizer,
/// runtime threads. Measured: 16-18 MB peak RSS for a fixture run on the CPU backend.
pub const RUNTIME_BYTES: u64 = 48 << 20;

/// The read rate (bytes per second) a prefill estimate assumes before a prompt has been
/// measured ([`Plan::read_bound_prefill_rate`]): a common NVMe SSD's sequential reads.
pub const ASSUMED_READ_BYTES_PER_S: f64 = 2e9;

/// Each term of a plan, in bytes.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub budget: u64,
    /// Non-expert weights as the backends hold them (quantized bytes as stored,
    /// unquantized tensors widened to f32).
    pub resident_weights: u64,
    /// KV cache (f32) of the attention layers and conv + recurrent state of the gated
    /// DeltaNet layers, for `context` tokens.
    pub context_state: u64,
    pub context: usize,
    /// The hidden states of a prompt of `context` tokens prefilled layer by layer (as a
    /// streaming run does, `Model::forward`): [`Footprint::prompt_state_per_token`] per
    /// token.
    pub prompt_states: u64,
    /// Activations of one prefill chunk with logits for every position, and the
    /// chunk's expert records read outside the pool (a layer's, and the next layer's
    /// read ahead with their read buffers).
    pub workspaces: u64,
    /// Aligned scratch of the reads in flight.
    pub staging: u64,
    pub runtime: u64,
    /// Snapshots of the prompt cache (its memory bound, `prompt_cache`).
    pub prompt_cache: u64,
    /// The vision tower once an image loads it ([`Footprint::vision`]; 0 without a tower
    /// or with images off).
    pub vision: u64,
    /// The MTP draft head's weights ([`Footprint::mtp`]; 0 without a head or with drafts
    /// off); its KV cache is in `context_state`.
    pub mtp: u64,
    /// Bytes of the slot pool (`slots * slot_bytes`).
    pub pool: u64,
    /// What the budget leaves beyond the pool (slots cannot outnumber records).
    pub unused: u64,
    pub slot_bytes: u64,
    pub slots: usize,
    pub floor: usize,
    pub records: usize,
}

/// What a checkpoint takes in memory, term by term, before a budget is split: the inputs
/// of [`Plan::with`] and [`AutoPlan::choose`].
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Footprint {
    /// Non-expert weights as the backends hold them ([`Plan::resident_weights`]).
    pub resident_weights: u64,
    /// What the context costs.
    pub context: ContextCost,
    /// Bytes a streamed run holds per prompt token while it prefills layer by layer
    /// (`Model::forward` over every chunk of the call, one layer at a time): each chunk's
    /// residual stream and the next block's normed input between layers, f32,
    /// `2 x residual width x 4`.
    pub prompt_state_per_token: u64,
    /// [`Plan::workspaces`].
    pub workspaces: u64,
    /// [`Plan::staging`].
    pub staging: u64,
    /// Bytes of one slot (a record rounded up to the read alignment).
    pub slot_bytes: u64,
    /// Bytes of every routed record as stored: what a run with all of them resident
    /// (the mapped checkpoint) holds.
    pub record_bytes: u64,
    pub records: usize,
    /// The pool's floor in slots ([`floor_slots`]).
    pub floor: usize,
    /// The vision tower as the CPU holds it once the first image loads it: its weights
    /// (unquantized tensors widened to f32) and the activations of the largest image
    /// ([`vision_bytes`]); 0 without a tower (the engine sets it to 0 with images off).
    pub vision: u64,
    /// The MTP draft head's weights as they are held once it loads ([`mtp_bytes`]); 0
    /// without a head (the engine sets it to 0 when it will not draft).
    pub mtp: u64,
}

/// What a model's context costs in memory: read from its config alone, so the context
/// can be chosen before the weights are opened (`engine::Engine::open`).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ContextCost {
    /// KV cache bytes per token of context (f32 keys and values of every attention layer).
    pub kv_per_token: u64,
    /// Conv and recurrent state of every gated DeltaNet layer (independent of the context).
    pub recurrent_state: u64,
    /// The model's `max_position_embeddings`, when its config gives one.
    pub max_context: Option<usize>,
}

/// The smallest context [`Footprint::auto_context`] picks (unless the model's is shorter).
pub const MIN_AUTO_CONTEXT: usize = 4096;

/// The most of a budget the context's KV cache and states may take when the context is
/// chosen automatically ([`Footprint::auto_context`]), as a fraction.
pub const AUTO_CONTEXT_SHARE: f64 = 0.10;

impl Footprint {
    /// The footprint of `ckpt` with `queue_depth` reads in flight and prefill passes of
    /// `chunk` tokens (see [`Plan::new`]).
    pub fn new(ckpt: &Checkpoint, index: &ExpertIndex, queue_depth: usize, chunk: usize) -> Self {
        let cfg = &ckpt.config;
        let resident_weights: u64 = resident_tensors(ckpt).map(|(_, held)| held).sum();
        // A chunk's widest activations, a few alive at once, plus its logits.
        let width = (2 * cfg.linear_key_dim() + 2 * cfg.linear_value_dim())
            .max(2 * cfg.num_attention_heads * cfg.head_dim)
            + cfg.num_experts_per_tok * cfg.moe_intermediate_size * 3;
        let chunk = chunk as u64;
        let slot_bytes = slot_stride(index.layout.record_bytes) as u64;
        // Plus a prefill chunk's experts read outside the pool: up to a whole layer's,
        // held as records while the next layer's are read ahead into records and through
        // the aligned read buffers.
        let workspaces = chunk * (4 * width as u64 + cfg.vocab_size as u64) * 4
            + 3 * index.num_experts as u64 * slot_bytes;
        Footprint {
            resident_weights,
            context: ContextCost::of(cfg),
            prompt_state_per_token: 2 * cfg.residual_width() as u64 * 4,
            workspaces,
            staging: queue_depth as u64 * slot_bytes,
            slot_bytes,
            record_bytes: index.records() as u64 * index.layout.record_bytes as u64,
            records: index.records(),
            floor: floor_slots(index.num_experts, DEFAULT_SPECULATIVE_CAP),
            vision: vision_bytes(ckpt),
            mtp: mtp_bytes(ckpt),
        }
    }

    /// This footprint for a run whose MTP head drafts (`drafting`: its weights, and its KV
    /// cache, one more full-attention layer of `cfg`'s shape, vLLM's predictor, in the
    /// context's cost) or does not (no head term). A checkpoint without a head has none
    /// either way.
    pub fn drafting(mut self, drafting: bool, cfg: &ModelConfig) -> Self {
        if drafting && self.mtp > 0 {
            self.context.kv_per_token += (2 * cfg.num_key_value_heads * cfg.head_dim * 4) as u64;
        } else {
            self.mtp = 0;
        }
        self
    }

    /// Every term but the pool, for `context` tokens and `prompt_cache` bytes of
    /// snapshots.
    fn fixed(&self, context: usize, prompt_cache: u64) -> Result<u64> {
        Ok(self.resident_weights
            + self.context.context_state(context)?
            + self.workspaces
            + self.staging
            + RUNTIME_BYTES
            + prompt_cache
            + self.vision
            + self.mtp)
    }

    /// Every term of a streamed plan but the pool: [`Footprint::fixed`]'s and the
    /// prompt's hidden states ([`Footprint::prompt_states`]). Errors: a context whose
    /// bytes overflow.
    fn streamed_fixed(&self, context: usize, prompt_cache: u64) -> Result<u64> {
        Ok(self.fixed(context, prompt_cache)? + self.prompt_states(context)?)
    }

    /// [`Plan::prompt_states`] for `context` tokens. Errors: a context whose bytes
    /// overflow.
    pub fn prompt_states(&self, context: usize) -> Result<u64> {
        (context as u64)
            .checked_mul(self.prompt_state_per_token)
            .ok_or_else(|| {
                Error::InvalidInput(format!("a context of {context} tokens is too large"))
            })
    }

    /// Bytes of a run with every record resident (the checkpoint mapped): the plan's
    /// fixed terms plus all the records (no prompt states: it prefills chunk by chunk).
    pub fn resident_need(&self, context: usize, prompt_cache: u64) -> Result<u64> {
        Ok(self.fixed(context, prompt_cache)? + self.record_bytes)
    }
}

impl ContextCost {
    /// The cost of `cfg`'s context.
    pub fn of(cfg: &ModelConfig) -> Self {
        let per_token_kv = (2 * cfg.num_key_value_heads * cfg.head_dim * 4) as u64;
        let delta_state = ((cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim()
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim * cfg.linear_key_head_dim)
            as u64
            * 4;
        let (mut attention, mut delta) = (0u64, 0u64);
        for kind in &cfg.layer_kinds {
            match kind {
                LayerKind::FullAttention => attention += 1,
                LayerKind::LinearAttention => delta += 1,
            }
        }
        ContextCost {
            kv_per_token: per_token_kv * attention,
            recurrent_state: delta * delta_state,
            max_context: cfg.max_position_embeddings,
        }
    }

    /// KV cache and recurrent state for `context` tokens. Errors: a context whose bytes
    /// overflow.
    pub fn context_state(&self, context: usize) -> Result<u64> {
        (context as u64)
            .checked_mul(self.kv_per_token)
            .and_then(|kv| kv.checked_add(self.recurrent_state))
            .ok_or_else(|| {
                Error::InvalidInput(format!("a context of {context} tokens is too large"))
            })
    }

    /// The context sizes an automatic choice picks from, largest first: the powers of two
    /// from [`MIN_AUTO_CONTEXT`] up to the model's `max_position_embeddings` (only
    /// [`MIN_AUTO_CONTEXT`] when the config does not say; the model's own when shorter).
    pub fn context_sizes(&self) -> Vec<usize> {
        let max = self.max_context.unwrap_or(MIN_AUTO_CONTEXT);
        if max <= MIN_AUTO_CONTEXT {
            return vec![max];
        }
        let mut sizes: Vec<usize> = std::iter::successors(Some(MIN_AUTO_CONTEXT), |&c| {
            c.checked_mul(2).filter(|&n| n <= max)
        })
        .collect();
        sizes.reverse();
        sizes
    }

    /// The largest of [`Footprint::context_sizes`] whose KV cache and states take at most
    /// [`AUTO_CONTEXT_SHARE`] of `budget` (the smallest size when none does).
    pub fn auto_context(&self, budget: u64) -> usize {
        let sizes = self.context_sizes();
        let cap = (budget as f64 * AUTO_CONTEXT_SHARE) as u64;
        sizes
            .iter()
            .copied()
            .find(|&c| self.context_state(c).is_ok_and(|s| s <= cap))
            .unwrap_or(sizes[sizes.len() - 1])
    }
}

impl Plan {
    /// Plans `budget` bytes for `ckpt` with room for `context` tokens, `queue_depth`
    /// reads in flight, prefill passes of `chunk` tokens (the backend's
    /// `Model::prefill_chunk`; [`crate::backend::PREFILL_CHUNK`] on the CPU) and `prompt_cache` bytes of
    /// prompt-cache snapshots. Errors: a budget that leaves less than the pool's floor (the
    /// message gives every term).
    pub fn new(
        ckpt: &Checkpoint,
        index: &ExpertIndex,
        budget: u64,
        context: usize,
        queue_depth: usize,
        chunk: usize,
        prompt_cache: u64,
    ) -> Result<Self> {
        Plan::with(
            &Footprint::new(ckpt, index, queue_depth, chunk),
            budget,
            context,
            CacheTerm::Bytes(prompt_cache),
        )
    }

    /// [`Plan::new`] from a checkpoint's [`Footprint`], with the prompt cache's term
    /// `cache` (bytes, or a share of `budget`). Errors: a budget that leaves less than the
    /// pool's floor; the message gives every term and the smallest budget that runs,
    /// rounded up to the precision it is printed at ([`smallest_budget`]).
    pub fn with(fp: &Footprint, budget: u64, context: usize, cache: CacheTerm) -> Result<Self> {
        let plan = Plan::split(fp, budget, context, cache)?;
        if plan.slots < plan.floor {
            let left = plan.pool + plan.unused;
            let advice = match smallest_budget(fp, context, cache) {
                Some(b) => format!("the smallest budget that runs is {b}"),
                None => format!(
                    "no budget runs while the prompt cache takes {:.0}% of it: give it a smaller share or a size",
                    100.0 * cache.share().unwrap_or(1.0)
                ),
            };
            return Err(Error::Pool(format!(
                "a budget of {} leaves {} for the pool, {} slots of {}, below the floor of {} slots ({}); \
                 {advice}; the other terms: {}",
                human(budget),
                human(left),
                plan.slots,
                human(plan.slot_bytes),
                plan.floor,
                human(plan.floor as u64 * plan.slot_bytes),
                plan.terms()
            )));
        }
        Ok(plan)
    }

    /// The terms of `budget` split as [`Plan::with`] splits it, the pool's floor not
    /// checked.
    fn split(fp: &Footprint, budget: u64, context: usize, cache: CacheTerm) -> Result<Self> {
        let prompt_cache = cache.bytes(budget);
        let context_state = fp.context.context_state(context)?;
        let prompt_states = fp.prompt_states(context)?;
        let fixed = fp.streamed_fixed(context, prompt_cache)?;
        let left = budget.saturating_sub(fixed);
        let (slot_bytes, floor, records) = (fp.slot_bytes, fp.floor, fp.records);
        let slots = ((left / slot_bytes) as usize).min(records.max(floor));
        let pool = slots as u64 * slot_bytes;
        let unused = left - pool.min(left);
        let plan = Plan {
            budget,
            resident_weights: fp.resident_weights,
            context_state,
            context,
            prompt_states,
            workspaces: fp.workspaces,
            staging: fp.staging,
            runtime: RUNTIME_BYTES,
            prompt_cache,
            vision: fp.vision,
            mtp: fp.mtp,
            pool,
            unused,
            slot_bytes,
            slots,
            floor,
            records,
        };
        Ok(plan)
    }

    /// Prompt tokens per second a prefill in pieces of `piece` tokens reaches when its
    /// reads bound it, at [`ASSUMED_READ_BYTES_PER_S`]: a piece of 32 tokens or more routes
    /// to nearly every expert of every layer, and a streamed prefill runs each piece (each
    /// stretch between prompt-cache snapshots) layer by layer, so each piece reads the
    /// records that are not in slots once. A `piece` no longer than the real pieces makes
    /// the rate an upper bound (a shorter prompt reads them once too). `None` when every
    /// record is in a slot (the compute then bounds it, which the plan does not know).
    pub fn read_bound_prefill_rate(&self, piece: usize) -> Option<f64> {
        let missing = self.records.saturating_sub(self.slots) as f64 * self.slot_bytes as f64;
        (missing > 0.0).then(|| piece as f64 * ASSUMED_READ_BYTES_PER_S / missing)
    }

    fn terms(&self) -> String {
        format!(
            "resident weights {}, context state for {} tokens {}, prompt states {}, workspaces {}, staging {}, runtime {}, prompt cache {}, vision tower {}, MTP head {}",
            human(self.resident_weights),
            self.context,
            human(self.context_state),
            human(self.prompt_states),
            human(self.workspaces),
            human(self.staging),
            human(self.runtime),
            human(self.prompt_cache),
            human(self.vision),
            human(self.mtp)
        )
    }

    /// A table of the terms, for `slotstream plan`.
    pub fn table(&self) -> String {
        let rows = [
            ("resident weights", self.resident_weights),
            ("context state", self.context_state),
            ("prompt states", self.prompt_states),
            ("workspaces", self.workspaces),
            ("read staging", self.staging),
            ("runtime", self.runtime),
            ("prompt cache", self.prompt_cache),
            ("vision tower", self.vision),
            ("MTP head", self.mtp),
            ("slot pool", self.pool),
            ("unused", self.unused),
        ];
        let mut out = format!("budget {}\n", human(self.budget));
        for (name, bytes) in rows {
            out += &format!("  {name:<17} {:>12}\n", human(bytes));
        }
        out += &format!(
            "slots: {} of {} records ({:.0}%), {} each; floor {}; context {} tokens\n",
            self.slots,
            self.records,
            100.0 * self.slots as f64 / self.records.max(1) as f64,
            human(self.slot_bytes),
            self.floor,
            self.context
        );
        out
    }
}

/// The budget a run is planned within, and which bound set it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Target {
    /// Bytes.
    pub bytes: u64,
    /// What set `bytes`.
    pub why: Bound,
    /// The machine it was read from, when it was.
    pub machine: Option<MachineMemory>,
}

/// What set a [`Target`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Bound {
    /// `--memory-budget`, a fixed target: the experts are streamed through a pool even
    /// when they would all fit.
    Fixed,
    /// This percentage of RAM.
    Ram(u8),
    /// This percentage of the cgroup's `memory.max` (lower than RAM).
    Cgroup(u8),
    /// The memory available now (or what the cgroup's limit leaves).
    Available,
    /// A unified-memory GPU's recommended working set less [`GPU_HEADROOM`].
    GpuWorkingSet,
    /// `--memory-limit`, an adaptive ceiling.
    Limit,
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bound::Fixed => write!(f, "--memory-budget, a fixed target"),
            Bound::Ram(p) => write!(f, "{p}% of RAM"),
            Bound::Cgroup(p) => write!(f, "{p}% of the cgroup's memory.max"),
            Bound::Available => write!(f, "the memory available now"),
            Bound::GpuWorkingSet => write!(f, "the GPU's recommended working set less 2 GiB"),
            Bound::Limit => write!(f, "--memory-limit"),
        }
    }
}

/// What the OS keeps below a unified-memory GPU's recommended working set (the
/// reference system's rule, reference-system.md B.3).
pub const GPU_HEADROOM: u64 = 2 << 30;

/// The share of RAM a plan from the machine takes unless told (`--max-ram-percent`).
pub const DEFAULT_MAX_RAM_PERCENT: u8 = 70;

impl Target {
    /// `--memory-budget`: exactly `bytes`.
    pub fn fixed(bytes: u64) -> Self {
        Target {
            bytes,
            why: Bound::Fixed,
            machine: None,
        }
    }

    /// Whether the target is fixed (the experts always streamed).
    pub fn is_fixed(&self) -> bool {
        self.why == Bound::Fixed
    }

    /// The budget `machine` allows: `max_ram_percent` (1 to 100) of its RAM (of the
    /// cgroup's limit when lower), at most what is available now (and what the cgroup
    /// leaves), at most the GPU's recommended working set less [`GPU_HEADROOM`] where
    /// there is one, and at most `limit` (`--memory-limit`). The least bound wins and
    /// names the reason (the first of equal ones).
    pub fn from_machine(machine: MachineMemory, max_ram_percent: u8, limit: Option<u64>) -> Self {
        let pct = max_ram_percent.clamp(1, 100);
        let share = (machine.ram() as u128 * pct as u128 / 100) as u64;
        let ram = if machine.cgroup_max.is_some_and(|m| m < machine.total) {
            Bound::Cgroup(pct)
        } else {
            Bound::Ram(pct)
        };
        let gpu = machine
            .gpu_working_set
            .map(|ws| (ws.saturating_sub(GPU_HEADROOM), Bound::GpuWorkingSet));
        let limit = limit.map(|l| (l, Bound::Limit));
        let (bytes, why) = [
            Some((share, ram)),
            Some((machine.room(), Bound::Available)),
            gpu,
            limit,
        ]
        .into_iter()
        .flatten()
        .reduce(|a, b| if b.0 < a.0 { b } else { a })
        .unwrap_or((share, ram));
        Target {
            bytes,
            why,
            machine: Some(machine),
        }
    }
}

/// The plan of a run: every record resident (the mapped checkpoint) when the whole model
/// fits a target from the machine, else the experts streamed through a pool that the
/// target sizes.
#[derive(Clone, Debug, Serialize)]
pub struct AutoPlan {
    pub target: Target,
    /// Tokens of context planned for.
    pub context: usize,
    /// Bytes the run would take with every record resident
    /// ([`Footprint::resident_need`]).
    pub resident_need: u64,
    /// The streamed plan; `None` when every record stays resident.
    pub streamed: Option<Plan>,
}

impl AutoPlan {
    /// Plans `fp` within `target` for `context` tokens and the prompt cache's `cache` of
    /// snapshots: every record resident exactly when the target is not fixed and
    /// [`Footprint::resident_need`] fits it, else the streamed [`Plan`]. Errors: a
    /// streamed plan whose pool is below the floor (the message gives every term), a
    /// context too large to count.
    pub fn choose(
        fp: &Footprint,
        target: Target,
        context: usize,
        cache: CacheTerm,
    ) -> Result<Self> {
        let resident_need = fp.resident_need(context, cache.bytes(target.bytes))?;
        let streamed = if !target.is_fixed() && resident_need <= target.bytes {
            None
        } else {
            Some(Plan::with(fp, target.bytes, context, cache)?)
        };
        Ok(AutoPlan {
            target,
            context,
            resident_need,
            streamed,
        })
    }

    /// [`AutoPlan::choose`] for an automatic context: `largest` tokens, or the largest of
    /// [`ContextCost::context_sizes`] below it whose streamed plan keeps the pool at its
    /// floor. Errors: the smallest size's, when none does.
    pub fn choose_context(
        fp: &Footprint,
        target: Target,
        largest: usize,
        cache: CacheTerm,
    ) -> Result<Self> {
        let smaller = fp
            .context
            .context_sizes()
            .into_iter()
            .filter(|&c| c < largest);
        let mut result = AutoPlan::choose(fp, target, largest, cache);
        for c in smaller {
            if result.is_ok() {
                break;
            }
            result = AutoPlan::choose(fp, target, c, cache);
        }
        result
    }

    /// One line: the machine, the budget and why, the context, resident or streamed.
    pub fn describe(&self) -> String {
        let machine = match &self.target.machine {
            Some(m) => {
                let mut s = format!("RAM {}, available {}", human(m.total), human(m.available));
                if let Some(max) = m.cgroup_max {
                    s += &format!(", cgroup memory.max {}", human(max));
                    if let Some(current) = m.cgroup_current {
                        s += &format!(" ({} used)", human(current));
                    }
                }
                if let Some(ws) = m.gpu_working_set {
                    s += &format!(", GPU working set {}", human(ws));
                }
                s + "; "
            }
            None => String::new(),
        };
        let context = format!("context {} tokens", self.context);
        let how = match &self.streamed {
            None => format!(
                "every record resident: the whole model needs {}, within the budget",
                human(self.resident_need)
            ),
            Some(p) => format!(
                "experts streamed through a pool of {} slots ({:.0}% of {} records, {}): the whole model needs {}{}",
                p.slots,
                100.0 * p.slots as f64 / p.records.max(1) as f64,
                p.records,
                human(p.pool),
                human(self.resident_need),
                if self.target.is_fixed() { "; a fixed budget always streams" } else { ", more than the budget" }
            ),
        };
        format!(
            "{machine}budget {} ({}); {context}; {how}",
            human(self.target.bytes),
            self.target.why
        )
    }
}

/// The tensors the backends keep resident (the text model's but the routed experts and
/// Flash-Next's n-gram table, which stay on the SSD: no MTP head, no vision tower), each
/// with the bytes it is held in: as stored, except bf16/f16 tensors without scales, which
/// are widened to f32.
pub(crate) fn resident_tensors(ckpt: &Checkpoint) -> impl Iterator<Item = (&TensorEntry, u64)> {
    ckpt.tensors()
        .filter(|t| {
            ckpt.config.is_text_tensor(&t.name)
                && !t.name.contains(".switch_mlp.")
                && !t.name.contains(".ngram_embedding.")
        })
        .map(|t| {
            let held = match t.dtype {
                safetensors::Dtype::BF16 | safetensors::Dtype::F16
                    if !ckpt.contains(&scales_of(&t.name)) =>
                {
                    t.len * 2
                }
                _ => t.len,
            };
            (t, held)
        })
}

/// [`Footprint::mtp`] of `ckpt`: the head's `mtp.*` tensors (those
/// [`crate::checkpoint::Checkpoint::add_file`] added from a file of their own included) as
/// they are held once it loads: dense ones as [`resident_tensors`] holds the text model's
/// (bf16 and f16 without scales widened to f32), its routed experts as stored (read from
/// the mapped file, so their pages are in memory once drafting has touched them). 0 without
/// a head. Its KV cache, one attention layer's, is a context term
/// ([`Footprint::drafting`]).
pub fn mtp_bytes(ckpt: &Checkpoint) -> u64 {
    let prefix = ckpt.config.name("mtp.");
    ckpt.tensors()
        .filter(|t| t.name.starts_with(&prefix))
        .map(|t| match t.dtype {
            safetensors::Dtype::BF16 | safetensors::Dtype::F16
                if !t.name.contains(".switch_mlp.") && !ckpt.contains(&scales_of(&t.name)) =>
            {
                t.len * 2
            }
            _ => t.len,
        })
        .sum()
}

/// [`Footprint::vision`] of `ckpt`: the tower's tensors as the CPU backend holds them
/// (bf16 and f16 widened to f32, quantized ones as stored), plus the activations of an
/// image at the processor's bound (2,304 tokens, `4 x 2,304` patch rows): about nine
/// rows of the tower's width alive at once (the residual, q, k and v, their per-head
/// copies, the attention's output), one of its MLP's and the patch values, f32. 0 when
/// the config has no `vision_config` or the checkpoint no tower.
pub fn vision_bytes(ckpt: &Checkpoint) -> u64 {
    let Some(v) = &ckpt.config.vision else {
        return 0;
    };
    let weights: u64 = ckpt
        .tensors()
        .filter(|t| ckpt.config.is_vision_tensor(&t.name))
        .map(|t| match t.dtype {
            safetensors::Dtype::BF16 | safetensors::Dtype::F16 => t.len * 2,
            _ => t.len,
        })
        .sum();
    if weights == 0 {
        return 0;
    }
    let rows = (2_304 * v.merge_unit()) as u64;
    let width = (9 * v.hidden_size + v.intermediate_size + v.patch_values()) as u64;
    weights + rows * width * 4
}

fn scales_of(weight: &str) -> String {
    weight
        .strip_suffix(".weight")
        .map(|m| format!("{m}.scales"))
        .unwrap_or_default()
}

/// Bytes as KiB, MiB or GiB.
/// The prompt cache's term of a plan: a size, or a share of the budget (the CLI's
/// `--prompt-cache 10%`, and the default of `chat` and `serve` with a budget).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum CacheTerm {
    Bytes(u64),
    /// A fraction of the budget, from 0 to 1.
    Share(f64),
}

impl CacheTerm {
    /// Its bytes within a budget of `budget` bytes (a share: `floor(share * budget)`).
    pub fn bytes(self, budget: u64) -> u64 {
        match self {
            CacheTerm::Bytes(n) => n,
            CacheTerm::Share(share) => (share * budget as f64) as u64,
        }
    }

    /// The share, for a share.
    pub fn share(self) -> Option<f64> {
        match self {
            CacheTerm::Bytes(_) => None,
            CacheTerm::Share(share) => Some(share),
        }
    }
}

/// The smallest budget that plans `fp` for `context` tokens with its pool at the floor,
/// as [`human`] prints it, rounded up (to 0.01 GiB, 0.1 MiB or 0.1 KiB), so that the
/// figure given back as a budget runs: the fixed terms and the floor's slots, plus the
/// prompt cache's bytes, or, for a share `s` of the budget, divided by `1 - s` (the
/// cache's share is of the budget advised, not of the one refused). `None` when no budget
/// runs (a share of 100%) or the context's state overflows.
pub fn smallest_budget(fp: &Footprint, context: usize, cache: CacheTerm) -> Option<String> {
    let need = fp.streamed_fixed(context, 0).ok()? + fp.floor as u64 * fp.slot_bytes;
    let at_least = match cache {
        CacheTerm::Bytes(n) => need.checked_add(n)?,
        CacheTerm::Share(s) if s < 1.0 => (need as f64 / (1.0 - s)).ceil() as u64,
        CacheTerm::Share(_) => return None,
    };
    // The figure parses back to a few bytes less than it reads (decimal fractions of a
    // binary unit), and a share's bytes are rounded down: the first figure whose parsed
    // budget plans is given (the next one at most, in practice).
    figures_from(at_least).take(64).find(|figure| {
        parse_size(figure).is_ok_and(|budget| {
            Plan::split(fp, budget, context, cache).is_ok_and(|p| p.slots >= p.floor)
        })
    })
}

/// Sizes as [`human`] prints them, from the smallest at or above `bytes` upwards.
fn figures_from(bytes: u64) -> impl Iterator<Item = String> {
    let (unit, name, scale, digits) = if bytes >= 1 << 30 {
        (1u128 << 30, "GiB", 100u128, 2)
    } else if bytes >= 1 << 20 {
        (1 << 20, "MiB", 10, 1)
    } else {
        (1 << 10, "KiB", 10, 1)
    };
    let first = (bytes as u128 * scale).div_ceil(unit);
    (first..).map(move |k| format!("{}.{:0digits$} {name}", k / scale, k % scale))
}

pub fn human(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    }
}

/// Parses sizes such as `8GiB`, `512MiB`, `1.5GB`, `4096` (bytes).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 8GiB, 512MiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        // A bare number is almost always a forgotten unit, not a budget in bytes.
        "" => {
            return Err(format!(
                "`{s}` has no unit (e.g. 8GiB, 512MiB, 4000000000B)"
            ))
        }
        "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1024.0 * 1024.0,
        "mb" => 1e6,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "gb" => 1e9,
        "t" | "tib" => 1024f64.powi(4),
        "tb" => 1e12,
        other => return Err(format!("unknown size unit `{other}` in `{s}`")),
    };
    if n < 0.0 || !n.is_finite() {
        return Err(format!("`{s}` is not a size"));
    }
    Ok((n * mult) as u64)
}

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A model's footprint from its main sizes (bytes), with a context cost of an
    /// attention model (`kv_per_token`) up to `max_context` tokens.
    fn footprint(
        resident_weights: u64,
        slot_bytes: u64,
        records: usize,
        experts: usize,
        kv_per_token: u64,
        max_context: Option<usize>,
    ) -> Footprint {
        Footprint {
            resident_weights,
            context: ContextCost {
                kv_per_token,
                recurrent_state: 3 * kv_per_token,
                max_context,
            },
            prompt_state_per_token: kv_per_token / 4,
            workspaces: 3 * experts as u64 * slot_bytes + (8 << 20),
            staging: 32 * slot_bytes,
            slot_bytes,
            // Records are stored a little smaller than their aligned slots.
            record_bytes: records as u64 * (slot_bytes - 512),
            records,
            floor: floor_slots(experts, DEFAULT_SPECULATIVE_CAP),
            // A tower of an eighth of the other weights: a term like the rest.
            vision: resident_weights / 8,
            // A head of a sixteenth: a term like the rest.
            mtp: resident_weights / 16,
        }
    }

    fn arb_footprint() -> impl Strategy<Value = Footprint> {
        (
            1u64 << 20..8u64 << 30,
            (1u64..2048).prop_map(|kib| kib * 4096),
            1usize..64,
            prop::sample::select(vec![8usize, 32, 64, 128, 256, 512]),
            0u64..(96 << 10),
            prop::option::of(1usize..1 << 20),
        )
            .prop_map(|(weights, slot, layers, experts, kv, max)| {
                footprint(weights, slot, layers * experts, experts, kv, max)
            })
    }

    fn arb_machine() -> impl Strategy<Value = MachineMemory> {
        (
            1u64 << 30..1u64 << 40,
            0.0f64..=1.0,
            prop::option::of(0.05f64..=2.0),
            0.0f64..=1.0,
            prop::option::of(4u64 << 30..256u64 << 30),
        )
            .prop_map(|(total, avail, cgroup, used, gpu)| {
                let cgroup_max = cgroup.map(|c| (total as f64 * c) as u64);
                MachineMemory {
                    total,
                    available: (total as f64 * avail) as u64,
                    cgroup_max,
                    cgroup_current: cgroup_max.map(|m| (m as f64 * used) as u64),
                    gpu_working_set: gpu,
                }
            })
    }

    proptest! {
        /// The machine's target is the least of its bounds, and names it.
        #[test]
        fn the_target_is_the_least_bound(
            machine in arb_machine(),
            percent in 1u8..=100,
            limit in prop::option::of(1u64 << 20..1u64 << 40),
        ) {
            let t = Target::from_machine(machine, percent, limit);
            let share = (machine.ram() as u128 * percent as u128 / 100) as u64;
            let mut bounds = vec![share, machine.room()];
            bounds.extend(machine.gpu_working_set.map(|w| w.saturating_sub(GPU_HEADROOM)));
            bounds.extend(limit);
            prop_assert_eq!(t.bytes, *bounds.iter().min().unwrap());
            prop_assert!(!t.is_fixed());
            let named = match t.why {
                Bound::Ram(p) | Bound::Cgroup(p) => { prop_assert_eq!(p, percent); share }
                Bound::Available => machine.room(),
                Bound::GpuWorkingSet => machine.gpu_working_set.unwrap() - GPU_HEADROOM.min(machine.gpu_working_set.unwrap()),
                Bound::Limit => limit.unwrap(),
                Bound::Fixed => u64::MAX,
            };
            prop_assert_eq!(named, t.bytes);
            // Within a cgroup the share is of its limit, and what it leaves bounds the room.
            if let (Some(max), Some(current)) = (machine.cgroup_max, machine.cgroup_current) {
                prop_assert!(t.bytes <= max.saturating_sub(current));
            }
        }

        /// Every record resident exactly when the whole model fits a target from the
        /// machine; a streamed plan never exceeds its budget and keeps the pool within
        /// its floor and the record count.
        #[test]
        fn the_plan_fits_its_budget(
            fp in arb_footprint(),
            machine in arb_machine(),
            fixed in prop::option::of(1u64 << 20..1u64 << 40),
            prompt_cache in 0u64..(4 << 30),
        ) {
            let target = fixed.map_or(Target::from_machine(machine, 70, None), Target::fixed);
            let context = fp.context.auto_context(target.bytes);
            let need = fp.resident_need(context, prompt_cache).unwrap();
            match AutoPlan::choose(&fp, target, context, CacheTerm::Bytes(prompt_cache)) {
                Ok(plan) => {
                    prop_assert_eq!(plan.resident_need, need);
                    prop_assert_eq!(plan.streamed.is_none(), fixed.is_none() && need <= target.bytes);
                    if let Some(p) = &plan.streamed {
                        let spent = p.resident_weights + p.context_state + p.prompt_states + p.workspaces
                            + p.staging + p.runtime + p.prompt_cache + p.vision + p.mtp + p.pool;
                        prop_assert!(spent <= p.budget, "{} > {}", spent, p.budget);
                        prop_assert_eq!(spent + p.unused, p.budget);
                        prop_assert!(p.slots >= p.floor);
                        prop_assert!(p.slots <= p.records.max(p.floor));
                        prop_assert_eq!(p.context_state, fp.context.context_state(context).unwrap());
                        prop_assert_eq!(p.prompt_states, fp.prompt_states(context).unwrap());
                    }
                }
                Err(e) => {
                    // Only a streamed plan whose pool would be below the floor fails.
                    prop_assert!(fixed.is_some() || need > target.bytes);
                    let fixed_terms =
                        need - fp.record_bytes + fp.prompt_states(context).unwrap();
                    prop_assert!(fixed_terms + fp.floor as u64 * fp.slot_bytes > target.bytes, "{}", e);
                }
            }
        }

        /// A budget refused for its pool advises the smallest that runs, rounded up to the
        /// precision it is printed at; that figure, parsed as a user would type it back,
        /// plans (the context chosen for it again when automatic, the prompt cache's share
        /// of it, not of the budget refused), and it is at most two printed steps above
        /// the exact bound (the fixed terms and the floor, divided by `1 - share`).
        #[test]
        fn the_advised_budget_runs_the_first_time(
            fp in arb_footprint(),
            fraction in 0.0f64..1.0,
            cache in prop_oneof![
                (0u64..(4 << 30)).prop_map(CacheTerm::Bytes),
                (0.0f64..0.9).prop_map(CacheTerm::Share),
            ],
            auto in any::<bool>(),
        ) {
            let smallest = *fp.context.context_sizes().last().unwrap();
            let bound = fp.streamed_fixed(smallest, 0).unwrap() + fp.floor as u64 * fp.slot_bytes;
            let given = ((fraction * bound as f64) as u64).max(1 << 20);
            let plan = |budget: u64| {
                let target = Target::fixed(budget);
                if auto {
                    let context = fp.context.auto_context(budget);
                    AutoPlan::choose_context(&fp, target, context, cache)
                } else {
                    AutoPlan::choose(&fp, target, smallest, cache)
                }
            };
            let message = plan(given).expect_err("below the bound").to_string();
            let advised = message
                .split("the smallest budget that runs is ")
                .nth(1)
                .and_then(|rest| rest.split(';').next())
                .unwrap_or_else(|| panic!("no advice in: {message}"));
            let budget = parse_size(advised).unwrap();
            let accepted = plan(budget);
            prop_assert!(accepted.is_ok(), "{} refused: {}", advised, accepted.unwrap_err());
            let exact = match cache {
                CacheTerm::Bytes(n) => (bound + n) as f64,
                CacheTerm::Share(s) => bound as f64 / (1.0 - s),
            };
            let step = if advised.ends_with("GiB") {
                (1u64 << 30) as f64 / 100.0
            } else if advised.ends_with("MiB") {
                (1u64 << 20) as f64 / 10.0
            } else {
                102.4
            };
            prop_assert!(budget as f64 >= exact - 16.0, "{} below {}", advised, exact);
            prop_assert!((budget as f64) <= exact + 2.0 * step, "{} over {}", advised, exact);
        }

        /// The automatic context is the largest size whose state takes at most a tenth of
        /// the budget (the smallest size when none does).
        #[test]
        fn the_auto_context_is_the_largest_within_a_tenth(
            fp in arb_footprint(),
            budget in 1u64 << 20..1u64 << 40,
        ) {
            let sizes = fp.context.context_sizes();
            let c = fp.context.auto_context(budget);
            prop_assert!(sizes.contains(&c));
            prop_assert!(sizes.windows(2).all(|w| w[0] == 2 * w[1]));
            prop_assert!(sizes.iter().all(|&s| s >= MIN_AUTO_CONTEXT.min(fp.context.max_context.unwrap_or(MIN_AUTO_CONTEXT))));
            prop_assert!(sizes.iter().all(|&s| fp.context.max_context.is_none_or(|m| s <= m)));
            let cap = (budget as f64 * AUTO_CONTEXT_SHARE) as u64;
            let fits = |s: usize| fp.context.context_state(s).unwrap() <= cap;
            prop_assert!(fits(c) || c == *sizes.last().unwrap());
            prop_assert!(sizes.iter().filter(|&&s| s > c).all(|&s| !fits(s)));
        }
    }

    /// A streamed prefill reads, each piece, the records not in slots.
    #[test]
    fn the_read_bound_prefill_rate_counts_the_records_not_held() {
        let fp = footprint(1 << 20, 1 << 20, 100, 10, 1024, None);
        let budget = fp.streamed_fixed(4096, 0).unwrap() + 40 * fp.slot_bytes;
        let plan = Plan::with(&fp, budget, 4096, CacheTerm::Bytes(0)).unwrap();
        assert_eq!(plan.slots, 40);
        let rate = plan.read_bound_prefill_rate(256).unwrap();
        let want = 256.0 * ASSUMED_READ_BYTES_PER_S / (60.0 * (1u64 << 20) as f64);
        assert!((rate - want).abs() < 1e-9 * want, "{rate} {want}");
        let all = Plan::with(&fp, budget + 60 * fp.slot_bytes, 4096, CacheTerm::Bytes(0)).unwrap();
        assert_eq!(all.slots, all.records);
        assert_eq!(all.read_bound_prefill_rate(256), None);
    }

    #[test]
    fn context_sizes_follow_the_model() {
        let cost = |max| ContextCost {
            kv_per_token: 1,
            recurrent_state: 0,
            max_context: max,
        };
        assert_eq!(cost(Some(262144)).context_sizes().len(), 7);
        assert_eq!(cost(Some(262144)).context_sizes()[0], 262144);
        assert_eq!(
            cost(Some(40000)).context_sizes(),
            [32768, 16384, 8192, 4096]
        );
        assert_eq!(cost(Some(2048)).context_sizes(), [2048]);
        assert_eq!(cost(None).context_sizes(), [4096]);
    }

    /// An 80B-like model (48 layers of 512 experts of 1.7 MiB, 12 attention layers of 4 KiB
    /// a token) on a 32 GiB machine streams within 70% of RAM with a 32k context; on 256
    /// GiB every record stays resident.
    #[test]
    fn an_80b_model_streams_on_32_gib_and_fits_256() {
        let fp = footprint(1 << 30, 1_757_184, 48 * 512, 512, 12 * 4096, Some(262144));
        let on = |gib: u64| {
            let machine = MachineMemory {
                total: gib << 30,
                available: gib << 30,
                ..Default::default()
            };
            let target = Target::from_machine(machine, DEFAULT_MAX_RAM_PERCENT, None);
            let context = fp.context.auto_context(target.bytes);
            AutoPlan::choose(&fp, target, context, CacheTerm::Bytes(0)).unwrap()
        };
        let small = on(32);
        assert_eq!(small.target.why, Bound::Ram(70));
        assert_eq!(small.context, 32768);
        let p = small.streamed.as_ref().expect("streamed");
        assert!(p.slots > p.floor && p.slots < p.records, "{}", p.table());
        let big = on(256);
        assert!(big.streamed.is_none(), "{}", big.describe());
        assert!(big.describe().contains("every record resident"));
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_size("1.5 GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3 parsecs").is_err());
        assert!(parse_size("10").is_err());
        assert_eq!(parse_size("4096B").unwrap(), 4096);
    }
}
