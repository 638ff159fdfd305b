//! Flash-Next's hashed n-gram table (the PLE layer's embedding), read from the SSD.
//!
//! Each token gathers `(ngram_size - 1) * heads_per_ngram` rows (16 at the released
//! shapes): heads `0..8` hash the token's bigram, heads `8..16` its trigram, and the rows
//! are concatenated in head order. The table (32 GB at 4 bits for Qwen3.8-Flash-Next) is
//! never loaded: a row is three small positional reads (packed words, scales, biases) from
//! the checkpoint's shard files, issued together through the expert source's bounded
//! reader and kept in a small FIFO row cache. Hashing follows
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
use crate::io::{DiskFile, IoMode, RangeRead, ReadAt};
use crate::records::ExpertSource;

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
#[allow(clippy::too_many_arguments)] // the hash's inputs, as transformers names them
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

/// Row-cache and read counters of one table (see [`NgramCounts`]).
#[derive(Debug, Default)]
struct NgramStats {
    hits: AtomicU64,
    misses: AtomicU64,
    bytes: AtomicU64,
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
    stats: NgramStats,
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
            let rows = w.shape.first().copied().unwrap_or(0);
            // Always quantized: without `.scales` the global pair stands, and reading the
            // parts below names the missing one.
            let spec = ckpt.quant_spec(&module, &[], rows, head_dim)?;
            let spec = spec.or(cfg.quantization.default).ok_or_else(|| {
                Error::bad_tensor(
                    &module,
                    "n-gram shards must be quantized (no quantization block in config.json)",
                )
            })?;
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
    /// dequantized (`scale * q + bias`), concatenated in head order. Rows not in the cache
    /// are read through `source` ([`ExpertSource::read_ranges`]: a pool's bounded reader),
    /// all of them at once. Errors: a failed read (named file and offset).
    pub fn embed<E: ExpertSource + ?Sized>(
        &self,
        history: &[u32],
        new: &[u32],
        source: &E,
    ) -> Result<Vec<f32>> {
        let ids = self.row_ids(history, new);
        let mut rows: HashMap<u64, Arc<[f32]>> = HashMap::with_capacity(ids.len());
        let mut missing = Vec::new();
        {
            let cache = self.cache()?;
            for &id in &ids {
                if rows.contains_key(&id) {
                    continue;
                }
                match cache.rows.get(&id) {
                    Some(row) => {
                        rows.insert(id, row.clone());
                    }
                    None => {
                        // A placeholder until read, so a repeat within the call is a hit.
                        rows.insert(id, Arc::from(Vec::new()));
                        missing.push(id);
                    }
                }
            }
        }
        let hits = ids.len() - missing.len();
        self.stats.hits.fetch_add(hits as u64, Ordering::Relaxed);
        self.stats
            .misses
            .fetch_add(missing.len() as u64, Ordering::Relaxed);
        let reads: Vec<RangeRead> = missing.iter().flat_map(|&id| self.row_reads(id)).collect();
        self.stats.bytes.fetch_add(
            reads.iter().map(|r| r.len as u64).sum::<u64>(),
            Ordering::Relaxed,
        );
        let bytes = source.read_ranges(reads)?;
        if bytes.len() != 3 * missing.len() {
            return Err(Error::Internal(format!(
                "n-gram rows: {} reads answered for {} rows",
                bytes.len(),
                missing.len()
            )));
        }
        let mut cache = self.cache()?;
        for (&id, parts) in missing.iter().zip(bytes.chunks_exact(3)) {
            let row = self.dequantize(&parts[0], &parts[1], &parts[2]);
            rows.insert(id, row.clone());
            if cache.rows.insert(id, row).is_none() {
                cache.order.push_back(id);
                if cache.order.len() > ROW_CACHE_ROWS {
                    if let Some(old) = cache.order.pop_front() {
                        cache.rows.remove(&old);
                    }
                }
            }
        }
        drop(cache);
        let mut out = Vec::with_capacity(ids.len() * self.head_dim);
        for id in ids {
            out.extend_from_slice(&rows[&id]);
        }
        Ok(out)
    }

    /// Empties the row cache (a benchmark row starts cold, as its pool does).
    /// Errors: a poisoned cache lock.
    pub fn clear_cache(&self) -> Result<()> {
        let mut cache = self.cache()?;
        cache.rows.clear();
        cache.order.clear();
        Ok(())
    }

    /// The row cache and read counters so far.
    pub fn counts(&self) -> NgramCounts {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NgramCounts {
            row_hits: get(&self.stats.hits),
            row_misses: get(&self.stats.misses),
            bytes_read: get(&self.stats.bytes),
        }
    }

    fn cache(&self) -> Result<std::sync::MutexGuard<'_, RowCache>> {
        self.cache
            .lock()
            .map_err(|_| Error::Internal("n-gram row cache poisoned".into()))
    }

    /// The three reads of row `id`: packed words, scales and biases.
    fn row_reads(&self, id: u64) -> [RangeRead; 3] {
        let shard = &self.shards[(id / self.rows_per_shard) as usize];
        let r = id % self.rows_per_shard;
        let d = self.head_dim;
        let packed_len = d / self.spec.per_word() * 4;
        let scale_len = d / self.spec.group_size * self.scale_dtype.bitsize() / 8;
        let read = |(file, base): &(Arc<dyn ReadAt>, u64), len: usize| RangeRead {
            file: file.clone(),
            offset: base + r * len as u64,
            len,
        };
        [
            read(&shard.weight, packed_len),
            read(&shard.scales, scale_len),
            read(&shard.biases, scale_len),
        ]
    }

    /// One row from its packed words, scales and biases.
    fn dequantize(&self, packed: &[u8], scales: &[u8], biases: &[u8]) -> Arc<[f32]> {
        let view = QuantView {
            spec: self.spec,
            rows: 1,
            cols: self.head_dim,
            packed,
            scales: Floats {
                dtype: self.scale_dtype,
                bytes: scales,
            },
            biases: Floats {
                dtype: self.scale_dtype,
                bytes: biases,
            },
        };
        let mut values = vec![0.0f32; self.head_dim];
        dequantize_row(&view, 0, &mut values);
        values.into()
    }
}

/// The counters of `tables` summed (a model's PLE layers); `None` without tables.
pub fn total(tables: &[Arc<NgramTable>]) -> Option<NgramCounts> {
    tables.iter().map(|t| t.counts()).reduce(|a, b| a + b)
}

/// An n-gram table's row lookups and reads so far (`/stats`, `bench`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NgramCounts {
    /// Row lookups served from the row cache (or an earlier row of the same call).
    pub row_hits: u64,
    /// Rows read from the SSD.
    pub row_misses: u64,
    /// Bytes read for those rows (packed words, scales and biases).
    pub bytes_read: u64,
}

impl std::ops::Add for NgramCounts {
    type Output = NgramCounts;
    fn add(self, o: NgramCounts) -> NgramCounts {
        NgramCounts {
            row_hits: self.row_hits + o.row_hits,
            row_misses: self.row_misses + o.row_misses,
            bytes_read: self.bytes_read + o.bytes_read,
        }
    }
}

impl std::ops::Sub for NgramCounts {
    type Output = NgramCounts;
    fn sub(self, o: NgramCounts) -> NgramCounts {
        NgramCounts {
            row_hits: self.row_hits - o.row_hits,
            row_misses: self.row_misses - o.row_misses,
            bytes_read: self.bytes_read - o.bytes_read,
        }
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
