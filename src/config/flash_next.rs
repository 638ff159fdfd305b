//! What Qwen3.8-Flash-Next (`qwen4_exp`) adds to the config: hyper-connections, the PLE
//! n-gram layer and the QSA indexer.

use crate::error::Result;

use super::fields::Fields;

/// What Qwen3.8-Flash-Next (`qwen4_exp`) adds to the Qwen3.5 blocks (transformers 5.24
/// `modular_qwen4_exp.py`; ../shared/spec/models.md §5, reference-system.md A.2-A.6).
#[derive(Clone, Debug, PartialEq)]
pub struct FlashNext {
    /// Residual streams of the hyper-connections (`hc_count`); the hidden state is
    /// `[T, hc_count * hidden_size]`.
    pub hc_count: usize,
    /// Rank of the hyper-connection input mixer (`hc_lowrank`).
    pub hc_lowrank: usize,
    /// The PLE (hashed n-gram embedding) layers, if any.
    pub ple: Option<PleConfig>,
    /// The QSA indexer of the attention layers, if any (none: dense causal attention).
    pub indexer: Option<IndexerConfig>,
}

/// The PLE layer's geometry (`ple_*`, `ngram_*`, `heads_per_ngram`, `split_ngram_parts`).
#[derive(Clone, Debug, PartialEq)]
pub struct PleConfig {
    /// Zero-based indices of the layers that start with a PLE block (`ple_layer_ids` are
    /// one-based).
    pub layers: Vec<usize>,
    /// Width of a token's concatenated n-gram rows (`ple_embed_dim`).
    pub embed_dim: usize,
    /// Kernel of the dilated causal conv (`ple_conv_kernel_size`); the dilation is `ngram_size`.
    pub conv_kernel: usize,
    /// Largest n-gram (`ngram_size`): orders 2..=ngram_size are hashed.
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    /// Shards of each layer's table (`split_ngram_parts`).
    pub split_parts: usize,
}

impl PleConfig {
    /// Hashed heads per token: `(ngram_size - 1) * heads_per_ngram`.
    pub fn heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }

    /// Width of one head's row: `embed_dim / heads`.
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.heads()
    }

    /// Rows of state the dilated conv keeps: `(conv_kernel - 1) * ngram_size`.
    pub fn conv_state_rows(&self) -> usize {
        (self.conv_kernel - 1) * self.ngram_size
    }
}

/// The QSA indexer (`indexer_*`): once more keys are visible than `budget`, each query
/// attends only to the `budget / compress_ratio` best blocks of `compress_ratio` keys
/// and to its own partial block.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerConfig {
    /// Query heads of the indexer (`indexer_n_heads`); it has one key head.
    pub heads: usize,
    pub head_dim: usize,
    pub budget: usize,
    pub compress_ratio: usize,
}

impl IndexerConfig {
    /// Blocks kept per query: `budget / compress_ratio`.
    pub fn block_top_k(&self) -> usize {
        self.budget / self.compress_ratio
    }
}

/// Reads Flash-Next's fields (transformers `Qwen4ExpTextConfig`, whose defaults apply
/// where a field is absent) and checks them as its `validate_architecture` does.
pub(super) fn parse_flash_next(f: &Fields<'_>, layers: usize, hidden: usize) -> Result<FlashNext> {
    let hc_count = f.usize_or("hc_count", Some(4))?;
    if hc_count < 2 {
        return Err(f.err(
            "hc_count",
            format!("{hc_count} streams; at least 2 are needed"),
        ));
    }
    let hc_lowrank = f.usize_or("hc_lowrank", Some(320))?;
    let ple_ids = f.usize_list("ple_layer_ids")?;
    let ple = if ple_ids.is_empty() {
        None
    } else {
        let mut layers_ = Vec::new();
        for id in ple_ids {
            if id == 0 || id > layers {
                return Err(f.err(
                    "ple_layer_ids",
                    format!("{id} is not a one-based layer id in 1..={layers}"),
                ));
            }
            layers_.push(id - 1);
        }
        layers_.sort_unstable();
        layers_.dedup();
        let ple = PleConfig {
            layers: layers_,
            embed_dim: f.usize_or("ple_embed_dim", Some(hidden))?,
            conv_kernel: f.usize_or("ple_conv_kernel_size", Some(4))?,
            ngram_size: f.usize_or("ngram_size", Some(3))?,
            heads_per_ngram: f.usize_or("heads_per_ngram", Some(8))?,
            split_parts: f.usize_or("split_ngram_parts", Some(512))?,
        };
        if ple.ngram_size < 2
            || ple.heads_per_ngram == 0
            || !ple.embed_dim.is_multiple_of(ple.heads())
            || ple.embed_dim == 0
        {
            return Err(f.err(
                "ple_embed_dim",
                format!(
                    "{} is not a positive multiple of the {} n-gram heads",
                    ple.embed_dim,
                    ple.heads()
                ),
            ));
        }
        if ple.conv_kernel == 0 || ple.split_parts == 0 {
            return Err(f.err(
                "ple_conv_kernel_size",
                "ple_conv_kernel_size and split_ngram_parts must be at least 1",
            ));
        }
        Some(ple)
    };
    let fields = [
        "indexer_n_heads",
        "indexer_kv_heads",
        "indexer_head_dim",
        "indexer_budget",
        "indexer_compress_ratio",
    ];
    let indexer = if fields.iter().all(|k| f.get(k).is_none()) {
        None
    } else {
        let v = fields
            .iter()
            .map(|k| f.usize(k))
            .collect::<Result<Vec<_>>>()?;
        if let Some(i) = v.iter().position(|&x| x == 0) {
            return Err(f.err(fields[i], "must be at least 1"));
        }
        if v[1] != 1 {
            return Err(f.err(
                "indexer_kv_heads",
                format!("{}; QSA has exactly one indexer key head", v[1]),
            ));
        }
        if v[3] % v[4] != 0 {
            return Err(f.err(
                "indexer_budget",
                format!(
                    "{} is not a multiple of indexer_compress_ratio {}",
                    v[3], v[4]
                ),
            ));
        }
        Some(IndexerConfig {
            heads: v[0],
            head_dim: v[2],
            budget: v[3],
            compress_ratio: v[4],
        })
    };
    Ok(FlashNext {
        hc_count,
        hc_lowrank,
        ple,
        indexer,
    })
}
