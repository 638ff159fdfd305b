//! Synthetic checkpoints in the exact MLX layout of a Qwen3-Next, Qwen3.5-MoE or
//! Qwen3.8-Flash-Next conversion (tensor names, shapes, dtypes, the quantization each module
//! has in the released conversion, the config's quantization block, one shard per layer plus
//! one for the embeddings), with deterministic random weights, written as a stream (never
//! held in memory). They let the demo, tests and benchmarks run at real shapes without
//! downloading 45-105 GB.
//!
//! The weights are random: quantized values uniform, scales chosen so each dequantized
//! row has unit-scale dot products, norms 1. Text generated from them is noise; the point
//! is the layout, the sizes and the I/O they cause.
//!
//! Qwen3.8-Flash-Next ([`QWEN38_FLASH_NEXT`], `qwen4_exp`) is written as the released MLX
//! 4-bit conversion stores it (../shared/spec/reference-system.md A.1-A.9): 4-stream
//! hyper-connections, split gated-DeltaNet projections, QSA attention with its indexer,
//! the PLE layer at layer 1 with its hashed n-gram table in 128 shards (4 bits, group 32),
//! bf16 routers, inject weights, indexer and a/b projections, norms with the `+1` folded
//! in. The text model only: the vision tower (A.10) and the MTP head (A.11) are left out,
//! as slotstream never reads them.
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
    /// Layout and config of `qwen3_next`, `qwen3_5_moe` or `qwen4_exp`.
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
    /// Qwen3.8-Flash-Next's extra blocks; `Some` exactly when `family` is
    /// [`Family::Qwen4Exp`].
    pub flash_next: Option<FlashNextShape>,
}

/// What a Qwen3.8-Flash-Next (`qwen4_exp`) preset adds to the Qwen3.5 blocks: the
/// hyper-connections (reference-system.md A.3), the QSA indexer (A.5) and the PLE layer
/// with its hashed n-gram table (A.6). Field names follow the config's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashNextShape {
    /// Residual streams (`hc_count`): the hidden state is `hc_count * hidden` wide.
    pub hc_count: usize,
    /// Rank of each hyper-connection's input mixer (`hc_lowrank`).
    pub hc_lowrank: usize,
    /// Query heads of the QSA indexer (`indexer_n_heads`); it has one key head.
    pub indexer_heads: usize,
    /// Width of an indexer query or key head (`indexer_head_dim`).
    pub indexer_head_dim: usize,
    /// Keys a query sees before the indexer selects (`indexer_budget`), in tokens.
    pub indexer_budget: usize,
    /// Tokens per scored block (`indexer_compress_ratio`).
    pub indexer_compress_ratio: usize,
    /// Zero-based index of the PLE layer (`ple_layer_ids` holds it one-based); it must be
    /// a gated-DeltaNet layer. Its width (`ple_embed_dim`) is `hidden`.
    pub ple_layer: usize,
    /// Kernel of the PLE block's dilated conv (`ple_conv_kernel_size`).
    pub ple_conv_kernel: usize,
    /// Largest hashed n-gram (`ngram_size`): orders 2 to this one are hashed.
    pub ngram_size: usize,
    /// Hashed heads per n-gram order (`heads_per_ngram`): `(ngram_size - 1) * this` rows
    /// per token.
    pub heads_per_ngram: usize,
    /// `ngram_vocab_size_base`: head `h` of the table has the `(h+1)`-th prime at or
    /// above it as its row count (about this many rows per head).
    pub ngram_vocab_base: u64,
    /// `make_ngram_vocab_size_divisible_by`: the table's rows are padded to a multiple.
    pub ngram_divisible_by: u64,
    /// Row shards of the table (`split_ngram_parts`).
    pub ngram_shards: usize,
    /// Group size of the table's 4-bit quantization (a per-shard override in the config).
    pub ngram_group_size: usize,
    /// Seed of the hash multipliers (transformers' default `seed`, not in the released
    /// config.json).
    pub seed: u64,
    /// `<|endoftext|>`, the config's BOS and EOS id (the n-gram hash resets after it);
    /// `<|im_start|>` and `<|im_end|>` follow it.
    pub eos: usize,
}

/// The released Qwen3.8-Flash-Next extras (reference-system.md A.1, A.6): 4 streams of
/// rank 320, an indexer of 4 x 128 keeping 2048 tokens in blocks of 4, the PLE layer at
/// layer 1 over a 32 GB table of 16 heads x ~20,000,000 rows in 128 shards.
pub const FLASH_NEXT_SHAPE: FlashNextShape = FlashNextShape {
    hc_count: 4,
    hc_lowrank: 320,
    indexer_heads: 4,
    indexer_head_dim: 128,
    indexer_budget: 2048,
    indexer_compress_ratio: 4,
    ple_layer: 1,
    ple_conv_kernel: 4,
    ngram_size: 3,
    heads_per_ngram: 8,
    ngram_vocab_base: 20_000_000,
    ngram_divisible_by: 128,
    ngram_shards: 128,
    ngram_group_size: 32,
    seed: 1234,
    eos: 248_044,
};

impl FlashNextShape {
    /// Hashed heads per token: `(ngram_size - 1) * heads_per_ngram` (16 released).
    pub fn ngram_heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }
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
    flash_next: None,
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
    flash_next: None,
};

/// Qwen3.8-Flash-Next (`qwen4_exp`, reference-system.md A.1-A.9) as released in MLX 4-bit:
/// 48 layers of 512 experts (top-10), records of 2,764,800 bytes, a 32 GB n-gram table;
/// 102.87 GB of tensors at 48 layers ([`Preset::checkpoint_bytes`]).
pub const QWEN38_FLASH_NEXT: Preset = Preset {
    name: "qwen3.8-flash-next",
    family: Family::Qwen4Exp,
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
    flash_next: Some(FLASH_NEXT_SHAPE),
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
    flash_next: None,
};

/// The presets by name.
pub const PRESETS: &[Preset] = &[DEMO, QWEN3_NEXT_80B, QWEN35_35B, QWEN38_FLASH_NEXT];

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
#[derive(Clone, Debug)]
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
    /// These int64 values, little endian.
    Int64(Vec<i64>),
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
        let size = match self.dtype {
            "I64" => 8,
            "U32" => 4,
            _ => 2,
        };
        (n * size) as u64
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

/// An unquantized bf16 `[rows, cols]` matrix whose rows have unit-scale dot products with
/// unit-scale inputs.
fn dense(out: &mut Vec<TensorSpec>, name: String, rows: usize, cols: usize) {
    vector(
        out,
        name,
        vec![rows, cols],
        Fill::Uniform((3.0 / cols as f32).sqrt()),
    );
}

fn int64(out: &mut Vec<TensorSpec>, name: String, values: Vec<i64>) {
    out.push(TensorSpec {
        name,
        dtype: "I64",
        shape: vec![values.len()],
        fill: Fill::Int64(values),
    });
}

impl Preset {
    fn is_full_attention(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(4)
    }

    /// config.json for `layers` layers, as mlx-lm's `save_config` writes it; for
    /// Qwen3.8-Flash-Next, as the released conversion has it (reference-system.md A.1, A.8:
    /// `text_config` with `layer_types` for the layers kept, the n-gram shards' overrides).
    pub fn config(&self, layers: usize) -> serde_json::Value {
        if let Some(x) = &self.flash_next {
            return self.flash_next_config(x, layers);
        }
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
        if let Some(x) = &self.flash_next {
            return self.flash_next_layer_tensors(x, l);
        }
        let (d, g, e) = (self.hidden, self.group_size, self.experts);
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
        self.expert_mlps(&mut t, &p);
        t
    }

    /// The 4-bit shared expert `mlp.shared_expert.*` and routed experts
    /// `mlp.switch_mlp.*` (`[experts, out, in]`) of layer prefix `p`.
    fn expert_mlps(&self, t: &mut Vec<TensorSpec>, p: &str) {
        let (d, g, e, i) = (
            self.hidden,
            self.group_size,
            self.experts,
            self.intermediate,
        );
        for (m, rows, cols) in [("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i)] {
            quantized(
                t,
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
                t,
                &format!("{p}.mlp.switch_mlp.{m}"),
                &[e],
                rows,
                cols,
                4,
                g,
            );
        }
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
        match &self.flash_next {
            // No final norm: the hyper-connection mixer joins the streams (A.2).
            Some(x) => hyper_connection(
                &mut t,
                &format!("{p}model.hyper_connection_mixer"),
                x,
                self.hidden,
                self.group_size,
                false,
            ),
            None => vector(
                &mut t,
                format!("{p}model.norm.weight"),
                vec![self.hidden],
                Fill::Const(1.0),
            ),
        }
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

    /// The fewest layers a checkpoint of this preset can have: 2 for Qwen3.8-Flash-Next,
    /// whose layer 1 holds the PLE block and the n-gram table (`ple_layer_ids` `[2]`), else 1.
    pub fn min_layers(&self) -> usize {
        self.flash_next.map_or(1, |x| x.ple_layer + 1)
    }

    /// This preset with `rows` n-gram rows per head (`ngram_vocab_size_base`; each head
    /// gets the next primes at or above it) instead of the released 20,000,000: a table of
    /// about `16 * rows` rows of 100 bytes instead of 32 GB, for small disks and tests.
    /// **Departs from the released shape** (reference-system.md A.6); the config's
    /// `ngram_vocab_size_base` says so, and the hashing buffers follow it.
    ///
    /// Errors ([`Error::InvalidInput`]): a preset without an n-gram table, `rows` 0, or
    /// more rows than the preset's own (this only shrinks the table).
    pub fn with_ngram_rows(mut self, rows: u64) -> Result<Preset> {
        let Some(x) = self.flash_next.as_mut() else {
            return Err(Error::InvalidInput(format!(
                "preset `{}` has no n-gram table",
                self.name
            )));
        };
        if rows == 0 || rows > x.ngram_vocab_base {
            return Err(Error::InvalidInput(format!(
                "n-gram rows per head must be between 1 and {} (the preset's own), not {rows}",
                x.ngram_vocab_base
            )));
        }
        x.ngram_vocab_base = rows;
        Ok(self)
    }

    /// The n-gram table's hashing buffers and shard rows; `None` for a preset without one.
    pub fn ngram_geometry(&self) -> Option<NgramGeometry> {
        self.flash_next
            .as_ref()
            .map(|x| NgramGeometry::new(x, self.vocab))
    }

    /// `<|endoftext|>`, `<|im_start|>` and `<|im_end|>`: the released ids for
    /// Qwen3.8-Flash-Next, the top three of the vocabulary for the others.
    fn special_tokens(&self) -> [usize; 3] {
        let first = self.flash_next.map_or(self.vocab - 3, |x| x.eos);
        [first, first + 1, first + 2]
    }

    /// Errors ([`Error::InvalidInput`]) unless a `layers`-layer checkpoint of this preset
    /// can be written and loaded: at least [`Preset::min_layers`] layers, a
    /// [`FlashNextShape`] exactly for `qwen4_exp`, special tokens inside the vocabulary,
    /// and n-gram rows of whole quantization groups.
    pub fn check(&self, layers: usize) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidInput(format!("preset `{}`: {m}", self.name)));
        if layers < self.min_layers() {
            return bad(format!(
                "needs at least {} layers (layer 1 holds the PLE block and its n-gram table), not {layers}",
                self.min_layers()
            ));
        }
        if (self.family == Family::Qwen4Exp) != self.flash_next.is_some() {
            return bad("a Flash-Next shape goes with the qwen4_exp family and no other".into());
        }
        if self.vocab < 3 || self.special_tokens()[2] >= self.vocab {
            return bad(format!(
                "special tokens {:?} do not fit a vocabulary of {}",
                self.special_tokens(),
                self.vocab
            ));
        }
        if let Some(x) = &self.flash_next {
            let heads = x.ngram_heads();
            if heads == 0
                || !self.hidden.is_multiple_of(heads)
                || x.ngram_group_size == 0
                || !(self.hidden / heads).is_multiple_of(x.ngram_group_size)
                || x.ngram_shards == 0
                || x.ngram_divisible_by == 0
                || x.ngram_vocab_base == 0
                || self.is_full_attention(x.ple_layer)
            {
                return bad(format!("unusable n-gram or PLE geometry {x:?}"));
            }
        }
        Ok(())
    }

    /// config.json of a Qwen3.8-Flash-Next checkpoint of `layers` layers, as the released
    /// conversion has it (reference-system.md A.1, A.8): the text model under
    /// `text_config`, with `layer_types` for the layers kept and no `seed` (transformers'
    /// default 1234 gives the stored multipliers), and a quantization block of 4 bits,
    /// group 64, with a group-`ngram_group_size` override per n-gram shard and no other
    /// (the unquantized modules have no `.scales`), keyed as the release keys them:
    /// `model.layers.1.ple.ple_embedding.ngram_embedding.shard_N`, without the
    /// `language_model.` prefix its tensor names carry. The vision tower is left out, so
    /// there is no `vision_config` and `language_model_only` is true.
    fn flash_next_config(&self, x: &FlashNextShape, layers: usize) -> serde_json::Value {
        let mut quant = serde_json::Map::new();
        quant.insert("group_size".into(), json!(self.group_size));
        quant.insert("bits".into(), json!(4));
        quant.insert("mode".into(), json!("affine"));
        for s in 0..x.ngram_shards {
            quant.insert(
                format!(
                    "model.layers.{}.ple.ple_embedding.ngram_embedding.shard_{s}",
                    x.ple_layer
                ),
                json!({"group_size": x.ngram_group_size, "bits": 4}),
            );
        }
        let layer_types: Vec<&str> = (0..layers)
            .map(|l| {
                if self.is_full_attention(l) {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect();
        // M-RoPE sections over the 64 rotary dims' 32 frequencies: [11, 11, 10] (text
        // positions use them all alike).
        let half = self.head_dim / 8;
        let section = (half * 11).div_ceil(32);
        // The release writes the base as an integer.
        let theta = self.rope_theta as u64;
        let mut text = serde_json::Map::new();
        for (k, v) in [
            ("model_type", json!("qwen4_exp_text")),
            ("attention_bias", json!(false)),
            ("attention_dropout", json!(0.0)),
            ("bos_token_id", json!(x.eos)),
            ("eos_token_id", json!(x.eos)),
            ("pad_token_id", json!(null)),
            ("dtype", json!("bfloat16")),
            ("hidden_act", json!("silu")),
            ("hidden_size", json!(self.hidden)),
            ("initializer_range", json!(0.02)),
            ("num_hidden_layers", json!(layers)),
            ("layer_types", json!(layer_types)),
            ("full_attention_interval", json!(4)),
            ("vocab_size", json!(self.vocab)),
            ("max_position_embeddings", json!(262_144)),
            ("rms_norm_eps", json!(1e-6)),
            ("tie_word_embeddings", json!(false)),
            ("use_cache", json!(true)),
            ("num_attention_heads", json!(self.heads)),
            ("num_key_value_heads", json!(self.kv_heads)),
            ("head_dim", json!(self.head_dim)),
            (
                "rope_parameters",
                json!({"rope_type": "default", "rope_theta": theta,
                       "partial_rotary_factor": 0.25, "mrope_interleaved": true,
                       "mrope_section": [section, section, half - 2 * section]}),
            ),
            ("linear_num_key_heads", json!(self.linear_key_heads)),
            ("linear_num_value_heads", json!(self.linear_value_heads)),
            ("linear_key_head_dim", json!(self.linear_head_dim)),
            ("linear_value_head_dim", json!(self.linear_head_dim)),
            ("linear_conv_kernel_dim", json!(4)),
            ("mamba_ssm_dtype", json!("float32")),
            ("output_gate_type", json!("sigmoid")),
            ("num_experts", json!(self.experts)),
            ("num_experts_per_tok", json!(self.top_k)),
            ("moe_intermediate_size", json!(self.intermediate)),
            ("shared_expert_intermediate_size", json!(self.intermediate)),
            ("router_aux_loss_coef", json!(0.001)),
            ("output_router_logits", json!(false)),
            ("hc_count", json!(x.hc_count)),
            ("hc_lowrank", json!(x.hc_lowrank)),
            ("indexer_n_heads", json!(x.indexer_heads)),
            ("indexer_kv_heads", json!(1)),
            ("indexer_head_dim", json!(x.indexer_head_dim)),
            ("indexer_budget", json!(x.indexer_budget)),
            ("indexer_compress_ratio", json!(x.indexer_compress_ratio)),
            ("ple_layer_ids", json!([x.ple_layer + 1])),
            ("ple_embed_dim", json!(self.hidden)),
            ("ple_conv_kernel_size", json!(x.ple_conv_kernel)),
            ("ngram_size", json!(x.ngram_size)),
            ("heads_per_ngram", json!(x.heads_per_ngram)),
            ("ngram_vocab_size_base", json!(x.ngram_vocab_base)),
            (
                "make_ngram_vocab_size_divisible_by",
                json!(x.ngram_divisible_by),
            ),
            ("split_ngram_parts", json!(x.ngram_shards)),
            (
                "mtp",
                json!({"hybrid": true, "layer_types": ["full_attention"], "num_hidden_layers": 1,
                       "rope_theta": theta, "mtp_use_hidden_state_from_layer": null}),
            ),
            ("mtp_num_hidden_layers", json!(1)),
            ("mtp_use_dedicated_embeddings", json!(false)),
        ] {
            text.insert(k.into(), v);
        }
        // The released vision placeholders (A.1), though this checkpoint has no tower.
        json!({
            "architectures": ["Qwen4ExpForConditionalGeneration"],
            "model_type": "qwen4_exp",
            "transformers_version": "5.8.0.dev0",
            "tie_word_embeddings": false,
            "language_model_only": true,
            "image_token_id": 248_056, "video_token_id": 248_057,
            "vision_start_token_id": 248_053, "vision_end_token_id": 248_054,
            "text_config": text,
            "quantization": quant.clone(), "quantization_config": quant,
        })
    }

    /// Layer `l` of Qwen3.8-Flash-Next as the released conversion stores it
    /// (reference-system.md A.3-A.9): on the PLE layer first the PLE block and the n-gram
    /// table, then both hyper-connections, the gated DeltaNet (split projections, a/b
    /// bf16) or, on every 4th layer, QSA attention with its bf16 indexer, then the MoE block
    /// with a bf16 router and shared-expert gate. `1 + w` norms are stored folded (1).
    fn flash_next_layer_tensors(&self, x: &FlashNextShape, l: usize) -> Vec<TensorSpec> {
        let (d, g, e) = (self.hidden, self.group_size, self.experts);
        let p = format!("{}model.layers.{l}", self.family.prefix());
        let mut t = Vec::new();
        if l == x.ple_layer {
            self.ple(&mut t, x, &format!("{p}.ple"));
        }
        for hc in ["attn_hyper_connection", "mlp_hyper_connection"] {
            hyper_connection(&mut t, &format!("{p}.{hc}"), x, d, g, true);
        }
        if self.is_full_attention(l) {
            let (h, kv, hd) = (self.heads, self.kv_heads, self.head_dim);
            let a = format!("{p}.self_attn");
            for (m, rows, cols) in [
                ("q_proj", 2 * h * hd, d),
                ("k_proj", kv * hd, d),
                ("v_proj", kv * hd, d),
                ("o_proj", d, h * hd),
            ] {
                quantized(&mut t, &format!("{a}.{m}"), &[], rows, cols, 4, g);
            }
            for m in ["q_norm", "k_norm"] {
                vector(
                    &mut t,
                    format!("{a}.{m}.weight"),
                    vec![hd],
                    Fill::Const(1.0),
                );
            }
            let ihd = x.indexer_head_dim;
            dense(
                &mut t,
                format!("{a}.indexer.index_qk_proj.weight"),
                (x.indexer_heads + 1) * ihd,
                d,
            );
            for m in ["q_layernorm", "k_layernorm"] {
                vector(
                    &mut t,
                    format!("{a}.indexer.{m}.weight"),
                    vec![ihd],
                    Fill::Const(1.0),
                );
            }
        } else {
            let (nk, nv, hd) = (
                self.linear_key_heads,
                self.linear_value_heads,
                self.linear_head_dim,
            );
            let (kd, vd) = (nk * hd, nv * hd);
            let a = format!("{p}.linear_attn");
            quantized(
                &mut t,
                &format!("{a}.in_proj_qkv"),
                &[],
                2 * kd + vd,
                d,
                4,
                g,
            );
            quantized(&mut t, &format!("{a}.in_proj_z"), &[], vd, d, 4, g);
            dense(&mut t, format!("{a}.in_proj_b.weight"), nv, d);
            dense(&mut t, format!("{a}.in_proj_a.weight"), nv, d);
            vector(
                &mut t,
                format!("{a}.conv1d.weight"),
                vec![2 * kd + vd, 4, 1],
                Fill::Uniform(0.5),
            );
            vector(&mut t, format!("{a}.dt_bias"), vec![nv], Fill::Const(1.0));
            vector(&mut t, format!("{a}.A_log"), vec![nv], Fill::Uniform(1.0));
            vector(
                &mut t,
                format!("{a}.norm.weight"),
                vec![hd],
                Fill::Const(1.0),
            );
            quantized(&mut t, &format!("{a}.out_proj"), &[], d, vd, 4, g);
        }
        dense(&mut t, format!("{p}.mlp.gate.weight"), e, d);
        dense(&mut t, format!("{p}.mlp.shared_expert_gate.weight"), 1, d);
        self.expert_mlps(&mut t, &p);
        t
    }

    /// The PLE block under `p` (reference-system.md A.6): key and value projections at
    /// 4 bits, three `[S*H]` group norms (folded, 1), the dilated conv `[S*H, kernel, 1]`,
    /// the int64 hashing buffers and the table's `ngram_shards` row shards
    /// `[rows_per_shard, hidden / heads]` at 4 bits, group `ngram_group_size`.
    fn ple(&self, t: &mut Vec<TensorSpec>, x: &FlashNextShape, p: &str) {
        let (d, g) = (self.hidden, self.group_size);
        let width = x.hc_count * d;
        quantized(t, &format!("{p}.key_proj"), &[], width, d, 4, g);
        quantized(t, &format!("{p}.value_proj"), &[], d, d, 4, g);
        for m in ["norm_key", "norm_query", "norm_conv"] {
            vector(t, format!("{p}.{m}.weight"), vec![width], Fill::Const(1.0));
        }
        vector(
            t,
            format!("{p}.conv1d.weight"),
            vec![width, x.ple_conv_kernel, 1],
            Fill::Uniform(0.5),
        );
        let ngram = NgramGeometry::new(x, self.vocab);
        let e = format!("{p}.ple_embedding");
        int64(t, format!("{e}.layer_multipliers"), ngram.multipliers);
        int64(t, format!("{e}.ngram_heads_vocab_sizes"), ngram.sizes);
        int64(t, format!("{e}.ngram_heads_offsets"), ngram.offsets);
        for s in 0..x.ngram_shards {
            quantized(
                t,
                &format!("{e}.ngram_embedding.shard_{s}"),
                &[],
                ngram.rows_per_shard,
                d / x.ngram_heads(),
                4,
                x.ngram_group_size,
            );
        }
    }
}

/// A Flash-Next hyper-connection `module` (reference-system.md A.3): `hc_norm` `[S*H]`
/// (folded, 1), the input mixer's `input_mix_weight_down` `[rank, S*H]` and
/// `input_mix_weight_up` `[S*H, rank]` at 4 bits, and with `inject` (a layer's own, not
/// the final mixer) the bf16 `block_inject_weight` `[S, S*H]`.
fn hyper_connection(
    t: &mut Vec<TensorSpec>,
    module: &str,
    x: &FlashNextShape,
    hidden: usize,
    group: usize,
    inject: bool,
) {
    let (width, rank) = (x.hc_count * hidden, x.hc_lowrank);
    vector(
        t,
        format!("{module}.hc_norm.weight"),
        vec![width],
        Fill::Const(1.0),
    );
    quantized(
        t,
        &format!("{module}.input_mix_weight_down"),
        &[],
        rank,
        width,
        4,
        group,
    );
    quantized(
        t,
        &format!("{module}.input_mix_weight_up"),
        &[],
        width,
        rank,
        4,
        group,
    );
    if inject {
        dense(
            t,
            format!("{module}.block_inject_weight.weight"),
            x.hc_count,
            width,
        );
    }
}

/// A PLE layer's n-gram table geometry and int64 hashing buffers, as transformers'
/// `Qwen4ExpTextNGramEmbedding` computes them for the first (here: only) PLE layer
/// (reference-system.md A.6, ../shared/spec/models.md §5.2). At the released shape:
/// head sizes 20,000,003 ... 20,000,171, 320,001,446 rows padded to 320,001,536, 128
/// shards of 2,500,012 rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NgramGeometry {
    /// `layer_multipliers` `[ngram_size]`: odd, below `i64::MAX / vocab`, so a token id
    /// times one never overflows.
    pub multipliers: Vec<i64>,
    /// `ngram_heads_vocab_sizes` `[heads]`: head `h` has the `(h+1)`-th prime at or above
    /// `ngram_vocab_size_base` as its row count.
    pub sizes: Vec<i64>,
    /// `ngram_heads_offsets` `[heads]`: head `h`'s first global row (running sum of sizes).
    pub offsets: Vec<i64>,
    /// Rows of each shard: the rows of all heads, padded up to a multiple of
    /// `make_ngram_vocab_size_divisible_by`, over `split_ngram_parts` shards (rounded up).
    pub rows_per_shard: usize,
}

impl NgramGeometry {
    fn new(x: &FlashNextShape, vocab: usize) -> Self {
        let sizes: Vec<i64> = (x.ngram_vocab_base..)
            .filter(|&n| is_prime(n))
            .take(x.ngram_heads())
            .map(|n| n as i64)
            .collect();
        let offsets: Vec<i64> = sizes
            .iter()
            .scan(0, |next, &size| {
                let first = *next;
                *next += size;
                Some(first)
            })
            .collect();
        let total = sizes.iter().sum::<i64>() as u64;
        let padded = total.div_ceil(x.ngram_divisible_by) * x.ngram_divisible_by;
        // transformers `_build_layer_multipliers`, PLE layer index 0: seed + 10007 * 0.
        let half = (i64::MAX as u64 / vocab as u64 / 2).max(1);
        let multipliers = (1..=x.ngram_size as u64)
            .map(|i| {
                let z = splitmix64(x.seed.wrapping_add(SPLITMIX_GAMMA.wrapping_mul(i)));
                (2 * (z % half) + 1) as i64
            })
            .collect();
        NgramGeometry {
            multipliers,
            sizes,
            offsets,
            rows_per_shard: padded.div_ceil(x.ngram_shards as u64) as usize,
        }
    }
}

const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output for state `x` (the state advanced by the golden gamma first).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(SPLITMIX_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Trial division (the n-gram bases are at most tens of millions).
fn is_prime(n: u64) -> bool {
    if n < 4 {
        return n >= 2;
    }
    if n.is_multiple_of(2) || n.is_multiple_of(3) {
        return false;
    }
    let mut d = 5;
    while d * d <= n {
        if n.is_multiple_of(d) || n.is_multiple_of(d + 2) {
            return false;
        }
        d += 6;
    }
    true
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
/// per layer; Qwen3.8-Flash-Next's layer 1 also holds the n-gram table, 32 GB at the
/// released shape), `model.safetensors.index.json`, and a byte-level tokenizer built in code
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
///
/// Errors: [`Preset::check`]'s (too few layers, an inconsistent preset) before anything
/// is written; a non-empty `dir` that holds no synthetic checkpoint; any write error,
/// with its path.
pub fn write_checkpoint_with(
    dir: &Path,
    preset: &Preset,
    layers: usize,
    progress: bool,
    routing: Option<&RoutingParams>,
) -> Result<()> {
    preset.check(layers)?;
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
    // Temporary files of an interrupted run (this directory is synth's: it has the marker).
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        let stale = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(crate::atomic_file::TEMP_PREFIX));
        if stale {
            std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
        }
    }
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
            let mut at = 0;
            w.tensor(t.bytes(), |b| match &t.fill {
                Fill::Packed => filler.fill(b),
                &Fill::Scales { inputs, bits } => {
                    // Centred uniform q on [0, 2^bits) has std ~ 2^bits / sqrt(12).
                    let s = 12f32.sqrt() / ((1u32 << bits) as f32 * (inputs as f32).sqrt());
                    fill_bf16(b, || s);
                }
                &Fill::Biases { inputs, bits } => {
                    let s = 12f32.sqrt() / ((1u32 << bits) as f32 * (inputs as f32).sqrt());
                    let bias = -s * ((1u32 << bits) - 1) as f32 / 2.0;
                    fill_bf16(b, || bias);
                }
                &Fill::Const(v) => fill_bf16(b, || v),
                &Fill::Uniform(a) => fill_bf16(b, || a * filler.unit()),
                Fill::Int64(values) => {
                    for (i, byte) in b.iter_mut().enumerate() {
                        let k = at + i;
                        *byte = values[k / 8].to_le_bytes()[k % 8];
                    }
                    at += b.len();
                }
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
    write_tokenizer(dir, preset)?;
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

/// The tokenizer files of a synthetic checkpoint (`tokenizer.json`,
/// `tokenizer_config.json`, `generation_config.json`), as `(file name, contents)`.
///
/// A byte-level BPE without merges: the 256 byte tokens, filler tokens up to the first
/// special id, then `<|endoftext|>`, `<|im_start|>` and `<|im_end|>` at the ids `special`
/// gives, which are config.json's (`bos_token_id`, `eos_token_id`). The fillers are
/// needed because the `tokenizers` crate numbers added tokens from the end of the model's
/// vocabulary whatever ids tokenizer.json lists (256 to 258 without them). Each filler is
/// two or more lowercase letters, never produced by encoding (there are no merges), so
/// text tokenizes byte by byte as before and a random model's fillers print as letters.
/// generation_config.json lists `<|im_end|>` and `<|endoftext|>` as EOS.
fn tokenizer_files([eot, start, end]: [usize; 3]) -> [(&'static str, serde_json::Value); 3] {
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
    for id in 256..eot {
        model_vocab.insert(filler(id - 256), json!(id));
    }
    let special = |id: usize, s: &str| json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
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
    [
        ("tokenizer.json", tokenizer),
        (
            "tokenizer_config.json",
            json!({
                "eos_token": "<|im_end|>", "bos_token": null, "pad_token": "<|endoftext|>",
                "chat_template": "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
            }),
        ),
        (
            "generation_config.json",
            json!({"eos_token_id": [end, eot]}),
        ),
    ]
}

/// The `i`-th filler token: the two-letter strings `aa` to `zz`, then the three-letter
/// ones, and so on.
fn filler(mut i: usize) -> String {
    let mut len = 2;
    while i >= 26usize.pow(len) {
        i -= 26usize.pow(len);
        len += 1;
    }
    (0..len)
        .rev()
        .map(|d| char::from(b'a' + (i / 26usize.pow(d) % 26) as u8))
        .collect()
}

/// Writes the tokenizer files of `preset` ([`tokenizer_files`]) into `dir`.
fn write_tokenizer(dir: &Path, preset: &Preset) -> Result<()> {
    for (name, value) in tokenizer_files(preset.special_tokens()) {
        write_json(dir, name, &value)?;
    }
    Ok(())
}

/// Rewrites the tokenizer files of a `preset` checkpoint in `dir` where they differ from
/// what this build writes (a checkpoint made by an older build, such as a demo model
/// left in the cache); the weights stay. Returns whether anything was rewritten.
/// Errors: a file that cannot be written.
pub fn refresh_tokenizer(dir: &Path, preset: &Preset) -> Result<bool> {
    let stale = tokenizer_files(preset.special_tokens())
        .iter()
        .any(|(name, want)| {
            std::fs::read_to_string(dir.join(name))
                .ok()
                .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
                .as_ref()
                != Some(want)
        });
    if stale {
        write_tokenizer(dir, preset)?;
    }
    Ok(stale)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{LayerKind, ModelConfig};

    fn shapes(tensors: &[TensorSpec]) -> Vec<(String, &'static str, Vec<usize>)> {
        tensors
            .iter()
            .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
            .collect()
    }

    /// The released n-gram table (reference-system.md A.6, models.md §5.2): primes after
    /// 20,000,000, 128 shards of 2,500,012 rows, 32,000,153,600 bytes.
    #[test]
    fn flash_next_ngram_table_has_the_released_geometry() {
        let g = QWEN38_FLASH_NEXT.ngram_geometry().unwrap();
        assert_eq!(g.sizes.len(), 16);
        assert_eq!((g.sizes[0], g.sizes[15]), (20_000_003, 20_000_171));
        assert_eq!((g.offsets[1], g.offsets[15]), (20_000_003, 300_001_275));
        assert_eq!(g.sizes.iter().sum::<i64>(), 320_001_446);
        assert_eq!(g.rows_per_shard, 2_500_012);
        // Odd, and small enough that no token id times one overflows.
        let limit = i64::MAX / 248_320;
        assert!(g.multipliers.iter().all(|&m| m % 2 == 1 && m < limit));
        let table: u64 = QWEN38_FLASH_NEXT
            .layer_tensors(1)
            .iter()
            .filter(|t| t.name.contains(".ngram_embedding.shard_"))
            .map(TensorSpec::bytes)
            .sum();
        assert_eq!(table, 32_000_153_600);
    }

    /// The released byte budget (A.7, A.8): 24,576 records of 2,764,800 bytes, 4-bit
    /// embeddings and head of 357,580,800 bytes each.
    #[test]
    fn flash_next_sizes_match_the_release() {
        let p = QWEN38_FLASH_NEXT;
        let experts: u64 = (0..48)
            .flat_map(|l| p.layer_tensors(l))
            .filter(|t| t.name.contains(".switch_mlp."))
            .map(|t| t.bytes())
            .sum();
        assert_eq!(experts, 24_576 * 2_764_800);
        for t in p.head_tensors().chunks(3).take(2) {
            assert_eq!(t.iter().map(TensorSpec::bytes).sum::<u64>(), 357_580_800);
        }
        assert_eq!(p.checkpoint_bytes(48), 102_871_883_800);
    }

    /// An attention layer (l % 4 == 3) holds QSA attention with its bf16 indexer and
    /// no gated DeltaNet (reference-system.md A.5).
    #[test]
    fn flash_next_attention_layer_has_the_released_tensors() {
        let p = "language_model.model.layers.3.self_attn";
        let q = |m: &str, out: usize, inp: usize| {
            [
                (format!("{p}.{m}.weight"), "U32", vec![out, inp / 8]),
                (format!("{p}.{m}.scales"), "BF16", vec![out, inp / 64]),
                (format!("{p}.{m}.biases"), "BF16", vec![out, inp / 64]),
            ]
        };
        let mut want: Vec<(String, &str, Vec<usize>)> = [
            q("q_proj", 12_288, 2560),
            q("k_proj", 512, 2560),
            q("v_proj", 512, 2560),
            q("o_proj", 2560, 6144),
        ]
        .concat();
        for (m, shape) in [
            ("q_norm", vec![256]),
            ("k_norm", vec![256]),
            ("indexer.index_qk_proj", vec![640, 2560]),
            ("indexer.q_layernorm", vec![128]),
            ("indexer.k_layernorm", vec![128]),
        ] {
            want.push((format!("{p}.{m}.weight"), "BF16", shape));
        }
        let got: Vec<_> = shapes(&QWEN38_FLASH_NEXT.layer_tensors(3))
            .into_iter()
            .filter(|(n, _, _)| n.contains(".self_attn.") || n.contains(".linear_attn."))
            .collect();
        assert_eq!(got, want);
    }

    /// The config parses as the released model: 48 layers of `[lin, lin, lin, full]`, the
    /// Flash-Next fields, and 128 group-32 overrides; with `--layers 2`, two linear layers.
    #[test]
    fn flash_next_config_reads_back_as_the_release() {
        let path = std::path::Path::new("config.json");
        let v = QWEN38_FLASH_NEXT.config(48);
        let cfg = ModelConfig::from_json(&v, path).unwrap();
        assert_eq!(cfg.family, Family::Qwen4Exp);
        assert_eq!(
            (
                cfg.hidden_size,
                cfg.vocab_size,
                cfg.num_experts,
                cfg.rotary_dim
            ),
            (2560, 248_320, 512, 64)
        );
        assert_eq!(cfg.layer_kinds.len(), 48);
        assert!(cfg
            .layer_kinds
            .iter()
            .enumerate()
            .all(|(l, &k)| (k == LayerKind::FullAttention) == (l % 4 == 3)));
        let x = cfg.flash_next.clone().unwrap();
        assert_eq!(x.ple.unwrap().split_parts, 128);
        assert_eq!(x.indexer.unwrap().budget, 2048);
        let quant = v["quantization"].as_object().unwrap();
        assert_eq!(quant.len(), 3 + 128);
        // Keyed as released, without the tensors' `language_model.` prefix, and found.
        let shard = "model.layers.1.ple.ple_embedding.ngram_embedding.shard_127";
        assert_eq!(quant[shard], json!({"group_size": 32, "bits": 4}));
        assert!(quant.keys().all(|k| !k.starts_with("language_model.")));
        assert_eq!(
            cfg.quant_override(&format!("language_model.{shard}")),
            Some(Some(crate::config::QuantSpec {
                bits: 4,
                group_size: 32
            }))
        );
        assert_eq!(
            v["text_config"]["rope_parameters"]["mrope_section"],
            json!([11, 11, 10])
        );
        assert!(v["text_config"].get("seed").is_none());
        let two = ModelConfig::from_json(&QWEN38_FLASH_NEXT.config(2), path).unwrap();
        assert_eq!(two.layer_kinds, [LayerKind::LinearAttention; 2]);
    }

    /// Every preset's tokenizer.json gives `<|endoftext|>`, `<|im_start|>` and
    /// `<|im_end|>` the ids config.json and generation_config.json use (BOS and EOS),
    /// loaded by the `tokenizers` crate as the engine loads it (which renumbers added
    /// tokens that do not follow the model's vocabulary); text still encodes byte by byte.
    #[test]
    fn special_token_ids_agree_with_the_configs() {
        for p in PRESETS {
            let config = p.config(p.min_layers());
            let text = config.get("text_config").unwrap_or(&config);
            let [tok_json, _, generation] = tokenizer_files(p.special_tokens());
            let tok: tokenizers::Tokenizer = tok_json.1.to_string().parse().unwrap();
            let id = |t: &str| tok.token_to_id(t).map(|i| i as u64);
            let (eot, end) = (id("<|endoftext|>"), id("<|im_end|>"));
            assert_eq!(id("<|im_start|>"), eot.map(|e| e + 1), "{}", p.name);
            assert_eq!(text["bos_token_id"].as_u64(), eot, "{}: BOS", p.name);
            let eos = text["eos_token_id"].as_u64();
            assert!(eos == end || eos == eot, "{}: EOS {eos:?}", p.name);
            assert_eq!(
                generation.1["eos_token_id"],
                json!([end, eot]),
                "{}",
                p.name
            );
            assert_eq!(
                tok.get_vocab_size(true) as u64,
                end.unwrap() + 1,
                "{}",
                p.name
            );
            assert!(end.unwrap() < p.vocab as u64, "{}", p.name);
            let enc = tok.encode("hi <|im_end|>", false).unwrap();
            assert_eq!(
                enc.get_ids(),
                [b'h' as u32, b'i' as u32, b' ' as u32, end.unwrap() as u32]
            );
        }
        assert_eq!(
            [filler(0), filler(25), filler(26), filler(675), filler(676)],
            ["aa", "az", "ba", "zz", "aaa"]
        );
    }

    /// `--ngram-rows` shrinks the table and its hashing buffers follow; bad values, presets
    /// without a table and too few layers are refused with named errors.
    #[test]
    fn ngram_rows_and_layers_are_checked() {
        let small = QWEN38_FLASH_NEXT.with_ngram_rows(1).unwrap();
        let g = small.ngram_geometry().unwrap();
        // The first 16 primes (sum 381), padded to 384 rows over 128 shards.
        assert_eq!((g.sizes[0], g.sizes[15], g.rows_per_shard), (2, 53, 3));
        assert!(small.check(2).is_ok());
        for (result, needle) in [
            (
                QWEN38_FLASH_NEXT.with_ngram_rows(0).map(|_| ()),
                "between 1",
            ),
            (
                QWEN38_FLASH_NEXT.with_ngram_rows(20_000_001).map(|_| ()),
                "20000000",
            ),
            (DEMO.with_ngram_rows(10).map(|_| ()), "no n-gram table"),
            (QWEN38_FLASH_NEXT.check(1), "at least 2 layers"),
            (
                Preset {
                    flash_next: None,
                    ..QWEN38_FLASH_NEXT
                }
                .check(2),
                "qwen4_exp",
            ),
        ] {
            let e = result.unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
        assert_eq!((QWEN38_FLASH_NEXT.min_layers(), DEMO.min_layers()), (2, 1));
    }
}
