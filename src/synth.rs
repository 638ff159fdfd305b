//! Synthetic checkpoints in the exact MLX layout of a Qwen3-Next or Qwen3.5-MoE conversion
//! (tensor names, shapes, dtypes, 4-bit weights with the router and shared-expert gate at 8
//! bits, the config's quantization block, one shard per layer plus one for the embeddings), with
//! deterministic random weights, written as a stream (never held in memory). They let the
//! demo, tests and benchmarks run at real shapes without downloading 45-105 GB.
//!
//! The weights are random: quantized values uniform, scales chosen so each dequantized
//! row has unit-scale dot products, norms 1. Text generated from them is noise; the point
//! is the layout, the sizes and the I/O they cause.
//!
//! A random router routes almost uniformly, so by default a checkpoint also carries a
//! synthetic routing model ([`crate::routing_model`], `synthetic_routing.json`) calibrated
//! to real traces, which picks the routed expert ids instead.

use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::json;

use crate::atomic_file::AtomicFile;
use crate::config::Family;
use crate::error::{Error, Result};
use crate::routing_model::{RoutingParams, ROUTING_FILE};

/// Geometry of a synthetic model.
#[derive(Clone, Copy, Debug)]
pub struct Preset {
    pub name: &'static str,
    /// Layout and config of `qwen3_next` or `qwen3_5_moe`.
    pub family: Family,
    pub hidden: usize,
    pub layers: usize,
    pub vocab: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub linear_key_heads: usize,
    pub linear_value_heads: usize,
    pub linear_head_dim: usize,
    pub experts: usize,
    pub top_k: usize,
    /// Routed and shared expert width.
    pub intermediate: usize,
    pub group_size: usize,
    pub rope_theta: f64,
}

/// The built-in demo: 8 layers of 64 experts, 226 MB of expert records (442 KB each).
pub const DEMO: Preset = Preset {
    name: "demo",
    family: Family::Qwen3Next,
    hidden: 512,
    layers: 8,
    vocab: 512,
    heads: 4,
    kv_heads: 2,
    head_dim: 128,
    linear_key_heads: 4,
    linear_value_heads: 8,
    linear_head_dim: 64,
    experts: 64,
    top_k: 4,
    intermediate: 512,
    group_size: 64,
    rope_theta: 1e7,
};

/// Qwen3-Next-80B-A3B (../shared/spec/models.md §1.1): records of 1,769,472 bytes.
pub const QWEN3_NEXT_80B: Preset = Preset {
    name: "qwen3-next-80b-a3b",
    family: Family::Qwen3Next,
    hidden: 2048,
    layers: 48,
    vocab: 151_936,
    heads: 16,
    kv_heads: 2,
    head_dim: 256,
    linear_key_heads: 16,
    linear_value_heads: 32,
    linear_head_dim: 128,
    experts: 512,
    top_k: 10,
    intermediate: 512,
    group_size: 64,
    rope_theta: 1e7,
};

/// Qwen3.8-Flash-Next's expert shapes (hidden 2560, experts of 640: records of 2,764,800
/// bytes, reference-system.md B.3) in a Qwen3-Next body, for I/O benchmarks until that
/// model family is implemented.
pub const FLASH_NEXT_EXPERTS: Preset = Preset {
    name: "qwen3.8-flash-next",
    family: Family::Qwen3Next,
    hidden: 2560,
    layers: 48,
    vocab: 248_320,
    heads: 24,
    kv_heads: 2,
    head_dim: 256,
    linear_key_heads: 16,
    linear_value_heads: 48,
    linear_head_dim: 128,
    experts: 512,
    top_k: 10,
    intermediate: 640,
    group_size: 64,
    rope_theta: 1e7,
};

/// Qwen3.5-35B-A3B (../shared/spec/models.md §1.2), text model only, in the `qwen3_5_moe`
/// layout: 40 layers of 256 experts (top-8), records of 1,769,472 bytes.
pub const QWEN35_35B: Preset = Preset {
    name: "qwen3.5-35b-a3b",
    family: Family::Qwen35Moe,
    hidden: 2048,
    layers: 40,
    vocab: 248_320,
    heads: 16,
    kv_heads: 2,
    head_dim: 256,
    linear_key_heads: 16,
    linear_value_heads: 32,
    linear_head_dim: 128,
    experts: 256,
    top_k: 8,
    intermediate: 512,
    group_size: 64,
    rope_theta: 1e7,
};

/// The presets by name.
pub const PRESETS: &[Preset] = &[DEMO, QWEN3_NEXT_80B, QWEN35_35B, FLASH_NEXT_EXPERTS];

/// Looks a preset up by name. Errors list the known names.
pub fn preset(name: &str) -> Result<Preset> {
    PRESETS
        .iter()
        .copied()
        .find(|p| p.name == name)
        .ok_or_else(|| {
            let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
            Error::InvalidInput(format!(
                "unknown preset `{name}` (known: {})",
                names.join(", ")
            ))
        })
}

/// What a tensor holds.
#[derive(Clone, Copy, Debug)]
enum Fill {
    /// Packed random `bits`-bit values of a `[.., out, in]` matrix.
    Packed,
    /// bf16 scales for a quantized matrix with `in` inputs: `1 / (in_std * sqrt(in))`.
    Scales { inputs: usize, bits: u32 },
    /// bf16 biases that centre the quantized values: `-scale * (2^bits - 1) / 2`.
    Biases { inputs: usize, bits: u32 },
    /// bf16 constant.
    Const(f32),
    /// bf16 uniform in `[-a, a]`.
    Uniform(f32),
}

struct TensorSpec {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    fill: Fill,
}

impl TensorSpec {
    fn bytes(&self) -> u64 {
        let n: usize = self.shape.iter().product();
        (n * if self.dtype == "U32" { 4 } else { 2 }) as u64
    }
}

fn quantized(
    out: &mut Vec<TensorSpec>,
    module: &str,
    lead: &[usize],
    rows: usize,
    cols: usize,
    bits: u32,
    group: usize,
) {
    let shape = |last: usize| {
        let mut s = lead.to_vec();
        s.extend([rows, last]);
        s
    };
    out.push(TensorSpec {
        name: format!("{module}.weight"),
        dtype: "U32",
        shape: shape(cols * bits as usize / 32),
        fill: Fill::Packed,
    });
    out.push(TensorSpec {
        name: format!("{module}.scales"),
        dtype: "BF16",
        shape: shape(cols / group),
        fill: Fill::Scales { inputs: cols, bits },
    });
    out.push(TensorSpec {
        name: format!("{module}.biases"),
        dtype: "BF16",
        shape: shape(cols / group),
        fill: Fill::Biases { inputs: cols, bits },
    });
}

fn vector(out: &mut Vec<TensorSpec>, name: String, shape: Vec<usize>, fill: Fill) {
    out.push(TensorSpec {
        name,
        dtype: "BF16",
        shape,
        fill,
    });
}

impl Preset {
    fn is_full_attention(&self, layer: usize) -> bool {
        (layer + 1) % 4 == 0
    }

    /// config.json for `layers` layers, as mlx-lm's `save_config` writes it.
    pub fn config(&self, layers: usize) -> serde_json::Value {
        let prefix = self.family.prefix();
        let mut quant = serde_json::Map::new();
        quant.insert("group_size".into(), json!(self.group_size));
        quant.insert("bits".into(), json!(4));
        quant.insert("mode".into(), json!("affine"));
        for l in 0..layers {
            for m in ["mlp.gate", "mlp.shared_expert_gate"] {
                quant.insert(
                    format!("{prefix}model.layers.{l}.{m}"),
                    json!({"group_size": 64, "bits": 8}),
                );
            }
        }
        let mut text = json!({
            "hidden_size": self.hidden, "num_hidden_layers": layers, "vocab_size": self.vocab,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_key_heads, "linear_num_value_heads": self.linear_value_heads,
            "linear_key_head_dim": self.linear_head_dim, "linear_value_head_dim": self.linear_head_dim,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
            "num_experts": self.experts, "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.intermediate, "shared_expert_intermediate_size": self.intermediate,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
            "max_position_embeddings": 262_144,
            "bos_token_id": self.vocab - 3, "eos_token_id": self.vocab - 1,
        });
        let fields = text.as_object_mut().expect("an object");
        match self.family {
            Family::Qwen3Next => {
                for (k, v) in [
                    ("model_type", json!("qwen3_next")),
                    ("architectures", json!(["Qwen3NextForCausalLM"])),
                    ("partial_rotary_factor", json!(0.25)),
                    ("rope_theta", json!(self.rope_theta)),
                    ("rope_scaling", json!(null)),
                    ("intermediate_size", json!(4 * self.hidden)),
                    ("decoder_sparse_step", json!(1)),
                    ("mlp_only_layers", json!([])),
                    ("norm_topk_prob", json!(true)),
                    ("quantization", json!(quant.clone())),
                    ("quantization_config", json!(quant)),
                ] {
                    fields.insert(k.into(), v);
                }
                text
            }
            Family::Qwen35Moe | Family::Qwen4Exp => {
                fields.insert("model_type".into(), json!("qwen3_5_moe_text"));
                fields.insert(
                    "rope_parameters".into(),
                    json!({"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": 0.25,
                           "mrope_section": [11, 11, 10], "mrope_interleaved": true}),
                );
                json!({
                    "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                    "text_config": text, "tie_word_embeddings": false,
                    "quantization": quant.clone(), "quantization_config": quant,
                })
            }
        }
    }

    fn layer_tensors(&self, l: usize) -> Vec<TensorSpec> {
        let (d, g, e, i) = (
            self.hidden,
            self.group_size,
            self.experts,
            self.intermediate,
        );
        let p = format!("{}model.layers.{l}", self.family.prefix());
        let mut t = Vec::new();
        vector(
            &mut t,
            format!("{p}.input_layernorm.weight"),
            vec![d],
            Fill::Const(1.0),
        );
        vector(
            &mut t,
            format!("{p}.post_attention_layernorm.weight"),
            vec![d],
            Fill::Const(1.0),
        );
        if self.is_full_attention(l) {
            let (h, kv, hd) = (self.heads, self.kv_heads, self.head_dim);
            quantized(
                &mut t,
                &format!("{p}.self_attn.q_proj"),
                &[],
                2 * h * hd,
                d,
                4,
                g,
            );
            quantized(
                &mut t,
                &format!("{p}.self_attn.k_proj"),
                &[],
                kv * hd,
                d,
                4,
                g,
            );
            quantized(
                &mut t,
                &format!("{p}.self_attn.v_proj"),
                &[],
                kv * hd,
                d,
                4,
                g,
            );
            quantized(
                &mut t,
                &format!("{p}.self_attn.o_proj"),
                &[],
                d,
                h * hd,
                4,
                g,
            );
            vector(
                &mut t,
                format!("{p}.self_attn.q_norm.weight"),
                vec![hd],
                Fill::Const(1.0),
            );
            vector(
                &mut t,
                format!("{p}.self_attn.k_norm.weight"),
                vec![hd],
                Fill::Const(1.0),
            );
        } else {
            let (nk, nv, hd) = (
                self.linear_key_heads,
                self.linear_value_heads,
                self.linear_head_dim,
            );
            let (kd, vd) = (nk * hd, nv * hd);
            match self.family {
                Family::Qwen3Next => {
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_qkvz"),
                        &[],
                        2 * kd + 2 * vd,
                        d,
                        4,
                        g,
                    );
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_ba"),
                        &[],
                        2 * nv,
                        d,
                        4,
                        g,
                    );
                }
                Family::Qwen35Moe | Family::Qwen4Exp => {
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_qkv"),
                        &[],
                        2 * kd + vd,
                        d,
                        4,
                        g,
                    );
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_z"),
                        &[],
                        vd,
                        d,
                        4,
                        g,
                    );
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_b"),
                        &[],
                        nv,
                        d,
                        4,
                        g,
                    );
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_a"),
                        &[],
                        nv,
                        d,
                        4,
                        g,
                    );
                }
            }
            vector(
                &mut t,
                format!("{p}.linear_attn.conv1d.weight"),
                vec![2 * kd + vd, 4, 1],
                Fill::Uniform(0.5),
            );
            vector(
                &mut t,
                format!("{p}.linear_attn.dt_bias"),
                vec![nv],
                Fill::Const(1.0),
            );
            vector(
                &mut t,
                format!("{p}.linear_attn.A_log"),
                vec![nv],
                Fill::Uniform(1.0),
            );
            vector(
                &mut t,
                format!("{p}.linear_attn.norm.weight"),
                vec![hd],
                Fill::Const(1.0),
            );
            quantized(
                &mut t,
                &format!("{p}.linear_attn.out_proj"),
                &[],
                d,
                vd,
                4,
                g,
            );
        }
        quantized(&mut t, &format!("{p}.mlp.gate"), &[], e, d, 8, 64);
        quantized(
            &mut t,
            &format!("{p}.mlp.shared_expert_gate"),
            &[],
            1,
            d,
            8,
            64,
        );
        for (m, rows, cols) in [("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i)] {
            quantized(
                &mut t,
                &format!("{p}.mlp.shared_expert.{m}"),
                &[],
                rows,
                cols,
                4,
                g,
            );
        }
        for (m, rows, cols) in [("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i)] {
            quantized(
                &mut t,
                &format!("{p}.mlp.switch_mlp.{m}"),
                &[e],
                rows,
                cols,
                4,
                g,
            );
        }
        t
    }

    fn head_tensors(&self) -> Vec<TensorSpec> {
        let p = self.family.prefix();
        let mut t = Vec::new();
        quantized(
            &mut t,
            &format!("{p}model.embed_tokens"),
            &[],
            self.vocab,
            self.hidden,
            4,
            self.group_size,
        );
        quantized(
            &mut t,
            &format!("{p}lm_head"),
            &[],
            self.vocab,
            self.hidden,
            4,
            self.group_size,
        );
        vector(
            &mut t,
            format!("{p}model.norm.weight"),
            vec![self.hidden],
            Fill::Const(1.0),
        );
        t
    }

    /// Bytes of all tensors of a `layers`-layer checkpoint.
    pub fn checkpoint_bytes(&self, layers: usize) -> u64 {
        let mut n: u64 = self.head_tensors().iter().map(TensorSpec::bytes).sum();
        for l in 0..layers {
            n += self
                .layer_tensors(l)
                .iter()
                .map(TensorSpec::bytes)
                .sum::<u64>();
        }
        n
    }
}

/// A safetensors file written tensor by tensor: the header (names, dtypes, shapes and
/// offsets) first, then each tensor's bytes in the declared order.
pub struct SafetensorsWriter<W: Write> {
    out: W,
}

impl<W: Write> SafetensorsWriter<W> {
    /// Writes the header for `tensors` (name, safetensors dtype string, shape, byte length),
    /// with `{"format": "mlx"}` metadata as mlx-lm writes it.
    pub fn new(mut out: W, tensors: &[(String, &str, Vec<usize>, u64)]) -> std::io::Result<Self> {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "mlx"}));
        let mut at = 0u64;
        for (name, dtype, shape, len) in tensors {
            header.insert(
                name.clone(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + len]}),
            );
            at += len;
        }
        let mut text = serde_json::to_vec(&header)?;
        // Pad with spaces so tensor data starts 8-byte aligned, as the format recommends.
        while (8 + text.len()) % 8 != 0 {
            text.push(b' ');
        }
        out.write_all(&(text.len() as u64).to_le_bytes())?;
        out.write_all(&text)?;
        Ok(SafetensorsWriter { out })
    }

    /// Streams `len` bytes of the next tensor from `fill`, called with chunks to fill.
    pub fn tensor(&mut self, len: u64, mut fill: impl FnMut(&mut [u8])) -> std::io::Result<()> {
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

    /// Flushes and returns the writer.
    pub fn finish(mut self) -> std::io::Result<W> {
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

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    /// Uniform in `[-1, 1)`.
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn fill_bf16(buf: &mut [u8], mut value: impl FnMut() -> f32) {
    for ch in buf.chunks_mut(2) {
        let b = half::bf16::from_f32(value()).to_le_bytes();
        ch.copy_from_slice(&b[..ch.len()]);
    }
}

/// Writes a `layers`-layer checkpoint of `preset` into `dir` (created if needed):
/// config.json, `model-0000i-of-0000n.safetensors` (embeddings and head first, then one
/// per layer), `model.safetensors.index.json`, and a byte-level tokenizer built in code
/// (`tokenizer.json`, `tokenizer_config.json` with a ChatML template). Files are written
/// under temporary names and renamed, the index last, so an interrupted run leaves no
/// checkpoint that opens. Shows a progress bar when `progress` is set. The checkpoint
/// carries the preset's calibrated routing model
/// ([`crate::routing_model::RoutingParams::calibrated`]); see [`write_checkpoint_with`].
pub fn write_checkpoint(dir: &Path, preset: &Preset, layers: usize, progress: bool) -> Result<()> {
    write_checkpoint_with(
        dir,
        preset,
        layers,
        progress,
        Some(&RoutingParams::calibrated()),
    )
}

/// [`write_checkpoint`] with a chosen routing model: `Some` writes it as
/// [`ROUTING_FILE`] (the engine then routes by it), `None` removes any such file left by an
/// earlier run, so the checkpoint's random router routes.
pub fn write_checkpoint_with(
    dir: &Path,
    preset: &Preset,
    layers: usize,
    progress: bool,
    routing: Option<&RoutingParams>,
) -> Result<()> {
    let marker = dir.join(".slotstream-synth");
    if let Ok(mut entries) = std::fs::read_dir(dir) {
        if entries.next().is_some() && !marker.exists() {
            return Err(Error::io(
                dir,
                std::io::Error::other(
                    "is not empty and holds no synthetic checkpoint; refusing to write into it",
                ),
            ));
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    std::fs::write(&marker, preset.name).map_err(|e| Error::io(&marker, e))?;
    // Overwriting: drop the old index first, so a checkpoint half-rewritten by an
    // interrupted run does not open.
    // A pack of the old checkpoint would only be refused later (its identity differs):
    // remove it with the index.
    let index_path = dir.join("model.safetensors.index.json");
    for path in [
        index_path.clone(),
        dir.join(crate::pack::PACK_FILE),
        dir.join(crate::pack::MANIFEST_FILE),
    ] {
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&path, e)),
            _ => {}
        }
    }
    let shards = layers + 1;
    let bar = progress.then(|| {
        let bar = indicatif::ProgressBar::new(preset.checkpoint_bytes(layers));
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "writing {msg} {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(preset.name);
        bar
    });
    let mut weight_map = serde_json::Map::new();
    let mut filler = Filler::new(0x5107_5742 ^ layers as u64);
    for shard in 0..shards {
        let tensors = if shard == 0 {
            preset.head_tensors()
        } else {
            preset.layer_tensors(shard - 1)
        };
        let file = format!("model-{:05}-of-{:05}.safetensors", shard + 1, shards);
        let path = dir.join(&file);
        let out = AtomicFile::create(&path)?;
        let header: Vec<_> = tensors
            .iter()
            .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.bytes()))
            .collect();
        let mut w = SafetensorsWriter::new(BufWriter::with_capacity(4 << 20, out.file()), &header)
            .map_err(|e| Error::io(&path, e))?;
        for t in &tensors {
            weight_map.insert(t.name.clone(), json!(file));
            let fill = t.fill;
            w.tensor(t.bytes(), |b| match fill {
                Fill::Packed => filler.fill(b),
                Fill::Scales { inputs, bits } => {
                    // Centred uniform q on [0, 2^bits) has std ~ 2^bits / sqrt(12).
                    let s = 12f32.sqrt() / ((1u32 << bits) as f32 * (inputs as f32).sqrt());
                    fill_bf16(b, || s);
                }
                Fill::Biases { inputs, bits } => {
                    let s = 12f32.sqrt() / ((1u32 << bits) as f32 * (inputs as f32).sqrt());
                    let bias = -s * ((1u32 << bits) - 1) as f32 / 2.0;
                    fill_bf16(b, || bias);
                }
                Fill::Const(v) => fill_bf16(b, || v),
                Fill::Uniform(a) => fill_bf16(b, || a * filler.unit()),
            })
            .map_err(|e| Error::io(&path, e))?;
            if let Some(bar) = &bar {
                bar.inc(t.bytes());
            }
        }
        w.finish().map_err(|e| Error::io(&path, e))?;
        out.commit()?;
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    write_json(dir, "config.json", &preset.config(layers))?;
    write_tokenizer(dir, preset.vocab)?;
    match routing {
        Some(params) => params.write(dir)?,
        None => {
            let path = dir.join(ROUTING_FILE);
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::io(&path, e))
                }
                _ => {}
            }
        }
    }
    // The index last: a checkpoint without it does not open.
    write_json(
        dir,
        "model.safetensors.index.json",
        &json!({"metadata": {}, "weight_map": weight_map}),
    )
}

fn write_json(dir: &Path, name: &str, value: &serde_json::Value) -> Result<()> {
    let path = dir.join(name);
    let out = AtomicFile::create(&path)?;
    serde_json::to_writer_pretty(out.file(), value).map_err(|e| Error::Json {
        path: path.clone(),
        message: e.to_string(),
    })?;
    out.commit()
}

/// A byte-level BPE with no merges: 256 byte tokens, then `<|endoftext|>`,
/// `<|im_start|>` and `<|im_end|>` at the top of the model's vocabulary.
fn write_tokenizer(dir: &Path, vocab: usize) -> Result<()> {
    // GPT-2's byte-to-unicode table, as the ByteLevel pre-tokenizer expects.
    let mut bytes: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars = bytes.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bytes.contains(&b) {
            bytes.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut table: Vec<(u32, u32)> = bytes.into_iter().zip(chars).collect();
    table.sort();
    let mut model_vocab = serde_json::Map::new();
    for (b, c) in &table {
        let ch = char::from_u32(*c).unwrap_or('?').to_string();
        model_vocab.insert(ch, json!(*b));
    }
    let special = |id: usize, s: &str| json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let (eot, start, end) = (vocab - 3, vocab - 2, vocab - 1);
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(eot, "<|endoftext|>"), special(start, "<|im_start|>"), special(end, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": model_vocab, "merges": []},
    });
    write_json(dir, "tokenizer.json", &tokenizer)?;
    write_json(
        dir,
        "tokenizer_config.json",
        &json!({
            "eos_token": "<|im_end|>", "bos_token": null, "pad_token": "<|endoftext|>",
            "chat_template": "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
        }),
    )?;
    write_json(
        dir,
        "generation_config.json",
        &json!({"eos_token_id": [end, eot]}),
    )
}
