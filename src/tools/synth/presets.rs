//! The presets: each model's geometry at its released shape, and the checks a preset must
//! pass before a checkpoint of it is written.

use crate::config::Family;
use crate::error::{Error, Result};

use super::flash_next::NgramGeometry;

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
    /// The vision tower, written as the MLX conversions store it (`vision_tower.*`, bf16,
    /// the patch embedding's Conv3d weight channels-last) with its `vision_config`; only for
    /// the multimodal families (`qwen3_5_moe`, `qwen4_exp`). `None`: a text-only checkpoint.
    pub vision: Option<VisionShape>,
    /// Whether the checkpoint carries an MTP draft head (`mtp.*`; Qwen3-Next and
    /// Qwen3.5-MoE only).
    pub mtp: bool,
}

/// A vision tower's geometry (reference-system.md A.10, transformers' `vision_config`
/// names in the comments); its output width is the preset's `hidden`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VisionShape {
    /// Blocks (`depth`).
    pub depth: usize,
    /// Width of the tower's rows (`hidden_size`).
    pub hidden: usize,
    /// Width of a block's MLP (`intermediate_size`).
    pub intermediate: usize,
    /// Attention heads (`num_heads`).
    pub heads: usize,
    /// Side of a patch in pixels (`patch_size`).
    pub patch: usize,
    /// Frames of a patch (`temporal_patch_size`).
    pub temporal_patch: usize,
    /// Side of the square of patches merged into a token (`spatial_merge_size`).
    pub merge: usize,
    /// Rows of the learned position grid, a square (`num_position_embeddings`).
    pub positions: usize,
}

/// The released tower of Qwen3.5-MoE and Qwen3.8-Flash-Next (A.10): 27 blocks of width
/// 1152, 16 heads, MLP 4304, patch 16 over 2 frames, merge 2, a 48 x 48 position grid;
/// 0.9 GB in bf16.
pub const VISION_SHAPE: VisionShape = VisionShape {
    depth: 27,
    hidden: 1152,
    intermediate: 4304,
    heads: 16,
    patch: 16,
    temporal_patch: 2,
    merge: 2,
    positions: 2304,
};

/// A small tower with the released patch sizes, for tests: 2 blocks of width 64, 4 heads,
/// an 8 x 8 position grid.
pub const SMALL_VISION_SHAPE: VisionShape = VisionShape {
    depth: 2,
    hidden: 64,
    intermediate: 128,
    heads: 4,
    patch: 16,
    temporal_patch: 2,
    merge: 2,
    positions: 64,
};

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
    vision: None,
    mtp: false,
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
    vision: None,
    mtp: false,
};

/// Qwen3.8-Flash-Next (`qwen4_exp`, reference-system.md A.1-A.9) as released in MLX 4-bit:
/// 48 layers of 512 experts (top-10), records of 2,764,800 bytes, a 32 GB n-gram table;
/// 103.77 GB of tensors at 48 layers with the vision tower ([`Preset::checkpoint_bytes`]).
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
    vision: Some(VISION_SHAPE),
    mtp: false,
};

/// Qwen3.5-35B-A3B (../shared/spec/models.md §1.2) in the `qwen3_5_moe` layout: 40 layers
/// of 256 experts (top-8), records of 1,769,472 bytes, and the vision tower.
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
    vision: Some(VISION_SHAPE),
    mtp: false,
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

impl Preset {
    pub(super) fn is_full_attention(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(4)
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
    pub(super) fn special_tokens(&self) -> [usize; 3] {
        let first = self.flash_next.map_or(self.vocab - 3, |x| x.eos);
        [first, first + 1, first + 2]
    }

    /// Errors ([`Error::InvalidInput`]) unless a `layers`-layer checkpoint of this preset
    /// can be written and loaded: at least [`Preset::min_layers`] layers, a
    /// [`FlashNextShape`] exactly for `qwen4_exp`, special tokens inside the vocabulary,
    /// n-gram rows of whole quantization groups, and a vision tower only for a multimodal
    /// family, with heads of a width divisible by 4 and a square position grid.
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
        if self.mtp && self.flash_next.is_some() {
            return bad(
                "synth writes no MTP head for Flash-Next (its scheme A is not implemented)".into(),
            );
        }
        if let Some(v) = &self.vision {
            if self.family == Family::Qwen3Next {
                return bad("qwen3_next has no vision tower".into());
            }
            let side = v.positions.isqrt();
            if v.heads == 0
                || !v.hidden.is_multiple_of(v.heads)
                || !(v.hidden / v.heads).is_multiple_of(4)
                || side * side != v.positions
                || [v.depth, v.intermediate, v.patch, v.temporal_patch, v.merge].contains(&0)
            {
                return bad(format!("unusable vision tower geometry {v:?}"));
            }
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
}
