//! Packed expert records: every record of the checkpoint in one file, contiguous, in
//! `(layer, expert)` order, each on a 4096-byte boundary and laid out exactly as in a
//! slot, so a miss is one aligned `pread` straight into the slot instead of nine.
//!
//! Files (in the model directory by default): `experts.pack` and its manifest
//! `experts.pack.json` (format version, model identity, geometry, per-layer SHA-256,
//! per-record CRC-32). The pack is written under temporary names, fsynced, verified by
//! re-reading and renamed into place, manifest last: an interrupted pack leaves nothing
//! the engine would use. Compare the reference system's `experts.bin`
//! (../shared/spec/reference-system.md B.6).

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::atomic_file::AtomicFile;
use crate::checkpoint::{slot_stride, Checkpoint, ExpertIndex};
use crate::error::{Error, Result};

/// File name of the pack inside its directory.
pub const PACK_FILE: &str = "experts.pack";
/// File name of the manifest inside its directory.
pub const MANIFEST_FILE: &str = "experts.pack.json";
const FORMAT: &str = "slotstream-pack";
const VERSION: u32 = 1;

/// The manifest, as stored in `experts.pack.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// SHA-256 (hex) over config.json, every shard's size and modification time, and
    /// every source tensor's name, shard, offset, length, shape and dtype: a pack made from
    /// another checkpoint (or other files) never matches.
    pub identity: String,
    pub moe_layers: Vec<usize>,
    pub experts: usize,
    pub record_bytes: usize,
    /// Distance between records in the file (record_bytes rounded up to 4096).
    pub stride: usize,
    pub piece_offsets: Vec<usize>,
    pub piece_lens: Vec<usize>,
    /// SHA-256 (hex) of each layer's records, in order.
    pub layer_sha256: Vec<String>,
    /// CRC-32 of each record, `[layer position][expert]`, checked on every read.
    pub record_crc32: Vec<Vec<u32>>,
}

/// The model identity a pack must carry to be used for `ckpt`.
pub fn model_identity(ckpt: &Checkpoint) -> Result<String> {
    let config = ckpt.dir.join("config.json");
    let mut h = Sha256::new();
    h.update(std::fs::read(&config).map_err(|e| Error::io(&config, e))?);
    // Size and modification time of every shard: a fine-tune copied over the same
    // layout changes them even when names, shapes and offsets stay the same.
    for shard in ckpt.shards() {
        let meta = std::fs::metadata(&shard.path).map_err(|e| Error::io(&shard.path, e))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
        h.update(format!(
            "{:?}|{}|{:?}\n",
            shard.path.file_name(),
            meta.len(),
            mtime
        ));
    }
    let mut tensors: Vec<_> = ckpt
        .tensors()
        .filter(|t| t.name.contains(".switch_mlp."))
        .collect();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    for t in tensors {
        let shard = ckpt.shards()[t.shard]
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        h.update(format!(
            "{}|{:?}|{}|{}|{:?}|{:?}\n",
            t.name, shard, t.offset, t.len, t.shape, t.dtype
        ));
    }
    Ok(hex(&h.finalize()))
}

/// `bytes` as lowercase hexadecimal, two digits a byte (digests in file names and
/// manifests).
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A validated pack: where each record is and what its checksum is.
pub struct PackedRecords {
    pub path: PathBuf,
    manifest: Manifest,
}

impl PackedRecords {
    /// Uses `dir/experts.pack` if its manifest matches `ckpt` and `index` (identity,
    /// geometry, file length); otherwise `None`, with the reason logged.
    pub fn open_if_valid(dir: &Path, ckpt: &Checkpoint, index: &ExpertIndex) -> Option<Self> {
        let manifest_path = dir.join(MANIFEST_FILE);
        if !manifest_path.exists() {
            return None;
        }
        match Self::open(dir, ckpt, index) {
            Ok(p) => {
                tracing::info!(path = %p.path.display(), "using packed expert records");
                Some(p)
            }
            Err(e) => {
                tracing::warn!(error = %e, "ignoring the expert pack; reading the shards");
                None
            }
        }
    }

    fn open(dir: &Path, ckpt: &Checkpoint, index: &ExpertIndex) -> Result<Self> {
        let manifest_path = dir.join(MANIFEST_FILE);
        let text =
            std::fs::read_to_string(&manifest_path).map_err(|e| Error::io(&manifest_path, e))?;
        let manifest: Manifest = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: manifest_path.clone(),
            message: e.to_string(),
        })?;
        let bad = |message: String| Error::Json {
            path: manifest_path.clone(),
            message,
        };
        if manifest.format != FORMAT || manifest.version != VERSION {
            return Err(bad(format!(
                "format {} v{} is not {FORMAT} v{VERSION}",
                manifest.format, manifest.version
            )));
        }
        if manifest.identity != model_identity(ckpt)? {
            return Err(bad(
                "made from another checkpoint (model identity differs)".into()
            ));
        }
        let layout = &index.layout;
        if manifest.moe_layers != index.moe_layers
            || manifest.experts != index.num_experts
            || manifest.record_bytes != layout.record_bytes
            || manifest.stride != slot_stride(layout.record_bytes)
            || manifest.piece_offsets != layout.offsets
            || manifest.piece_lens != layout.lens
            || manifest.record_crc32.len() != index.moe_layers.len()
            || manifest
                .record_crc32
                .iter()
                .any(|l| l.len() != index.num_experts)
        {
            return Err(bad("geometry differs from the checkpoint's".into()));
        }
        let path = dir.join(PACK_FILE);
        let len = std::fs::metadata(&path)
            .map_err(|e| Error::io(&path, e))?
            .len();
        let want = (index.records() * manifest.stride) as u64;
        if len != want {
            return Err(Error::io(
                &path,
                std::io::Error::other(format!("is {len} bytes, expected {want}")),
            ));
        }
        Ok(PackedRecords { path, manifest })
    }

    fn position(&self, layer: usize, expert: usize) -> Result<usize> {
        let pos = self
            .manifest
            .moe_layers
            .iter()
            .position(|&l| l == layer)
            .filter(|_| expert < self.manifest.experts)
            .ok_or_else(|| {
                Error::InvalidInput(format!(
                    "no packed record for layer {layer} expert {expert}"
                ))
            })?;
        Ok(pos * self.manifest.experts + expert)
    }

    /// Byte offset of the record of `(layer, expert)` in the pack.
    pub fn offset(&self, layer: usize, expert: usize) -> Result<u64> {
        Ok((self.position(layer, expert)? * self.manifest.stride) as u64)
    }

    /// Whether `record` has the CRC-32 the manifest gives for `(layer, expert)`.
    pub fn check(&self, layer: usize, expert: usize, record: &[u8]) -> bool {
        let Some(pos) = self.manifest.moe_layers.iter().position(|&l| l == layer) else {
            return false;
        };
        self.manifest.record_crc32[pos].get(expert) == Some(&crc32fast::hash(record))
    }
}

/// Writes the pack of `ckpt` into `out_dir` (see the module docs), with a progress bar
/// when `progress` is set. Returns the manifest.
/// Errors: I/O failures (nothing is left under the final names), or a verification
/// mismatch after writing.
pub fn pack(
    ckpt: &Checkpoint,
    index: &ExpertIndex,
    out_dir: &Path,
    progress: bool,
) -> Result<Manifest> {
    let layout = &index.layout;
    let stride = slot_stride(layout.record_bytes);
    let pack_path = out_dir.join(PACK_FILE);
    let manifest_path = out_dir.join(MANIFEST_FILE);
    let tmp_pack = AtomicFile::create(&pack_path)?;
    let bar = progress.then(|| {
        let bar = indicatif::ProgressBar::new((index.records() * layout.record_bytes) as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "packing {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    });
    let mut record = vec![0u8; stride];
    let mut layer_sha256 = Vec::with_capacity(index.moe_layers.len());
    let mut record_crc32 = Vec::with_capacity(index.moe_layers.len());
    {
        let mut out = BufWriter::with_capacity(8 << 20, tmp_pack.file());
        for &layer in &index.moe_layers {
            let mut sha = Sha256::new();
            let mut crcs = Vec::with_capacity(index.num_experts);
            for e in 0..index.num_experts {
                record.fill(0);
                index.copy_record(ckpt, layer, e, &mut record)?;
                let body = &record[..layout.record_bytes];
                sha.update(body);
                crcs.push(crc32fast::hash(body));
                out.write_all(&record)
                    .map_err(|e| Error::io(tmp_pack.temp_path(), e))?;
                if let Some(bar) = &bar {
                    bar.inc(layout.record_bytes as u64);
                }
            }
            layer_sha256.push(hex(&sha.finalize()));
            record_crc32.push(crcs);
        }
        out.flush()
            .map_err(|e| Error::io(tmp_pack.temp_path(), e))?;
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        identity: model_identity(ckpt)?,
        moe_layers: index.moe_layers.clone(),
        experts: index.num_experts,
        record_bytes: layout.record_bytes,
        stride,
        piece_offsets: layout.offsets.to_vec(),
        piece_lens: layout.lens.to_vec(),
        layer_sha256,
        record_crc32,
    };
    verify(tmp_pack.temp_path(), &manifest)?;

    // Without a manifest the engine ignores any pack, so remove the old one first: a
    // crash between the two renames below then leaves no usable pair.
    match std::fs::remove_file(&manifest_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(Error::io(&manifest_path, e))
        }
        _ => {}
    }
    tmp_pack.commit()?;
    let tmp_manifest = AtomicFile::create(&manifest_path)?;
    serde_json::to_writer_pretty(tmp_manifest.file(), &manifest).map_err(|e| Error::Json {
        path: manifest_path.clone(),
        message: e.to_string(),
    })?;
    tmp_manifest.commit()?;
    if let Ok(dir) = std::fs::File::open(out_dir) {
        let _ = dir.sync_all();
    }
    Ok(manifest)
}

/// Re-reads a written pack and checks every layer's SHA-256 against the manifest.
fn verify(path: &Path, m: &Manifest) -> Result<()> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut input = BufReader::with_capacity(8 << 20, file);
    let mut record = vec![0u8; m.stride];
    for (pos, want) in m.layer_sha256.iter().enumerate() {
        let mut sha = Sha256::new();
        for _ in 0..m.experts {
            input
                .read_exact(&mut record)
                .map_err(|e| Error::io(path, e))?;
            sha.update(&record[..m.record_bytes]);
        }
        if hex(&sha.finalize()) != *want {
            return Err(Error::io(
                path,
                std::io::Error::other(format!(
                    "verification failed for layer {}",
                    m.moe_layers[pos]
                )),
            ));
        }
    }
    Ok(())
}
