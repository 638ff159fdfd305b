//! The memory planner: how much of a budget the fixed parts of a run take, and how many
//! pool slots the rest buys (../shared/DESIGN.md, "Memory planner"; the reference
//! system's Plan.swift splits its budget the same way, reference-system.md B.3).
//!
//! budget = resident weights + KV cache and recurrent state for the context
//!        + activations and workspaces + read staging + runtime + prompt cache + pool

use serde::Serialize;

use crate::checkpoint::{slot_stride, Checkpoint, ExpertIndex, TensorEntry};
use crate::config::LayerKind;
use crate::error::{Error, Result};
use crate::pool::{floor_slots, DEFAULT_SPECULATIVE_CAP};

/// Bytes the process needs beyond what the plan itemizes: code, allocator, tokenizer,
/// runtime threads. Measured: 16-18 MB peak RSS for a fixture run on the CPU backend.
pub const RUNTIME_BYTES: u64 = 48 << 20;

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
    /// Activations of one prefill chunk with logits for every position, and the
    /// chunk's expert records read outside the pool (a layer's, and the next layer's
    /// read ahead with their read buffers).
    pub workspaces: u64,
    /// Aligned scratch of the reads in flight.
    pub staging: u64,
    pub runtime: u64,
    /// Snapshots of the prompt cache (its memory bound, `prompt_cache`).
    pub prompt_cache: u64,
    /// Bytes of the slot pool (`slots * slot_bytes`).
    pub pool: u64,
    /// What the budget leaves beyond the pool (slots cannot outnumber records).
    pub unused: u64,
    pub slot_bytes: u64,
    pub slots: usize,
    pub floor: usize,
    pub records: usize,
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
        let cfg = &ckpt.config;
        let resident_weights: u64 = resident_tensors(ckpt).map(|(_, held)| held).sum();
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
        let context_state = (context as u64)
            .checked_mul(per_token_kv * attention)
            .and_then(|kv| kv.checked_add(delta * delta_state))
            .ok_or_else(|| {
                Error::InvalidInput(format!("a context of {context} tokens is too large"))
            })?;
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
        let staging = queue_depth as u64 * slot_bytes;
        let runtime = RUNTIME_BYTES;
        let fixed =
            resident_weights + context_state + workspaces + staging + runtime + prompt_cache;
        let left = budget.saturating_sub(fixed);
        let floor = floor_slots(index.num_experts, DEFAULT_SPECULATIVE_CAP);
        let records = index.records();
        let slots = ((left / slot_bytes) as usize).min(records.max(floor));
        let pool = slots as u64 * slot_bytes;
        let unused = left - pool.min(left);
        let plan = Plan {
            budget,
            resident_weights,
            context_state,
            context,
            workspaces,
            staging,
            runtime,
            prompt_cache,
            pool,
            unused,
            slot_bytes,
            slots,
            floor,
            records,
        };
        if slots < floor {
            return Err(Error::Pool(format!(
                "a budget of {} leaves {} for the pool, {} slots of {}, below the floor of {floor} slots ({}); \
                 the smallest budget that runs is {}; the other terms: {}",
                human(budget),
                human(left),
                slots,
                human(slot_bytes),
                human(floor as u64 * slot_bytes),
                human(fixed + floor as u64 * slot_bytes),
                plan.terms()
            )));
        }
        Ok(plan)
    }

    fn terms(&self) -> String {
        format!(
            "resident weights {}, context state for {} tokens {}, workspaces {}, staging {}, runtime {}, prompt cache {}",
            human(self.resident_weights),
            self.context,
            human(self.context_state),
            human(self.workspaces),
            human(self.staging),
            human(self.runtime),
            human(self.prompt_cache)
        )
    }

    /// A table of the terms, for `slotstream plan`.
    pub fn table(&self) -> String {
        let rows = [
            ("resident weights", self.resident_weights),
            ("context state", self.context_state),
            ("workspaces", self.workspaces),
            ("read staging", self.staging),
            ("runtime", self.runtime),
            ("prompt cache", self.prompt_cache),
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

fn scales_of(weight: &str) -> String {
    weight
        .strip_suffix(".weight")
        .map(|m| format!("{m}.scales"))
        .unwrap_or_default()
}

/// Bytes as KiB, MiB or GiB.
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
