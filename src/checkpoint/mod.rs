//! Reading an MLX checkpoint directory: `config.json`, safetensors shards (through
//! `model.safetensors.index.json` or one `model.safetensors`), memory-mapped and validated.
//!
//! Headers are parsed by the `safetensors` crate, which checks that offsets are
//! contiguous and that dtype x shape equals each tensor's byte length; on top of that this
//! module checks names across shards against the index and resolves MLX quantized
//! modules (`.weight` / `.scales` / `.biases`, see ../shared/spec/models.md §3).

mod experts;
mod quant;
mod weights;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

pub use experts::{
    slot_stride, ExpertIndex, PieceKind, PieceRange, Projection, RecordLayout, ALIGN,
    PIECES_PER_RECORD,
};
pub use quant::{dequantize_row, Floats, QuantView};
pub use weights::{floats_to_f32, DenseMatrix, LinearWeight, QuantizedMatrix};

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// One memory-mapped safetensors file.
pub struct Shard {
    pub path: PathBuf,
    mmap: Mmap,
}

/// Where one tensor lives: its shard, absolute byte offset in that file, and layout.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    /// The tensor's name after the family's renames ([`ModelConfig::canonical_name`]),
    /// which is its stored name in an MLX conversion.
    pub name: String,
    /// Index into [`Checkpoint::shards`].
    pub shard: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte offset of the first element from the start of the file.
    pub offset: u64,
    /// Length in bytes (validated against dtype x shape).
    pub len: u64,
}

/// An opened, validated checkpoint. Tensor bytes stay in the page cache / on disk until
/// a caller copies them; nothing is loaded eagerly.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    shards: Vec<Shard>,
    tensors: HashMap<String, TensorEntry>,
}

/// Maps the safetensors file `path` as shard `shard` and lists its tensors under their
/// stored names. Errors: an unreadable or malformed file.
fn map_shard(path: PathBuf, shard: usize) -> Result<(Shard, Vec<TensorEntry>)> {
    let handle = File::open(&path).map_err(|e| Error::io(&path, e))?;
    // SAFETY: the map is read-only; a file truncated underneath us would fault, which is
    // the documented hazard of mmap and is why the streaming reader uses pread.
    let mmap = unsafe { Mmap::map(&handle) }.map_err(|e| Error::io(&path, e))?;
    let parsed = SafeTensors::deserialize(&mmap).map_err(|e| Error::Safetensors {
        path: path.clone(),
        message: describe_header_error(&mmap, &e),
    })?;
    let base = mmap.as_ptr() as usize;
    let entries = parsed
        .iter()
        .map(|(name, view)| TensorEntry {
            name: name.to_string(),
            shard,
            dtype: view.dtype(),
            shape: view.shape().to_vec(),
            offset: (view.data().as_ptr() as usize - base) as u64,
            len: view.data().len() as u64,
        })
        .collect();
    Ok((Shard { path, mmap }, entries))
}

/// Reads the config of the checkpoint in `dir` without touching its shards (what
/// [`Checkpoint::open`] reads first). Errors: `dir` missing or a file (a GGUF file and a
/// Hugging Face id said to be such, with what to do), no config.json, and every config
/// error of [`ModelConfig::load`].
pub fn open_config(dir: &Path) -> Result<ModelConfig> {
    let missing = |what: &str| {
        Error::io(
            dir,
            std::io::Error::new(std::io::ErrorKind::NotFound, what.to_string()),
        )
    };
    if dir.is_file() {
        if dir
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            return Err(missing(
                "is a GGUF file: slotstream reads MLX checkpoints, a directory of safetensors \
                 shards with config.json; download an MLX conversion (the mlx-community \
                 models on Hugging Face) or convert the original with `mlx_lm.convert --hf-path ORG/NAME`",
            ));
        }
        return Err(missing(
            "is a file; give the model's directory (the one holding config.json)",
        ));
    }
    if !dir.is_dir() {
        if let Some(id) = hub_id(dir) {
            return Err(missing(&format!(
                "model directory not found; `{id}` looks like a Hugging Face id: download it \
                 with `slotstream pull {id}` (then `--model {id}` finds it), or with \
                 `huggingface-cli download {id} --local-dir DIR` and give DIR"
            )));
        }
        return Err(missing(
            "model directory not found (give an MLX checkpoint's directory: `slotstream pull \
             ORG/NAME` downloads one, `slotstream synth --preset qwen3-next-80b-a3b --layers 4 \
             --out DIR` writes a synthetic one)",
        ));
    }
    if !dir.join("config.json").is_file() {
        return Err(missing("not a model directory: it has no config.json"));
    }
    ModelConfig::load(dir)
}

/// `dir` as a Hugging Face id (`org/name`: a relative path of exactly two plain parts),
/// for a path that is not on disk.
fn hub_id(dir: &Path) -> Option<&str> {
    use std::path::Component;
    let parts: Vec<Component> = dir.components().collect();
    let plain = parts.len() == 2 && parts.iter().all(|c| matches!(c, Component::Normal(_)));
    plain.then(|| dir.to_str()).flatten()
}

impl Checkpoint {
    /// Opens `dir`: reads config.json, maps every shard and validates all headers.
    ///
    /// Errors: missing directory or files (every missing shard named), a malformed index (not JSON, no `weight_map`,
    /// a tensor the index places in a shard that lacks it), truncated or malformed shards,
    /// a tensor name present in two shards, and every config error of [`ModelConfig::load`].
    pub fn open(dir: &Path) -> Result<Self> {
        let config = open_config(dir)?;
        let index_path = dir.join("model.safetensors.index.json");
        let (files, weight_map) = if index_path.exists() {
            read_index(&index_path)?
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(Error::io(
                    &single,
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "no model.safetensors and no model.safetensors.index.json",
                    ),
                ));
            }
            (vec!["model.safetensors".to_string()], None)
        };

        // Every missing shard named at once: a copy that lost several says so.
        let missing: Vec<&str> = files
            .iter()
            .filter(|f| !dir.join(f).exists())
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            return Err(Error::io(
                dir,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!(
                        "{} of {} shards missing: {}",
                        missing.len(),
                        files.len(),
                        missing.join(", ")
                    ),
                ),
            ));
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors: HashMap<String, TensorEntry> = HashMap::new();
        for (shard_idx, file) in files.iter().enumerate() {
            let (shard, entries) = map_shard(dir.join(file), shard_idx)?;
            for entry in entries {
                if let Some(prev) = tensors.get(&entry.name) {
                    return Err(Error::Safetensors {
                        path: shard.path.clone(),
                        message: format!(
                            "tensor `{}` also appears in {}",
                            entry.name, files[prev.shard]
                        ),
                    });
                }
                tensors.insert(entry.name.clone(), entry);
            }
            shards.push(shard);
        }
        if let Some(map) = weight_map {
            for (name, file) in &map {
                match tensors.get(name) {
                    Some(t) if files[t.shard] == *file => {}
                    Some(t) => {
                        return Err(Error::Json {
                            path: index_path.clone(),
                            message: format!(
                                "weight_map puts `{name}` in {file}, but it is in {}",
                                files[t.shard]
                            ),
                        })
                    }
                    None => {
                        return Err(Error::Json {
                            path: index_path.clone(),
                            message: format!(
                                "weight_map lists `{name}` in {file}, which does not contain it"
                            ),
                        })
                    }
                }
            }
        }
        // The names mlx-lm's `sanitize` gives the tensors (a no-op for the canonical MLX
        // layout of every family), so that every lookup uses one naming.
        if tensors
            .keys()
            .any(|k| config.canonical_name(k) != k.as_str())
        {
            let mut renamed: HashMap<String, TensorEntry> = HashMap::with_capacity(tensors.len());
            let mut from: HashMap<String, String> = HashMap::new();
            let mut stored: Vec<(String, TensorEntry)> = tensors.into_iter().collect();
            stored.sort_by(|a, b| a.0.cmp(&b.0));
            for (name, mut entry) in stored {
                let canonical = config.canonical_name(&name).into_owned();
                if let Some(prev) = renamed.get(&canonical) {
                    return Err(Error::Safetensors {
                        path: shards[entry.shard].path.clone(),
                        message: format!(
                            "tensor `{name}` and `{}` in {} both stand for `{canonical}` (model_type {})",
                            from[&canonical], files[prev.shard], config.model_type
                        ),
                    });
                }
                from.insert(canonical.clone(), name);
                entry.name = canonical.clone();
                renamed.insert(canonical, entry);
            }
            tensors = renamed;
        }
        tracing::debug!(dir = %dir.display(), shards = shards.len(), tensors = tensors.len(), "checkpoint opened");
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            shards,
            tensors,
        })
    }

    /// Adds the tensors of the safetensors file `path` (an MTP head shipped on its own,
    /// the reference system's `mtp.safetensors`), under the names the family's renames
    /// give them ([`ModelConfig::canonical_name`]). Errors: an unreadable or malformed
    /// file, or a tensor the checkpoint already has (nothing is added then).
    pub fn add_file(&mut self, path: &Path) -> Result<()> {
        let (shard, entries) = map_shard(path.to_path_buf(), self.shards.len())?;
        let mut added = HashMap::with_capacity(entries.len());
        for mut entry in entries {
            let name = self.config.canonical_name(&entry.name).into_owned();
            if self.tensors.contains_key(&name) || added.contains_key(&name) {
                return Err(Error::Safetensors {
                    path: shard.path.clone(),
                    message: format!("tensor `{name}` is already in the checkpoint"),
                });
            }
            entry.name = name.clone();
            added.insert(name, entry);
        }
        tracing::debug!(file = %path.display(), tensors = added.len(), "tensors added to the checkpoint");
        self.tensors.extend(added);
        self.shards.push(shard);
        Ok(())
    }

    /// The shards in index order.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Looks up a tensor by name. Errors: [`Error::MissingTensor`].
    pub fn tensor(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
        })
    }

    /// Whether the checkpoint has a tensor named `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// All tensors, in no particular order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorEntry> {
        self.tensors.values()
    }

    /// The mapped bytes of a tensor.
    pub fn bytes(&self, t: &TensorEntry) -> &[u8] {
        &self.shards[t.shard].mmap[t.offset as usize..(t.offset + t.len) as usize]
    }

    /// A floating-point tensor of exactly `shape`, converted to f32.
    /// Errors: missing, a non-float dtype, or another shape.
    pub fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        expect_shape(t, shape)?;
        floats_to_f32(t.dtype, self.bytes(t)).ok_or_else(|| {
            Error::bad_tensor(
                name,
                format!(
                    "dtype {:?} is not a float type (expected F32, F16 or BF16)",
                    t.dtype
                ),
            )
        })
    }
}

/// Errors unless `t.shape == shape`.
pub(crate) fn expect_shape(t: &TensorEntry, shape: &[usize]) -> Result<()> {
    if t.shape != shape {
        return Err(Error::bad_tensor(
            &t.name,
            format!("shape {:?}, expected {:?}", t.shape, shape),
        ));
    }
    Ok(())
}

type WeightMap = Vec<(String, String)>;

fn read_index(path: &Path) -> Result<(Vec<String>, Option<WeightMap>)> {
    let json_err = |message: String| Error::Json {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let root: Value = serde_json::from_str(&text).map_err(|e| json_err(e.to_string()))?;
    let map = root
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| json_err("missing object field `weight_map`".into()))?;
    let mut files: Vec<String> = Vec::new();
    let mut pairs = Vec::with_capacity(map.len());
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| json_err(format!("weight_map[`{name}`] is not a file name")))?;
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(json_err(format!(
                "weight_map[`{name}`] = `{file}` is not a plain file name"
            )));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
        pairs.push((name.clone(), file.to_string()));
    }
    if files.is_empty() {
        return Err(json_err("`weight_map` is empty".into()));
    }
    files.sort();
    Ok((files, Some(pairs)))
}

/// Turns a safetensors header error into a message that names the tensor at fault
/// where one can be found by re-reading the header.
fn describe_header_error(buf: &[u8], err: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    let header = || -> Option<serde_json::Map<String, Value>> {
        let n = u64::from_le_bytes(buf.get(..8)?.try_into().ok()?) as usize;
        let bytes = buf.get(8..8usize.checked_add(n)?)?;
        serde_json::from_slice::<Value>(bytes)
            .ok()?
            .as_object()
            .cloned()
    };
    match err {
        E::MetadataIncompleteBuffer => {
            let expected = header().and_then(|h| {
                let n = u64::from_le_bytes(buf[..8].try_into().ok()?) as usize;
                let end = h
                    .values()
                    .filter_map(|v| v.get("data_offsets")?.get(1)?.as_u64())
                    .max()?;
                (n as u64).checked_add(8)?.checked_add(end)
            });
            match expected {
                Some(e) => format!(
                    "file is {} bytes but its header describes {e} bytes (truncated or padded shard)",
                    buf.len()
                ),
                None => "file length does not match its header (truncated shard)".into(),
            }
        }
        E::TensorInvalidInfo => {
            let bad = header().and_then(|h| {
                h.iter().find_map(|(name, v)| {
                    let dtype: Dtype = serde_json::from_value(v.get("dtype")?.clone()).ok()?;
                    let shape: Vec<usize> = serde_json::from_value(v.get("shape")?.clone()).ok()?;
                    let off = v.get("data_offsets")?;
                    let len = off.get(1)?.as_u64()?.checked_sub(off.get(0)?.as_u64()?)?;
                    let elems = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
                    let want = elems.checked_mul(dtype.bitsize())? / 8;
                    (len != want as u64).then(|| {
                        format!("tensor `{name}`: {dtype:?} x {shape:?} needs {want} bytes but has {len}")
                    })
                })
            });
            bad.unwrap_or_else(|| "a tensor's dtype x shape does not match its byte length".into())
        }
        E::HeaderTooSmall | E::InvalidHeaderLength => {
            "file too short for a safetensors header".into()
        }
        other => format!("invalid safetensors header: {other}"),
    }
}
