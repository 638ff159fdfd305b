//! Flash-Next's hashed n-gram table (the PLE layer's embedding), read from the SSD.
//!
//! Each token gathers `(ngram_size - 1) * heads_per_ngram` rows (16 at the released
//! shapes): heads `0..8` hash the token's bigram, heads `8..16` its trigram, and the rows
//! are concatenated in head order. The table (32 GB at 4 bits for Qwen3.8-Flash-Next) is
//! never loaded: a row is three small positional reads (packed words, scales, biases) from
//! the checkpoint's shard files, kept in a small FIFO row cache. Hashing follows
//! transformers 5.24 `Qwen4ExpTextNGramEmbedding` (../shared/spec/models.md §5.2,
//! reference-system.md A.6); the multipliers, head sizes and offsets come from the
//! checkpoint's int64 buffers.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use safetensors::Dtype;

use crate::backend::{dequantize_row, Floats, QuantView};
use crate::checkpoint::Checkpoint;
use crate::config::{PleConfig, QuantSpec};
use crate::error::{Error, Result};
use crate::io::{read_range, DiskFile, IoMode, ReadAt};

/// Rows the cache keeps per table (about 160 KB of f32 at the released head width of 160
/// per thousand rows: 400 K rows is the reference system's choice, 256 MB).
pub const ROW_CACHE_ROWS: usize = 65_536;

/// The row ids of `new` tokens that follow `history` (every token the sequence already
/// holds): `[new.len(), heads]`, head-major per token.
///
/// For position `p` of `hist = [eos, eos] ++ history ++ new`, `t_s = hist[p - s]` unless an
/// EOS lies at one of `p - s .. p - 1` (the shift may not cross a document boundary), in
/// which case `t_s = eos`. Order `n` mixes `t_0 m_0 ^ t_1 m_1 ^ .. ^ t_{n-1} m_{n-1}`
/// (wrapping i64 products), and head `j` of that order takes row
/// `mix mod sizes[j] + offsets[j]`.
pub fn ngram_row_ids(
    history: &[u32],
    new: &[u32],
    eos: u32,
    ngram_size: usize,
    heads_per_ngram: usize,
    multipliers: &[i64],
    sizes: &[i64],
    offsets: &[i64],
) -> Vec<u64> {
    let context = ngram_size - 1;
    // The last `context` tokens before `new`, padded on the left with EOS.
    let mut hist: Vec<u32> = vec![eos; context];
    hist.extend(history.iter().rev().take(context).rev());
    let hist = &hist[hist.len() - context..];
    let all: Vec<u32> = hist.iter().chain(new).copied().collect();
    let heads = context * heads_per_ngram;
    let mut ids = Vec::with_capacity(new.len() * heads);
    for p in context..all.len() {
        // t_s for s = 0..ngram_size, EOS once a boundary is crossed.
        let mut shifted = Vec::with_capacity(ngram_size);
        let mut crossed = false;
        for s in 0..ngram_size {
            if s > 0 && all[p - s] == eos {
                crossed = true;
            }
            shifted.push(if crossed || p < s { eos } else { all[p - s] });
        }
        for n in 2..=ngram_size {
            let mix = (0..n).fold(0i64, |acc, s| {
                acc ^ (shifted[s] as i64).wrapping_mul(multipliers[s])
            });
            for head in (n - 2) * heads_per_ngram..(n - 1) * heads_per_ngram {
                ids.push((mix.rem_euclid(sizes[head]) + offsets[head]) as u64);
            }
        }
    }
    ids
}

/// Where one shard's packed words, scales and biases lie: (file, offset of row 0).
struct Shard {
    weight: (Arc<dyn ReadAt>, u64),
    scales: (Arc<dyn ReadAt>, u64),
    biases: (Arc<dyn ReadAt>, u64),
}

/// Row-cache and read counters of one table.
#[derive(Debug, Default)]
pub struct NgramStats {
    /// Rows served from the cache.
    pub hits: AtomicU64,
    /// Rows read from the SSD.
    pub misses: AtomicU64,
}

/// One PLE layer's n-gram table: hashing buffers, shard locations and the row cache.
pub struct NgramTable {
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    /// Width of one row (`ple_embed_dim / heads`).
    pub head_dim: usize,
    pub eos: u32,
    multipliers: Vec<i64>,
    sizes: Vec<i64>,
    offsets: Vec<i64>,
    rows_per_shard: u64,
    spec: QuantSpec,
    scale_dtype: Dtype,
    shards: Vec<Shard>,
    cache: Mutex<RowCache>,
    pub stats: NgramStats,
}

#[derive(Default)]
struct RowCache {
    rows: HashMap<u64, Arc<[f32]>>,
    order: VecDeque<u64>,
}

impl NgramTable {
    /// Opens the table of layer `layer` (`model.layers.{layer}.ple.ple_embedding.*`).
    ///
    /// Errors: a missing or mis-shaped buffer or shard, shards that differ in shape or
    /// quantization, head counts that disagree with the config, an unreadable shard file.
    pub fn open(ckpt: &Checkpoint, layer: usize, ple: &PleConfig) -> Result<Self> {
        let cfg = &ckpt.config;
        let base = cfg.layer_name(layer, "ple.ple_embedding");
        let heads = ple.heads();
        let ints = |name: &str, len: usize| -> Result<Vec<i64>> {
            let full = format!("{base}.{name}");
            let t = ckpt.tensor(&full)?;
            if t.dtype != Dtype::I64 || t.shape != [len] {
                return Err(Error::bad_tensor(
                    &full,
                    format!("is {:?} {:?}; expected I64 [{len}]", t.dtype, t.shape),
                ));
            }
            Ok(ckpt
                .bytes(t)
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()))
                .collect())
        };
        let multipliers = ints("layer_multipliers", ple.ngram_size)?;
        let sizes = ints("ngram_heads_vocab_sizes", heads)?;
        let offsets = ints("ngram_heads_offsets", heads)?;
        if let Some(bad) = sizes.iter().position(|&s| s <= 0) {
            return Err(Error::bad_tensor(
                &format!("{base}.ngram_heads_vocab_sizes"),
                format!("head {bad} has size {}", sizes[bad]),
            ));
        }
        let head_dim = ple.head_dim();
        let mut shards = Vec::with_capacity(ple.split_parts);
        let mut files: HashMap<usize, Arc<dyn ReadAt>> = HashMap::new();
        let mut geometry = None;
        for i in 0..ple.split_parts {
            let module = format!("{base}.ngram_embedding.shard_{i}");
            let w = ckpt.tensor(&format!("{module}.weight"))?;
            let spec = match cfg.quantization.for_module(&module) {
                Some(Some(spec)) => spec,
                _ => cfg.quantization.default.ok_or_else(|| {
                    Error::bad_tensor(
                        &module,
                        "n-gram shards must be quantized (no quantization block in config.json)",
                    )
                })?,
            };
            let rows = w.shape.first().copied().unwrap_or(0);
            let (_, scales, _) = ckpt.quantized_parts(&module, spec, &[], rows, head_dim)?;
            let g = (rows, spec, scales.0);
            match geometry {
                None => geometry = Some(g),
                Some(first) if first == g => {}
                Some(first) => {
                    return Err(Error::bad_tensor(
                        &module,
                        format!(
                            "has {rows} rows, {spec:?}, {:?} scales; shard_0 has {:?}",
                            scales.0, first
                        ),
                    ))
                }
            }
            let mut place = |part: &str| -> Result<(Arc<dyn ReadAt>, u64)> {
                let t = ckpt.tensor(&format!("{module}.{part}"))?;
                let file = match files.get(&t.shard) {
                    Some(f) => f.clone(),
                    None => {
                        let path: PathBuf = ckpt.shards()[t.shard].path.clone();
                        let f: Arc<dyn ReadAt> = Arc::new(DiskFile::open(&path, IoMode::Buffered)?);
                        files.insert(t.shard, f.clone());
                        f
                    }
                };
                Ok((file, t.offset))
            };
            shards.push(Shard {
                weight: place("weight")?,
                scales: place("scales")?,
                biases: place("biases")?,
            });
        }
        let (rows_per_shard, spec, scale_dtype) = geometry.ok_or_else(|| {
            Error::bad_tensor(
                &format!("{base}.ngram_embedding"),
                "split_ngram_parts is 0: no shards",
            )
        })?;
        let capacity = (rows_per_shard * ple.split_parts) as i64;
        if let Some(h) = (0..heads).find(|&h| offsets[h] < 0 || offsets[h] + sizes[h] > capacity) {
            return Err(Error::bad_tensor(
                &format!("{base}.ngram_heads_offsets"),
                format!(
                    "head {h} spans rows {}..{} of a table of {capacity}",
                    offsets[h],
                    offsets[h] + sizes[h]
                ),
            ));
        }
        Ok(NgramTable {
            ngram_size: ple.ngram_size,
            heads_per_ngram: ple.heads_per_ngram,
            head_dim,
            eos: cfg.eos_token_ids[0],
            multipliers,
            sizes,
            offsets,
            rows_per_shard: rows_per_shard as u64,
            spec,
            scale_dtype,
            shards,
            cache: Mutex::new(RowCache::default()),
            stats: NgramStats::default(),
        })
    }

    /// Hashed heads per token.
    pub fn heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }

    /// Row ids of `new` after `history` (see [`ngram_row_ids`]).
    pub fn row_ids(&self, history: &[u32], new: &[u32]) -> Vec<u64> {
        ngram_row_ids(
            history,
            new,
            self.eos,
            self.ngram_size,
            self.heads_per_ngram,
            &self.multipliers,
            &self.sizes,
            &self.offsets,
        )
    }

    /// The embedding of `new` after `history`: `[new.len(), heads * head_dim]` f32, rows
    /// dequantized (`scale * q + bias`), concatenated in head order.
    /// Errors: a failed read (named file and offset).
    pub fn embed(&self, history: &[u32], new: &[u32]) -> Result<Vec<f32>> {
        let ids = self.row_ids(history, new);
        let mut out = Vec::with_capacity(ids.len() * self.head_dim);
        for id in ids {
            out.extend_from_slice(&self.row(id)?);
        }
        Ok(out)
    }

    /// One dequantized row, from the cache or the SSD.
    fn row(&self, id: u64) -> Result<Arc<[f32]>> {
        if let Some(r) = self
            .cache
            .lock()
            .map_err(|_| Error::Internal("n-gram row cache poisoned".into()))?
            .rows
            .get(&id)
        {
            self.stats.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(r.clone());
        }
        self.stats.misses.fetch_add(1, Ordering::Relaxed);
        let shard = &self.shards[(id / self.rows_per_shard) as usize];
        let r = id % self.rows_per_shard;
        let d = self.head_dim;
        let packed_len = d / self.spec.per_word() * 4;
        let groups = d / self.spec.group_size;
        let scale_len = groups * self.scale_dtype.bitsize() / 8;
        let mut packed = vec![0u8; packed_len];
        let mut scales = vec![0u8; scale_len];
        let mut biases = vec![0u8; scale_len];
        for ((file, base), len, buf) in [
            (&shard.weight, packed_len, &mut packed),
            (&shard.scales, scale_len, &mut scales),
            (&shard.biases, scale_len, &mut biases),
        ] {
            read_range(file.as_ref(), base + r * len as u64, buf)?;
        }
        let view = QuantView {
            spec: self.spec,
            rows: 1,
            cols: d,
            packed: &packed,
            scales: Floats {
                dtype: self.scale_dtype,
                bytes: &scales,
            },
            biases: Floats {
                dtype: self.scale_dtype,
                bytes: &biases,
            },
        };
        let mut values = vec![0.0f32; d];
        dequantize_row(&view, 0, &mut values);
        let row: Arc<[f32]> = values.into();
        let mut cache = self
            .cache
            .lock()
            .map_err(|_| Error::Internal("n-gram row cache poisoned".into()))?;
        if cache.rows.insert(id, row.clone()).is_none() {
            cache.order.push_back(id);
            if cache.order.len() > ROW_CACHE_ROWS {
                if let Some(old) = cache.order.pop_front() {
                    cache.rows.remove(&old);
                }
            }
        }
        Ok(row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_resets_at_eos_and_pads_with_eos() {
        let (eos, m, sizes, offsets) = (9u32, [3i64, 5, 7], [11i64, 13], [0i64, 11]);
        // One head per order: head 0 bigram, head 1 trigram.
        let ids = ngram_row_ids(&[], &[1, 2, 9, 4], eos, 3, 1, &m, &sizes, &offsets);
        let row = |t: [u32; 3], n: usize| {
            let mix = (0..n).fold(0i64, |a, s| a ^ (t[s] as i64 * m[s]));
            vec![mix.rem_euclid(sizes[n - 2]) as u64 + offsets[n - 2] as u64]
        };
        let want: Vec<u64> = [
            [[1, 9, 9], [1, 9, 9]],
            [[2, 1, 9], [2, 1, 9]],
            [[9, 2, 1], [9, 2, 1]],
            // After an EOS the shift may not cross it: t_1 = t_2 = eos.
            [[4, 9, 9], [4, 9, 9]],
        ]
        .iter()
        .flat_map(|[bi, tri]| [row(*bi, 2), row(*tri, 3)].concat())
        .collect();
        assert_eq!(ids, want);
        // Running the tokens in two calls gives the same ids.
        let mut split = ngram_row_ids(&[], &[1, 2], eos, 3, 1, &m, &sizes, &offsets);
        split.extend(ngram_row_ids(
            &[1, 2],
            &[9, 4],
            eos,
            3,
            1,
            &m,
            &sizes,
            &offsets,
        ));
        assert_eq!(split, want);
    }
}
