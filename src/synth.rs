//! Synthetic checkpoints at real expert shapes, written as a stream (never held in
//! memory), for I/O benchmarks on machines that cannot download the released models.
//!
//! [`write_expert_checkpoint`] writes the routed experts only (the stacked
//! `switch_mlp` tensors of every layer, one shard per layer) with a config.json of the
//! preset: enough for the expert record index, the pack and the slot pool.

use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::json;

use crate::error::{Error, Result};

/// Expert geometry of a released model (4-bit, MLX affine).
#[derive(Clone, Copy, Debug)]
pub struct ExpertPreset {
    pub name: &'static str,
    pub hidden: usize,
    pub intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
    pub layers: usize,
    pub group_size: usize,
}

/// Qwen3-Next-80B-A3B: records of 1,769,472 bytes (../shared/spec/models.md §1.1, §3.6).
pub const QWEN3_NEXT_80B: ExpertPreset = ExpertPreset {
    name: "qwen3-next-80b-a3b",
    hidden: 2048,
    intermediate: 512,
    experts: 512,
    top_k: 10,
    layers: 48,
    group_size: 64,
};

/// Qwen3.8-Flash-Next: records of 2,764,800 bytes (../shared/spec/reference-system.md B.3).
pub const QWEN38_FLASH_NEXT: ExpertPreset = ExpertPreset {
    name: "qwen3.8-flash-next",
    hidden: 2560,
    intermediate: 640,
    experts: 512,
    top_k: 10,
    layers: 48,
    group_size: 64,
};

/// A safetensors file written tensor by tensor: the header (names, dtypes, shapes and
/// offsets) first, then each tensor's bytes in the declared order.
pub struct SafetensorsWriter<W: Write> {
    out: W,
    remaining: Vec<(String, u64)>,
}

impl<W: Write> SafetensorsWriter<W> {
    /// Writes the header for `tensors` (name, safetensors dtype string, shape, byte length).
    pub fn new(mut out: W, tensors: &[(String, &str, Vec<usize>, u64)]) -> std::io::Result<Self> {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "mlx"}));
        let mut at = 0u64;
        for (name, dtype, shape, len) in tensors {
            header.insert(name.clone(), json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + len]}));
            at += len;
        }
        let mut text = serde_json::to_vec(&header)?;
        // Pad with spaces so tensor data starts 8-byte aligned, as the format recommends.
        while (8 + text.len()) % 8 != 0 {
            text.push(b' ');
        }
        out.write_all(&(text.len() as u64).to_le_bytes())?;
        out.write_all(&text)?;
        Ok(SafetensorsWriter {
            out,
            remaining: tensors.iter().rev().map(|(n, _, _, len)| (n.clone(), *len)).collect(),
        })
    }

    /// Streams the next tensor's bytes from `fill`, which is called with chunks to fill.
    pub fn tensor(&mut self, mut fill: impl FnMut(&mut [u8])) -> std::io::Result<()> {
        let (_, len) = self
            .remaining
            .pop()
            .ok_or_else(|| std::io::Error::other("more tensors written than declared"))?;
        let mut buf = vec![0u8; 1 << 20];
        let mut left = len;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            fill(&mut buf[..n]);
            self.out.write_all(&buf[..n])?;
            left -= n as u64;
        }
        Ok(())
    }

    /// Flushes and returns the writer. Errors if a declared tensor was not written.
    pub fn finish(mut self) -> std::io::Result<W> {
        if !self.remaining.is_empty() {
            return Err(std::io::Error::other("fewer tensors written than declared"));
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

/// A fast deterministic byte stream (xorshift64*), for filler weights.
pub struct Filler(u64);

impl Filler {
    pub fn new(seed: u64) -> Self {
        Filler(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let v = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// Writes `layers` MoE layers of `preset`'s routed experts into `dir` (created if
/// needed): config.json, `model-0000i-of-0000n.safetensors` (one per layer) and the
/// index. Scales and biases are finite bf16 values; packed weights are random bits.
pub fn write_expert_checkpoint(dir: &Path, preset: &ExpertPreset, layers: usize) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let (e, d, i, g) = (preset.experts, preset.hidden, preset.intermediate, preset.group_size);
    let config = json!({
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": d, "num_hidden_layers": layers, "vocab_size": 151936,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "partial_rotary_factor": 0.25, "rope_theta": 1e7,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "num_experts": e, "num_experts_per_tok": preset.top_k,
        "moe_intermediate_size": i, "shared_expert_intermediate_size": i,
        "norm_topk_prob": true, "rms_norm_eps": 1e-6, "eos_token_id": 151645,
        "quantization": {"group_size": g, "bits": 4, "mode": "affine"},
    });
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, serde_json::to_vec_pretty(&config).unwrap_or_default())
        .map_err(|err| Error::io(&config_path, err))?;
    let mut weight_map = serde_json::Map::new();
    let mut filler = Filler::new(layers as u64);
    for layer in 0..layers {
        let file = format!("model-{:05}-of-{:05}.safetensors", layer + 1, layers);
        let mut tensors = Vec::new();
        for (proj, rows, cols) in [("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i)] {
            let base = format!("model.layers.{layer}.mlp.switch_mlp.{proj}");
            tensors.push((format!("{base}.weight"), "U32", vec![e, rows, cols / 8], (e * rows * cols / 2) as u64));
            for part in ["scales", "biases"] {
                tensors.push((format!("{base}.{part}"), "BF16", vec![e, rows, cols / g], (e * rows * cols / g * 2) as u64));
            }
        }
        let path = dir.join(&file);
        let handle = std::fs::File::create(&path).map_err(|err| Error::io(&path, err))?;
        let mut w = SafetensorsWriter::new(BufWriter::with_capacity(4 << 20, handle), &tensors)
            .map_err(|err| Error::io(&path, err))?;
        for (name, dtype, _, _) in &tensors {
            weight_map.insert(name.clone(), json!(file));
            if *dtype == "U32" {
                w.tensor(|b| filler.fill(b)).map_err(|err| Error::io(&path, err))?;
            } else {
                // bf16 0.01 (0x3C24) for scales and biases: finite, small.
                w.tensor(|b| b.chunks_mut(2).for_each(|c| c.copy_from_slice(&[0x24, 0x3C][..c.len()])))
                    .map_err(|err| Error::io(&path, err))?;
            }
        }
        let out = w.finish().map_err(|err| Error::io(&path, err))?;
        out.into_inner().map_err(|err| Error::io(&path, err.into_error()))?.sync_all().map_err(|err| Error::io(&path, err))?;
    }
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(&index_path, serde_json::to_vec_pretty(&json!({"metadata": {}, "weight_map": weight_map})).unwrap_or_default())
        .map_err(|err| Error::io(&index_path, err))?;
    Ok(())
}
