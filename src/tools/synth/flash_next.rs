//! Qwen3.8-Flash-Next's own tensors (reference-system.md A.3-A.9): its layers as the
//! released conversion stores them, the PLE block, the hyper-connections and the n-gram
//! table's geometry.

use super::presets::{FlashNextShape, Preset};
use super::tensors::{dense, int64, quantized, vector, Fill, TensorSpec};

impl Preset {
    /// Layer `l` of Qwen3.8-Flash-Next as the released conversion stores it
    /// (reference-system.md A.3-A.9): on the PLE layer first the PLE block and the n-gram
    /// table, then both hyper-connections, the gated DeltaNet (split projections, a/b
    /// bf16) or, on every 4th layer, QSA attention with its bf16 indexer, then the MoE block
    /// with a bf16 router and shared-expert gate. `1 + w` norms are stored folded (1).
    pub(super) fn flash_next_layer_tensors(&self, x: &FlashNextShape, l: usize) -> Vec<TensorSpec> {
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
pub(super) fn hyper_connection(
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
    pub(super) fn new(x: &FlashNextShape, vocab: usize) -> Self {
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
