//! The checkpoint directory writer: shards, config, tokenizer, routing model and index,
//! each file written whole or not at all.

use std::io::BufWriter;
use std::path::Path;

use serde_json::json;

use crate::atomic_file::AtomicFile;
use crate::error::{Error, Result};
use crate::routing_model::{RoutingParams, ROUTING_FILE};

use super::presets::Preset;
use super::tensors::Fill;
use super::tokenizer::write_tokenizer;
use super::writer::{fill_bf16, Filler, SafetensorsWriter};

/// Writes a `layers`-layer checkpoint of `preset` into `dir` (created if needed):
/// config.json, `model-0000i-of-0000n.safetensors` (embeddings and head first, then one
/// per layer; Qwen3.8-Flash-Next's layer 1 also holds the n-gram table, 32 GB at the
/// released shape; the vision tower last, where the preset has one), `model.safetensors.index.json`, and a byte-level tokenizer built in code
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
    let shards = layers + 1 + usize::from(preset.vision.is_some());
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
            let mut head = preset.head_tensors();
            head.extend(preset.mtp_tensors());
            head
        } else if shard <= layers {
            preset.layer_tensors(shard - 1)
        } else {
            preset.vision_tensors()
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

pub(super) fn write_json(dir: &Path, name: &str, value: &serde_json::Value) -> Result<()> {
    let path = dir.join(name);
    let out = AtomicFile::create(&path)?;
    serde_json::to_writer_pretty(out.file(), value).map_err(|e| Error::Json {
        path: path.clone(),
        message: e.to_string(),
    })?;
    out.commit()
}
