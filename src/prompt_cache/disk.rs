//! Snapshot files: a prompt cache's snapshots (with their KV rows) in a directory, found
//! again after a restart.
//!
//! A file is named `<model>-<prefix>.slotsnap`: the first 8 bytes of the model identity
//! and 16 of the SHA-256 of the token ids, in hex. It is written under a temporary name
//! and renamed ([`AtomicFile`]), so a reader never sees half of one. Layout, little-endian
//! (the byte order of every target this crate builds for):
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `SLOTSNAP` |
//! | 8 | format version (u32) |
//! | 12 | CRC-32 of the header (this field zeroed), the token ids and the shapes (u32) |
//! | 16 | model identity (32 bytes, [`identity`]) |
//! | 48 | token count `n` (u64) |
//! | 56 | tensor count `m` (u64) |
//! | 64 | body bytes (u64) |
//! | 72 | CRC-32 of the body (u32) |
//! | 76 | zero (u32) |
//! | 80 | `n` token ids (u32), then `m` shapes (rows, cols: u64 each), then the body: each tensor's f32 values in order |
//!
//! Opening the directory reads every file's header, tokens and shapes and checks their
//! CRC and the file's length; loading one reads it again whole, checks the same and the
//! body's CRC, and that its tokens are the ones indexed (a file copied over another, or
//! rewritten since), then the model checks the shapes ([`Model::snapshot_from_image`]).
//! A file of another format version or another model is skipped with a warning and left
//! alone; a damaged one (truncated, a CRC that does not match, other tokens) is skipped
//! with a warning and removed. Files of
//! every model count against the directory's budget; the least recently used (by
//! modification time, which a use renews) go first.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

use crate::atomic_file::{AtomicFile, TEMP_PREFIX};
use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::model::{ImageTensor, Model, StateImage};
use crate::pack::hex;

// Values are written as the host stores them.
const _: () = assert!(cfg!(target_endian = "little"));

const MAGIC: &[u8; 8] = b"SLOTSNAP";
const VERSION: u32 = 1;
const HEADER: usize = 80;
const EXTENSION: &str = "slotsnap";
/// A temporary file older than this was left by a write that never finished.
const STALE_TEMP: Duration = Duration::from_secs(3600);

/// What a snapshot must have been computed with to be used: the checkpoint
/// ([`crate::pack::model_identity`]: config, shards, expert tensors), the synthetic
/// routing file, the norm convention and the backend (`cpu`, or the GPU adapter's name;
/// their arithmetic differs in the last bits). Errors: an unreadable config or shard.
pub(super) fn identity<B: Backend>(
    ckpt: &Checkpoint,
    model: &Model<B>,
    backend: &B,
) -> Result<[u8; 32]> {
    let mut h = Sha256::new();
    h.update(MAGIC);
    h.update(crate::pack::model_identity(ckpt)?);
    let routing = ckpt.dir.join(crate::routing_model::ROUTING_FILE);
    if let Ok(bytes) = std::fs::read(&routing) {
        h.update(bytes);
    }
    h.update(format!("{:?}", model.norms));
    // The name without what follows it in parentheses (the CPU's thread count, which
    // does not change its results; a GPU's API).
    let name = backend.name();
    h.update(name.split(" (").next().unwrap_or(&name));
    Ok(h.finalize().into())
}

/// A header as read from a file.
struct Header {
    version: u32,
    identity: [u8; 32],
    tokens: Vec<u32>,
    shapes: Vec<(usize, usize)>,
    body_bytes: u64,
    body_crc: u32,
    /// Where the body starts.
    body_at: u64,
}

/// Why a file cannot be used.
enum Unusable {
    /// Another format version or another model: left alone.
    Foreign(String),
    /// Damaged: removed.
    Damaged(String),
}

/// Reads a header, its token ids and shapes from `file` of `len` bytes, checking their
/// CRC and that the file holds exactly the body they describe.
fn read_header(file: &mut impl Read, len: u64) -> std::result::Result<Header, Unusable> {
    let damaged = |what: &str| Unusable::Damaged(what.to_string());
    let mut fixed = [0u8; HEADER];
    file.read_exact(&mut fixed)
        .map_err(|_| damaged("shorter than a header"))?;
    if &fixed[..8] != MAGIC {
        return Err(damaged("not a snapshot file"));
    }
    let u32_at = |at: usize| u32::from_le_bytes(fixed[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(fixed[at..at + 8].try_into().expect("8 bytes"));
    let version = u32_at(8);
    if version != VERSION {
        return Err(Unusable::Foreign(format!(
            "format version {version}, this build reads {VERSION}"
        )));
    }
    let (head_crc, n, m, body_bytes, body_crc) =
        (u32_at(12), u64_at(48), u64_at(56), u64_at(64), u32_at(72));
    // Every count is checked against the file's length before anything is allocated.
    let lists = n
        .checked_mul(4)
        .and_then(|t| m.checked_mul(16).and_then(|s| s.checked_add(t)));
    let total = lists
        .and_then(|l| l.checked_add(HEADER as u64))
        .and_then(|l| l.checked_add(body_bytes));
    if total != Some(len) {
        return Err(damaged(
            "its length is not what its header says (truncated?)",
        ));
    }
    let mut lists = vec![0u8; lists.expect("checked") as usize];
    file.read_exact(&mut lists)
        .map_err(|_| damaged("shorter than its header says"))?;
    let mut crc = crc32fast::Hasher::new();
    fixed[12..16].fill(0);
    crc.update(&fixed);
    crc.update(&lists);
    if crc.finalize() != head_crc {
        return Err(damaged("its header's CRC does not match"));
    }
    let (tokens, shapes) = lists.split_at(n as usize * 4);
    let tokens: Vec<u32> = tokens
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    let shapes: Vec<(usize, usize)> = shapes
        .chunks_exact(16)
        .map(|b| {
            let half = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
            (half(0) as usize, half(8) as usize)
        })
        .collect();
    let values = shapes.iter().try_fold(0u64, |sum, &(r, c)| {
        (r as u64)
            .checked_mul(c as u64)
            .and_then(|v| v.checked_mul(4))
            .and_then(|b| sum.checked_add(b))
    });
    if values != Some(body_bytes) {
        return Err(damaged("its shapes do not add up to its body"));
    }
    Ok(Header {
        version,
        identity: fixed[16..48].try_into().expect("32 bytes"),
        tokens,
        shapes,
        body_bytes,
        body_crc,
        body_at: (HEADER + lists.len()) as u64,
    })
}

/// The bytes of a snapshot file holding `image`, made for `identity`.
fn encode(image: &StateImage, identity: &[u8; 32]) -> Vec<u8> {
    let body_bytes: usize = image.tensors.iter().map(|t| t.values.len() * 4).sum();
    let mut lists = Vec::with_capacity(image.tokens.len() * 4 + image.tensors.len() * 16);
    for t in &image.tokens {
        lists.extend(t.to_le_bytes());
    }
    for t in &image.tensors {
        lists.extend((t.rows as u64).to_le_bytes());
        lists.extend((t.cols as u64).to_le_bytes());
    }
    let mut body_crc = crc32fast::Hasher::new();
    for t in &image.tensors {
        body_crc.update(bytemuck::cast_slice(&t.values));
    }
    let mut fixed = [0u8; HEADER];
    fixed[..8].copy_from_slice(MAGIC);
    fixed[8..12].copy_from_slice(&VERSION.to_le_bytes());
    fixed[16..48].copy_from_slice(identity);
    fixed[48..56].copy_from_slice(&(image.tokens.len() as u64).to_le_bytes());
    fixed[56..64].copy_from_slice(&(image.tensors.len() as u64).to_le_bytes());
    fixed[64..72].copy_from_slice(&(body_bytes as u64).to_le_bytes());
    fixed[72..76].copy_from_slice(&body_crc.finalize().to_le_bytes());
    let mut head_crc = crc32fast::Hasher::new();
    head_crc.update(&fixed);
    head_crc.update(&lists);
    fixed[12..16].copy_from_slice(&head_crc.finalize().to_le_bytes());
    let mut out = Vec::with_capacity(HEADER + lists.len() + body_bytes);
    out.extend(fixed);
    out.extend(lists);
    for t in &image.tensors {
        out.extend_from_slice(bytemuck::cast_slice(&t.values));
    }
    out
}

/// One of this model's snapshot files.
struct File {
    path: PathBuf,
    tokens: Vec<u32>,
}

/// A directory of snapshot files, as one model sees it.
pub(super) struct DiskCache {
    dir: PathBuf,
    identity: [u8; 32],
    budget: u64,
    /// This model's usable files.
    files: Vec<File>,
    /// Bytes of every snapshot file in the directory (any model's).
    folder_bytes: u64,
    /// Files skipped since opening.
    skipped: u64,
}

impl DiskCache {
    /// Indexes the snapshot files of `dir` (created if missing) made for `identity`;
    /// `budget` bounds the directory's snapshot files. Errors: the directory cannot be
    /// created or listed.
    pub(super) fn open(dir: &Path, identity: [u8; 32], budget: u64) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut cache = DiskCache {
            dir: dir.to_path_buf(),
            identity,
            budget,
            files: Vec::new(),
            folder_bytes: 0,
            skipped: 0,
        };
        for (path, meta) in cache.listing()? {
            match cache.index(&path, meta.len()) {
                Ok(tokens) => cache.files.push(File { path, tokens }),
                Err(Unusable::Foreign(why)) => {
                    cache.skipped += 1;
                    tracing::warn!(file = %path.display(), "prompt cache: skipping a snapshot file: {why}");
                }
                Err(Unusable::Damaged(why)) => {
                    cache.skipped += 1;
                    tracing::warn!(file = %path.display(), "prompt cache: removing a damaged snapshot file: {why}");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        cache.folder_bytes = cache.listing()?.iter().map(|(_, m)| m.len()).sum();
        tracing::info!(
            dir = %dir.display(),
            snapshots = cache.files.len(),
            bytes = cache.folder_bytes,
            "prompt cache directory"
        );
        Ok(cache)
    }

    /// The directory's snapshot files with their metadata; removes temporary files an
    /// interrupted write left long ago.
    fn listing(&self) -> Result<Vec<(PathBuf, std::fs::Metadata)>> {
        let entries = std::fs::read_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.is_file() {
                continue;
            }
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(TEMP_PREFIX) {
                let age = meta.modified().ok().and_then(|t| t.elapsed().ok());
                if age.is_some_and(|a| a > STALE_TEMP) {
                    let _ = std::fs::remove_file(&path);
                }
            } else if path.extension().is_some_and(|e| e == EXTENSION) {
                out.push((path, meta));
            }
        }
        Ok(out)
    }

    /// The token ids of the file at `path` if it is this model's and whole as far as its
    /// header tells.
    fn index(&self, path: &Path, len: u64) -> std::result::Result<Vec<u32>, Unusable> {
        let file = std::fs::File::open(path)
            .map_err(|e| Unusable::Foreign(format!("cannot be read: {e}")))?;
        let header = read_header(&mut std::io::BufReader::new(file), len)?;
        if header.identity != self.identity {
            return Err(Unusable::Foreign(
                "made for another model or backend".into(),
            ));
        }
        Ok(header.tokens)
    }

    /// The file with the most tokens, at least `least`, that start `prompt` and are fewer
    /// than it.
    pub(super) fn longest(&self, prompt: &[u32], least: usize) -> Option<usize> {
        (0..self.files.len())
            .filter(|&i| {
                let t = &self.files[i].tokens;
                t.len() >= least && t.len() < prompt.len() && prompt.starts_with(t)
            })
            .max_by_key(|&i| self.files[i].tokens.len())
    }

    /// Where file `i` is.
    pub(super) fn path(&self, i: usize) -> &Path {
        &self.files[i].path
    }

    /// The file of exactly `tokens`.
    pub(super) fn find(&self, tokens: &[u32]) -> Option<usize> {
        self.files.iter().position(|f| f.tokens == tokens)
    }

    /// File `i` read whole and checked (and marked as just used). Errors: a read failure,
    /// a file changed since it was indexed (other tokens than the index's: another
    /// prompt's snapshot copied over it, or rewritten while it is read), a body whose CRC
    /// does not match.
    pub(super) fn load(&mut self, i: usize) -> Result<StateImage> {
        let path = &self.files[i].path;
        let bad = |why: &str| Error::InvalidInput(format!("{}: {why}", path.display()));
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let header = read_header(&mut &bytes[..], bytes.len() as u64).map_err(|u| match u {
            Unusable::Foreign(why) | Unusable::Damaged(why) => bad(&why),
        })?;
        if header.identity != self.identity || header.version != VERSION {
            return Err(bad("made for another model or backend"));
        }
        if header.tokens != self.files[i].tokens {
            return Err(bad(
                "changed since it was indexed: it holds the snapshot of other tokens",
            ));
        }
        let body = &bytes[header.body_at as usize..];
        debug_assert_eq!(body.len() as u64, header.body_bytes);
        if crc32fast::hash(body) != header.body_crc {
            return Err(bad("its body's CRC does not match"));
        }
        let mut tensors = Vec::with_capacity(header.shapes.len());
        let mut at = 0;
        for (rows, cols) in header.shapes {
            let n = rows * cols * 4;
            tensors.push(ImageTensor {
                rows,
                cols,
                values: bytemuck::pod_collect_to_vec(&body[at..at + n]),
            });
            at += n;
        }
        touch(path);
        Ok(StateImage {
            tokens: header.tokens,
            tensors,
        })
    }

    /// Stops using file `i` and deletes it (it cannot be used).
    pub(super) fn delete(&mut self, i: usize) {
        let file = self.files.swap_remove(i);
        self.skipped += 1;
        if let Ok(meta) = std::fs::metadata(&file.path) {
            self.folder_bytes = self.folder_bytes.saturating_sub(meta.len());
        }
        let _ = std::fs::remove_file(&file.path);
    }

    /// Writes `image` (unless a file of the same tokens is there: then it counts as used),
    /// first removing the least recently used files until it fits the budget. A snapshot
    /// larger than the whole budget is not written. Errors: the file cannot be written.
    pub(super) fn write(&mut self, image: &StateImage) -> Result<()> {
        if let Some(f) = self.files.iter().find(|f| f.tokens == image.tokens) {
            touch(&f.path);
            return Ok(());
        }
        let bytes = encode(image, &self.identity);
        if bytes.len() as u64 > self.budget {
            tracing::debug!(
                bytes = bytes.len(),
                budget = self.budget,
                "prompt cache: a snapshot larger than the disk budget is not written"
            );
            return Ok(());
        }
        self.make_room(bytes.len() as u64)?;
        let tokens: Vec<u8> = image.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let name = format!(
            "{}-{}.{EXTENSION}",
            hex(&self.identity[..8]),
            hex(&Sha256::digest(&tokens)[..16])
        );
        let path = self.dir.join(name);
        let out = AtomicFile::create(&path)?;
        out.file()
            .write_all(&bytes)
            .map_err(|e| Error::io(out.temp_path(), e))?;
        out.commit()?;
        self.folder_bytes += bytes.len() as u64;
        self.files.push(File {
            path,
            tokens: image.tokens.clone(),
        });
        Ok(())
    }

    /// Removes the least recently used snapshot files (any model's) until `more` bytes fit
    /// the budget.
    fn make_room(&mut self, more: u64) -> Result<()> {
        let mut listing = self.listing()?;
        self.folder_bytes = listing.iter().map(|(_, m)| m.len()).sum();
        listing.sort_by_key(|(_, m)| m.modified().unwrap_or(SystemTime::UNIX_EPOCH));
        for (path, meta) in listing {
            if self.folder_bytes + more <= self.budget {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                self.folder_bytes -= meta.len();
                self.files.retain(|f| f.path != path);
            }
        }
        Ok(())
    }

    /// This model's usable files.
    pub(super) fn files(&self) -> usize {
        self.files.len()
    }

    pub(super) fn folder_bytes(&self) -> u64 {
        self.folder_bytes
    }

    pub(super) fn skipped(&self) -> u64 {
        self.skipped
    }
}

/// Marks a file as just used (its modification time orders evictions); a failure only
/// makes it look older.
fn touch(path: &Path) {
    if let Ok(f) = std::fs::File::options().append(true).open(path) {
        let _ = f.set_modified(SystemTime::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> StateImage {
        StateImage {
            tokens: vec![3, 1, 4, 1, 5],
            tensors: vec![
                ImageTensor {
                    rows: 2,
                    cols: 3,
                    values: vec![0.5, -1.0, 2.0, 3.25, f32::MIN_POSITIVE, -0.0],
                },
                ImageTensor {
                    rows: 0,
                    cols: 8,
                    values: vec![],
                },
            ],
        }
    }

    #[test]
    fn a_file_reads_back_and_any_flipped_byte_or_cut_is_caught() {
        let identity = [7u8; 32];
        let bytes = encode(&image(), &identity);
        let header = read_header(&mut &bytes[..], bytes.len() as u64)
            .ok()
            .unwrap();
        assert_eq!(header.tokens, image().tokens);
        assert_eq!(header.shapes, vec![(2, 3), (0, 8)]);
        assert_eq!(header.identity, identity);
        let body = &bytes[header.body_at as usize..];
        assert_eq!(crc32fast::hash(body), header.body_crc);
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x10;
            let caught = match read_header(&mut &bad[..], bad.len() as u64) {
                Err(_) => true,
                Ok(h) => crc32fast::hash(&bad[h.body_at as usize..]) != h.body_crc,
            };
            assert!(caught, "a flip at byte {at} passed");
        }
        for len in 0..bytes.len() {
            assert!(
                read_header(&mut &bytes[..len], len as u64).is_err(),
                "cut at {len}"
            );
        }
    }
}
