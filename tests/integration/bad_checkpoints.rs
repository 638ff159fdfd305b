//! Corrupted checkpoints: each test damages a temporary copy of a committed fixture and
//! checks that `Checkpoint::open` / `Model::load` return an error (never a panic) whose
//! text names the file, tensor or field at fault.

use std::fs;
use std::path::{Path, PathBuf};

use crate::common::{
    copy_fixture, edit_json, read_json, read_shard, rewrite_shard, shard_of, Owned, INDEX,
};
use safetensors::Dtype;
use serde_json::{json, Map, Value};
use slotstream::backend::cpu::CpuBackend;
use slotstream::checkpoint::Checkpoint;
use slotstream::model::Model;
use slotstream::Error;

/// One `model.safetensors` plus an index.
const BF16: &str = "qwen3-next-bf16";
/// Five shards plus an index.
const SHARDED: &str = "qwen3-next-f32-sharded";
/// Qwen3.5-MoE (`qwen3_5_moe`): one `model.safetensors` plus an index, `language_model.` keys.
const QWEN35: &str = "qwen3_5-moe-bf16";

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// The CPU backend's teacher-forced logits of a fixed 24-token sequence on the checkpoint
/// in `dir` (panics, naming the error, if it does not load).
fn cpu_logits(dir: &Path) -> Vec<f32> {
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 % 500) as u32).collect();
    let ckpt = std::sync::Arc::new(Checkpoint::open(dir).unwrap_or_else(|e| panic!("{e}")));
    let model = Model::<CpuBackend>::load(&ckpt, &CpuBackend).unwrap_or_else(|e| panic!("{e}"));
    let experts = slotstream::experts::MappedExperts::new(
        ckpt.clone(),
        std::sync::Arc::new(model.experts.clone()),
    );
    slotstream::score::score(&model, &CpuBackend, &experts, &ids)
        .unwrap()
        .logits
}

/// Edits the JSON header of a safetensors file in place, keeping the data bytes as they
/// are: the way to declare a dtype or shape that does not match the data.
fn edit_header(path: &Path, edit: impl FnOnce(&mut Map<String, Value>)) {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(header.as_object_mut().unwrap());
    let mut text = serde_json::to_vec(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + n..]);
    fs::write(path, out).unwrap();
}

/// Replaces the header of `path` with `header` followed by `data_len` zero bytes.
fn write_raw_shard(path: &Path, header: &Value, data_len: usize) {
    let mut text = serde_json::to_vec(header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(vec![0u8; data_len]);
    fs::write(path, out).unwrap();
}

/// Drops `tensor` from the shard holding it and from the index.
fn remove_tensor(dir: &Path, tensor: &str) {
    let shard = dir.join(shard_of(dir, tensor));
    rewrite_shard(&shard, |ts| {
        let before = ts.len();
        ts.retain(|t| t.name != tensor);
        assert_eq!(
            ts.len() + 1,
            before,
            "test bug: {tensor} not in {}",
            shard.display()
        );
    });
    edit_json(&dir.join(INDEX), |v| {
        v["weight_map"]
            .as_object_mut()
            .unwrap()
            .remove(tensor)
            .unwrap();
    });
}

/// Sets `dtype` and/or `shape` of `tensor` in its shard's header, leaving the data alone.
fn redeclare(dir: &Path, tensor: &str, dtype: Option<&str>, shape: Option<&[usize]>) {
    let shard = dir.join(shard_of(dir, tensor));
    edit_header(&shard, |h| {
        let info = h
            .get_mut(tensor)
            .unwrap_or_else(|| panic!("test bug: {tensor} not in header"));
        if let Some(d) = dtype {
            info["dtype"] = json!(d);
        }
        if let Some(s) = shape {
            info["shape"] = json!(s);
        }
    });
}

/// `Checkpoint::open` must fail; returns its error.
fn open_err(dir: &Path) -> Error {
    match Checkpoint::open(dir) {
        Ok(_) => panic!(
            "Checkpoint::open accepted the corrupted checkpoint {}",
            dir.display()
        ),
        Err(e) => e,
    }
}

/// `Checkpoint::open` must succeed and `Model::load` fail; returns the load error.
fn load_err(dir: &Path) -> Error {
    let ckpt =
        Checkpoint::open(dir).unwrap_or_else(|e| panic!("Checkpoint::open failed early: {e}"));
    match Model::<CpuBackend>::load(&ckpt, &CpuBackend) {
        Ok(_) => panic!(
            "Model::load accepted the corrupted checkpoint {}",
            dir.display()
        ),
        Err(e) => e,
    }
}

fn file_name(p: &Path) -> PathBuf {
    PathBuf::from(p.file_name().unwrap())
}

// ---------------------------------------------------------------------------------------
// Positive control
// ---------------------------------------------------------------------------------------

#[test]
fn untouched_fixture_copies_open_and_load() {
    for name in [BF16, SHARDED, QWEN35] {
        let tmp = copy_fixture(name);
        let ckpt = Checkpoint::open(tmp.path()).unwrap_or_else(|e| panic!("{name}: {e}"));
        Model::<CpuBackend>::load(&ckpt, &CpuBackend).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn shards_rewritten_without_changes_still_load() {
    // Control for the helpers: a round trip through the safetensors writer is harmless,
    // so every failure below comes from the deliberate damage.
    for name in [BF16, SHARDED] {
        let tmp = copy_fixture(name);
        for entry in fs::read_dir(tmp.path()).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|e| e == "safetensors") {
                rewrite_shard(&p, |_| {});
                edit_header(&p, |_| {});
            }
        }
        let ckpt = Checkpoint::open(tmp.path()).unwrap_or_else(|e| panic!("{name}: {e}"));
        Model::<CpuBackend>::load(&ckpt, &CpuBackend).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

// ---------------------------------------------------------------------------------------
// 1. Truncated shards
// ---------------------------------------------------------------------------------------

fn truncate(path: &Path, cut: u64) {
    let len = fs::metadata(path).unwrap().len();
    let f = fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len(len.saturating_sub(cut)).unwrap();
}

#[test]
fn truncated_single_shard_is_named() {
    let tmp = copy_fixture(BF16);
    truncate(&tmp.path().join("model.safetensors"), 1000);
    let e = open_err(tmp.path());
    let msg = e.to_string();
    assert!(matches!(e, Error::Safetensors { .. }), "{msg}");
    assert!(
        msg.contains("model.safetensors") && msg.contains("truncated"),
        "{msg}"
    );
}

#[test]
fn truncated_shard_of_sharded_checkpoint_is_named() {
    let tmp = copy_fixture(SHARDED);
    truncate(&tmp.path().join("model-00003-of-00005.safetensors"), 1000);
    let msg = open_err(tmp.path()).to_string();
    assert!(
        msg.contains("model-00003-of-00005.safetensors") && msg.contains("truncated"),
        "{msg}"
    );
}

#[test]
fn shard_truncated_inside_its_header_is_named() {
    let tmp = copy_fixture(SHARDED);
    let p = tmp.path().join("model-00002-of-00005.safetensors");
    let len = fs::metadata(&p).unwrap().len();
    truncate(&p, len - 100);
    let msg = open_err(tmp.path()).to_string();
    assert!(msg.contains("model-00002-of-00005.safetensors"), "{msg}");
}

#[test]
fn empty_shard_is_named() {
    let tmp = copy_fixture(SHARDED);
    fs::write(tmp.path().join("model-00005-of-00005.safetensors"), b"").unwrap();
    let msg = open_err(tmp.path()).to_string();
    assert!(msg.contains("model-00005-of-00005.safetensors"), "{msg}");
}

#[test]
fn padded_shard_is_named() {
    let tmp = copy_fixture(BF16);
    let p = tmp.path().join("model.safetensors");
    let mut bytes = fs::read(&p).unwrap();
    bytes.extend([0u8; 64]);
    fs::write(&p, bytes).unwrap();
    let msg = open_err(tmp.path()).to_string();
    assert!(
        msg.contains("model.safetensors") && msg.contains("padded"),
        "{msg}"
    );
}

// ---------------------------------------------------------------------------------------
// 2. Missing tensors
// ---------------------------------------------------------------------------------------

fn assert_missing(dir: &Path, tensor: &str) {
    let e = load_err(dir);
    let msg = e.to_string();
    assert!(
        matches!(&e, Error::MissingTensor { name } if name == tensor),
        "{msg}"
    );
    assert!(msg.contains(tensor), "{msg}");
}

#[test]
fn missing_tensor_single_file() {
    let tmp = copy_fixture(BF16);
    remove_tensor(tmp.path(), "model.layers.1.linear_attn.A_log");
    assert_missing(tmp.path(), "model.layers.1.linear_attn.A_log");
}

#[test]
fn missing_tensor_sharded() {
    let tmp = copy_fixture(SHARDED);
    remove_tensor(tmp.path(), "model.layers.3.self_attn.q_norm.weight");
    assert_missing(tmp.path(), "model.layers.3.self_attn.q_norm.weight");
}

#[test]
fn missing_quantization_scales() {
    let tmp = copy_fixture(BF16);
    // The config's per-module entry says the router is quantized, so its scales are required.
    remove_tensor(tmp.path(), "model.layers.2.mlp.gate.scales");
    assert_missing(tmp.path(), "model.layers.2.mlp.gate.scales");
}

#[test]
fn missing_qwen35_projection_is_named() {
    // The split gated-DeltaNet projections (one case per projection), the router and an
    // expert piece, under the `language_model.` prefix.
    for tensor in [
        "language_model.model.layers.0.linear_attn.in_proj_qkv.weight",
        "language_model.model.layers.1.linear_attn.in_proj_z.scales",
        "language_model.model.layers.2.linear_attn.in_proj_b.weight",
        "language_model.model.layers.1.linear_attn.in_proj_a.biases",
        "language_model.model.layers.3.mlp.gate.weight",
        "language_model.model.layers.2.mlp.switch_mlp.down_proj.scales",
    ] {
        let tmp = copy_fixture(QWEN35);
        remove_tensor(tmp.path(), tensor);
        if tensor.ends_with(".scales") && !tensor.contains("switch_mlp") {
            // Without scales (and no per-module config entry) the module reads as dense, as
            // in mlx-lm's load_model, so the packed weight's shape is what is wrong.
            let msg = load_err(tmp.path()).to_string();
            let weight = tensor.replace(".scales", ".weight");
            assert!(
                msg.contains(&weight) && msg.contains("shape"),
                "{tensor}: {msg}"
            );
        } else {
            assert_missing(tmp.path(), tensor);
        }
    }
}

#[test]
fn qwen35_config_with_qwen3_next_projection_names_the_missing_split_tensor() {
    // A Qwen3-Next body under a qwen3_5_moe config: the first split projection is named.
    let tmp = copy_fixture(BF16);
    let cfg = read_json(&tmp.path().join("config.json"));
    let mut text = cfg.clone();
    text.as_object_mut().unwrap().remove("quantization");
    text.as_object_mut().unwrap().remove("quantization_config");
    edit_json(&tmp.path().join("config.json"), |v| {
        *v = json!({
            "model_type": "qwen3_5_moe",
            "text_config": text,
            "quantization": cfg["quantization"],
        });
    });
    let e = load_err(tmp.path());
    let msg = e.to_string();
    assert!(
        msg.contains("language_model.model.layers.0.linear_attn.in_proj_qkv.weight"),
        "{msg}"
    );
}

/// mlx-lm's qwen3_5_moe `sanitize` accepts keys without the `language_model.` prefix and
/// Hugging Face's `model.language_model.` ones; both load, and give the same logits.
#[test]
fn qwen35_keys_in_other_spellings_load_as_mlx_lm_renames_them() {
    let want = cpu_logits(copy_fixture(QWEN35).path());
    type Respelling = (&'static str, fn(&str) -> String);
    let respell: [Respelling; 2] = [
        ("unprefixed", |n| {
            n.strip_prefix("language_model.").unwrap().to_string()
        }),
        ("hugging face", |n| {
            n.replace("language_model.model.", "model.language_model.")
                .replace("language_model.lm_head", "lm_head")
        }),
    ];
    for (what, rename) in respell {
        let tmp = copy_fixture(QWEN35);
        rewrite_shard(&tmp.path().join("model.safetensors"), |ts| {
            for t in ts.iter_mut() {
                t.name = rename(&t.name);
            }
        });
        fs::remove_file(tmp.path().join(INDEX)).unwrap();
        assert!(cpu_logits(tmp.path()) == want, "{what}: logits differ");
    }
    // Two spellings of one tensor are refused, naming both.
    let tmp = copy_fixture(QWEN35);
    rewrite_shard(&tmp.path().join("model.safetensors"), |ts| {
        let norm = ts
            .iter()
            .find(|t| t.name == "language_model.model.norm.weight")
            .unwrap();
        let dup = Owned {
            name: "model.norm.weight".into(),
            dtype: norm.dtype,
            shape: norm.shape.clone(),
            data: norm.data.clone(),
        };
        ts.push(dup);
    });
    fs::remove_file(tmp.path().join(INDEX)).unwrap();
    let msg = open_err(tmp.path()).to_string();
    assert!(
        msg.contains("`model.norm.weight`") && msg.contains("`language_model.model.norm.weight`"),
        "{msg}"
    );
}

/// A mixed-precision conversion: every shared expert's `up_proj` rewritten from 4-bit to
/// 8-bit with the same values (`q8 = 17 q4`, `scale8 = scale4 / 17`, f32 scales), its gate
/// left at 4 bits, so gate and up cannot be stacked into one quantized weight. The model
/// loads and gives the logits of the untouched checkpoint.
#[test]
fn shared_expert_with_gate_and_up_quantized_differently_loads() {
    let want = cpu_logits(copy_fixture(SHARDED).path());
    let tmp = copy_fixture(SHARDED);
    let layers = read_json(&tmp.path().join("config.json"))["num_hidden_layers"]
        .as_u64()
        .unwrap();
    for layer in 0..layers {
        let module = format!("model.layers.{layer}.mlp.shared_expert.up_proj");
        let shard = tmp
            .path()
            .join(shard_of(tmp.path(), &format!("{module}.weight")));
        rewrite_shard(&shard, |ts| {
            for t in ts.iter_mut() {
                if t.name == format!("{module}.weight") {
                    let words: Vec<u32> = bytemuck::pod_collect_to_vec(&t.data);
                    let q4 = words
                        .iter()
                        .flat_map(|w| (0..8).map(move |j| (w >> (4 * j)) & 15));
                    let q8: Vec<u32> = q4.map(|q| 17 * q).collect();
                    let packed: Vec<u32> = q8
                        .chunks(4)
                        .map(|c| c.iter().enumerate().fold(0, |w, (j, q)| w | (q << (8 * j))))
                        .collect();
                    t.shape[1] *= 2;
                    t.data = bytemuck::cast_slice(&packed).to_vec();
                } else if t.name == format!("{module}.scales") {
                    assert_eq!(t.dtype, Dtype::F32, "the fixture's scales are f32");
                    let scales: Vec<f32> = bytemuck::pod_collect_to_vec(&t.data);
                    let scaled: Vec<f32> = scales.iter().map(|s| s / 17.0).collect();
                    t.data = bytemuck::cast_slice(&scaled).to_vec();
                }
            }
        });
        edit_json(&tmp.path().join("config.json"), |v| {
            let group = v["quantization"]["group_size"].clone();
            v["quantization"][&module] = json!({"group_size": group, "bits": 8});
        });
    }
    let got = cpu_logits(tmp.path());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(&want) {
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    let err = (num / den).sqrt();
    assert!(
        err < 1e-5,
        "logits differ from the untouched checkpoint's by {err:e}"
    );
}

/// Without per-module overrides in config.json, bits and group size come from the stored
/// shapes: the routers and shared-expert gates are 8-bit (the global pair is 4-bit), and
/// every fixture family still gives the logits of the untouched checkpoint.
#[test]
fn quantization_without_overrides_is_inferred_from_the_shapes() {
    for name in [BF16, SHARDED, QWEN35] {
        let want = cpu_logits(copy_fixture(name).path());
        let tmp = copy_fixture(name);
        let mut removed = 0;
        edit_json(&tmp.path().join("config.json"), |v| {
            let q = match v.get_mut("quantization") {
                Some(q) => q,
                None => &mut v["text_config"]["quantization"],
            };
            let q = q.as_object_mut().unwrap();
            let before = q.len();
            q.retain(|_, entry| !entry.is_object());
            removed = before - q.len();
            v.as_object_mut().unwrap().remove("quantization_config");
        });
        assert!(removed >= 8, "{name}: {removed} overrides removed");
        assert!(cpu_logits(tmp.path()) == want, "{name}: logits differ");
    }
}

/// Shapes that no supported pair explains are refused, naming the tensor that differs
/// from what the global pair expects and both stored shapes: scales of group size 16 for
/// an 8-bit router with its override removed (the 8-bit weight is what differs from the
/// global 4-bit pair's expectation).
#[test]
fn quantization_no_pair_explains_is_refused_with_both_shapes() {
    let tmp = copy_fixture(BF16);
    let module = "model.layers.1.mlp.gate";
    edit_json(&tmp.path().join("config.json"), |v| {
        v["quantization"].as_object_mut().unwrap().remove(module);
        v.as_object_mut().unwrap().remove("quantization_config");
    });
    let shard = tmp
        .path()
        .join(shard_of(tmp.path(), &format!("{module}.weight")));
    let mut scales = Vec::new();
    let weight = read_shard(&shard)
        .0
        .into_iter()
        .find(|t| t.name == format!("{module}.weight"))
        .unwrap()
        .shape;
    rewrite_shard(&shard, |ts| {
        for t in ts.iter_mut() {
            if t.name == format!("{module}.scales") || t.name == format!("{module}.biases") {
                // 8-bit words hold 4 values: group size 16 is `inp / 16` groups per row.
                t.shape[1] = weight[1] * 4 / 16;
                t.data = vec![0; t.shape.iter().product::<usize>() * t.dtype.bitsize() / 8];
                scales = t.shape.clone();
            }
        }
    });
    assert!(!scales.is_empty(), "test bug: {module} not rewritten");
    let e = load_err(tmp.path());
    let msg = e.to_string();
    // The 8-bit weight is not what the global 4-bit pair expects: it is the one named.
    let name = format!("{module}.weight");
    assert!(
        matches!(&e, Error::BadTensor { name: n, .. } if *n == name),
        "{msg}"
    );
    for needle in [
        format!("`{module}.weight` {weight:?}"),
        format!("`{module}.scales` {scales:?}"),
        "no supported quantization".into(),
    ] {
        assert!(msg.contains(&needle), "{needle}: {msg}");
    }
}

#[test]
fn missing_expert_piece() {
    let tmp = copy_fixture(SHARDED);
    remove_tensor(tmp.path(), "model.layers.2.mlp.switch_mlp.up_proj.biases");
    assert_missing(tmp.path(), "model.layers.2.mlp.switch_mlp.up_proj.biases");
}

// ---------------------------------------------------------------------------------------
// 3. Wrong shapes (byte length consistent with the declared dtype x shape)
// ---------------------------------------------------------------------------------------

fn assert_bad_shape(dir: &Path, tensor: &str, got: &str, want: &str) {
    let e = load_err(dir);
    let msg = e.to_string();
    assert!(
        matches!(&e, Error::BadTensor { name, .. } if name == tensor),
        "{msg}"
    );
    assert!(
        msg.contains(tensor) && msg.contains(got) && msg.contains(want),
        "{msg}"
    );
}

#[test]
fn wrong_shape_norm_weight() {
    let tmp = copy_fixture(BF16);
    redeclare(tmp.path(), "model.norm.weight", None, Some(&[64, 2]));
    assert_bad_shape(tmp.path(), "model.norm.weight", "[64, 2]", "[128]");
}

#[test]
fn wrong_shape_scales() {
    let tmp = copy_fixture(BF16);
    let t = "model.layers.1.linear_attn.in_proj_qkvz.scales";
    redeclare(tmp.path(), t, None, Some(&[768, 1]));
    assert_bad_shape(tmp.path(), t, "[768, 1]", "[384, 2]");
}

#[test]
fn wrong_shape_packed_weight() {
    let tmp = copy_fixture(SHARDED);
    let t = "model.layers.0.linear_attn.out_proj.weight";
    redeclare(tmp.path(), t, None, Some(&[64, 32]));
    assert_bad_shape(tmp.path(), t, "[64, 32]", "[128, 16]");
}

#[test]
fn wrong_shape_expert_weight() {
    let tmp = copy_fixture(SHARDED);
    let t = "model.layers.0.mlp.switch_mlp.gate_proj.weight";
    redeclare(tmp.path(), t, None, Some(&[16, 128, 8]));
    assert_bad_shape(tmp.path(), t, "[16, 128, 8]", "[16, 64, 16]");
}

#[test]
fn header_shape_disagreeing_with_byte_length_is_named() {
    // Here dtype x shape does NOT match the stored bytes: caught when the header is parsed.
    let tmp = copy_fixture(SHARDED);
    let t = "model.layers.3.self_attn.q_norm.weight";
    redeclare(tmp.path(), t, None, Some(&[32]));
    let shard = shard_of(tmp.path(), t);
    let msg = open_err(tmp.path()).to_string();
    assert!(msg.contains(&shard) && msg.contains(t), "{msg}");
}

// ---------------------------------------------------------------------------------------
// 4. Wrong dtypes
// ---------------------------------------------------------------------------------------

fn assert_bad_dtype(dir: &Path, tensor: &str, dtype: &str) {
    let e = load_err(dir);
    let msg = e.to_string();
    assert!(
        matches!(&e, Error::BadTensor { name, .. } if name == tensor),
        "{msg}"
    );
    assert!(msg.contains(tensor) && msg.contains(dtype), "{msg}");
}

#[test]
fn quantized_weight_stored_as_f32() {
    let tmp = copy_fixture(BF16);
    let t = "model.layers.0.linear_attn.in_proj_qkvz.weight";
    // Same 4-byte elements, same shape: only the declared dtype changes.
    redeclare(tmp.path(), t, Some("F32"), None);
    assert_bad_dtype(tmp.path(), t, "F32");
    let msg = load_err(tmp.path()).to_string();
    assert!(msg.contains("U32"), "{msg}");
}

#[test]
fn expert_weight_stored_as_f32() {
    let tmp = copy_fixture(SHARDED);
    let t = "model.layers.1.mlp.switch_mlp.down_proj.weight";
    redeclare(tmp.path(), t, Some("F32"), None);
    assert_bad_dtype(tmp.path(), t, "F32");
}

#[test]
fn norm_weight_stored_as_i32() {
    let tmp = copy_fixture(SHARDED);
    redeclare(tmp.path(), "model.norm.weight", Some("I32"), None);
    assert_bad_dtype(tmp.path(), "model.norm.weight", "I32");
}

#[test]
fn norm_weight_stored_as_i16() {
    // BF16 -> I16: same size, so the header stays consistent.
    let tmp = copy_fixture(BF16);
    redeclare(
        tmp.path(),
        "model.layers.3.self_attn.q_norm.weight",
        Some("I16"),
        None,
    );
    assert_bad_dtype(tmp.path(), "model.layers.3.self_attn.q_norm.weight", "I16");
}

#[test]
fn scales_stored_as_i32() {
    let tmp = copy_fixture(SHARDED);
    let t = "model.layers.1.linear_attn.out_proj.scales";
    redeclare(tmp.path(), t, Some("I32"), None);
    assert_bad_dtype(tmp.path(), t, "I32");
}

#[test]
fn biases_dtype_differing_from_scales() {
    let tmp = copy_fixture(BF16);
    let t = "model.layers.1.mlp.shared_expert.up_proj.biases";
    redeclare(tmp.path(), t, Some("F16"), None);
    assert_bad_dtype(tmp.path(), t, "F16");
}

// ---------------------------------------------------------------------------------------
// 5-6. config.json
// ---------------------------------------------------------------------------------------

#[test]
fn unknown_model_type_is_named_with_supported_list() {
    let tmp = copy_fixture(BF16);
    edit_json(&tmp.path().join("config.json"), |v| {
        v["model_type"] = json!("llama_moe_xl")
    });
    let e = open_err(tmp.path());
    let msg = e.to_string();
    assert!(matches!(e, Error::UnsupportedModel { .. }), "{msg}");
    assert!(
        msg.contains("config.json")
            && msg.contains("llama_moe_xl")
            && msg.contains("qwen3_next")
            && msg.contains("qwen3_5_moe"),
        "{msg}"
    );
}

#[test]
fn unsupported_bits_is_named() {
    let tmp = copy_fixture(BF16);
    edit_json(&tmp.path().join("config.json"), |v| {
        v["quantization"]["bits"] = json!(3);
        v["quantization_config"]["bits"] = json!(3);
    });
    let e = open_err(tmp.path());
    let msg = e.to_string();
    assert!(matches!(e, Error::Config { .. }), "{msg}");
    assert!(
        msg.contains("config.json") && msg.contains("3-bit") && msg.contains("quantization"),
        "{msg}"
    );
}

#[test]
fn unsupported_bits_in_per_module_entry_names_the_module() {
    let tmp = copy_fixture(SHARDED);
    edit_json(&tmp.path().join("config.json"), |v| {
        v["quantization"]["model.layers.2.mlp.gate"]["bits"] = json!(3);
    });
    let msg = open_err(tmp.path()).to_string();
    assert!(
        msg.contains("3-bit") && msg.contains("quantization.model.layers.2.mlp.gate"),
        "{msg}"
    );
}

#[test]
fn out_of_range_bits_is_rejected() {
    // 2^32 + 4 must not be read as 4 bits.
    let tmp = copy_fixture(BF16);
    edit_json(&tmp.path().join("config.json"), |v| {
        v["quantization"]["bits"] = json!(4_294_967_300u64)
    });
    let msg = open_err(tmp.path()).to_string();
    assert!(
        msg.contains("config.json") && msg.contains("quantization"),
        "{msg}"
    );
}

#[test]
fn malformed_config_is_named() {
    let tmp = copy_fixture(SHARDED);
    fs::write(
        tmp.path().join("config.json"),
        "{\"model_type\": \"qwen3_next\",",
    )
    .unwrap();
    let msg = open_err(tmp.path()).to_string();
    assert!(msg.contains("config.json"), "{msg}");
}

#[test]
fn zero_layer_intervals_are_named() {
    for field in ["decoder_sparse_step", "full_attention_interval"] {
        let tmp = copy_fixture(SHARDED);
        edit_json(&tmp.path().join("config.json"), |v| v[field] = json!(0));
        let msg = open_err(tmp.path()).to_string();
        assert!(msg.contains("config.json"), "{field}: {msg}");
        assert!(msg.contains(field), "{msg}");
    }
}

// ---------------------------------------------------------------------------------------
// 7. model.safetensors.index.json
// ---------------------------------------------------------------------------------------

fn assert_index_err(dir: &Path, also: &[&str]) {
    let e = open_err(dir);
    let msg = e.to_string();
    assert!(matches!(e, Error::Json { .. }), "{msg}");
    assert!(msg.contains(INDEX), "{msg}");
    for s in also {
        assert!(msg.contains(s), "expected {s:?} in: {msg}");
    }
}

#[test]
fn index_not_json() {
    let tmp = copy_fixture(SHARDED);
    fs::write(tmp.path().join(INDEX), "this is not JSON {").unwrap();
    assert_index_err(tmp.path(), &[]);
}

#[test]
fn index_without_weight_map() {
    let tmp = copy_fixture(SHARDED);
    edit_json(&tmp.path().join(INDEX), |v| {
        v.as_object_mut().unwrap().remove("weight_map").unwrap();
    });
    assert_index_err(tmp.path(), &["weight_map"]);
}

#[test]
fn index_with_empty_weight_map() {
    let tmp = copy_fixture(BF16);
    edit_json(&tmp.path().join(INDEX), |v| v["weight_map"] = json!({}));
    assert_index_err(tmp.path(), &["weight_map"]);
}

#[test]
fn index_puts_tensor_in_wrong_shard() {
    let tmp = copy_fixture(SHARDED);
    edit_json(&tmp.path().join(INDEX), |v| {
        v["weight_map"]["model.norm.weight"] = json!("model-00001-of-00005.safetensors");
    });
    assert_index_err(
        tmp.path(),
        &[
            "model.norm.weight",
            "model-00001-of-00005.safetensors",
            "model-00004-of-00005.safetensors",
        ],
    );
}

#[test]
fn index_lists_tensor_no_shard_has() {
    let tmp = copy_fixture(BF16);
    edit_json(&tmp.path().join(INDEX), |v| {
        v["weight_map"]["model.layers.9.mlp.gate.weight"] = json!("model.safetensors");
    });
    assert_index_err(tmp.path(), &["model.layers.9.mlp.gate.weight"]);
}

#[test]
fn index_tensor_removed_from_shard_but_still_listed() {
    let tmp = copy_fixture(SHARDED);
    let t = "model.layers.1.linear_attn.dt_bias";
    let shard = shard_of(tmp.path(), t);
    rewrite_shard(&tmp.path().join(&shard), |ts| ts.retain(|x| x.name != t));
    assert_index_err(tmp.path(), &[t, &shard]);
}

#[test]
fn index_names_a_shard_path_outside_the_directory() {
    let tmp = copy_fixture(SHARDED);
    edit_json(&tmp.path().join(INDEX), |v| {
        v["weight_map"]["model.norm.weight"] = json!("../model-00004-of-00005.safetensors");
    });
    assert_index_err(tmp.path(), &["model.norm.weight"]);
}

#[test]
fn index_names_a_shard_file_that_does_not_exist() {
    let tmp = copy_fixture(SHARDED);
    edit_json(&tmp.path().join(INDEX), |v| {
        v["weight_map"]["model.norm.weight"] = json!("model-00006-of-00005.safetensors");
    });
    let msg = open_err(tmp.path()).to_string();
    assert!(msg.contains("model-00006-of-00005.safetensors"), "{msg}");
}

#[test]
fn shard_file_deleted() {
    let tmp = copy_fixture(SHARDED);
    fs::remove_file(tmp.path().join("model-00002-of-00005.safetensors")).unwrap();
    let e = open_err(tmp.path());
    let msg = e.to_string();
    assert!(matches!(e, Error::Io { .. }), "{msg}");
    assert!(
        msg.ends_with("1 of 5 shards missing: model-00002-of-00005.safetensors"),
        "{msg}"
    );
}

/// Every missing shard is named, not only the first.
#[test]
fn shard_files_deleted_are_all_named() {
    let tmp = copy_fixture(SHARDED);
    for n in [2, 4] {
        fs::remove_file(
            tmp.path()
                .join(format!("model-0000{n}-of-00005.safetensors")),
        )
        .unwrap();
    }
    let msg = open_err(tmp.path()).to_string();
    assert!(
        msg.ends_with("2 of 5 shards missing: model-00002-of-00005.safetensors, model-00004-of-00005.safetensors"),
        "{msg}"
    );
}

// ---------------------------------------------------------------------------------------
// 8. A tensor in two shards
// ---------------------------------------------------------------------------------------

#[test]
fn tensor_in_two_shards_is_named() {
    let tmp = copy_fixture(SHARDED);
    let t = "model.norm.weight";
    let home = shard_of(tmp.path(), t);
    assert_eq!(
        home, "model-00004-of-00005.safetensors",
        "fixture layout changed"
    );
    let (tensors, _) = read_shard(&tmp.path().join(&home));
    let dup = tensors.into_iter().find(|x| x.name == t).unwrap();
    rewrite_shard(&tmp.path().join("model-00002-of-00005.safetensors"), |ts| {
        ts.push(dup)
    });
    let msg = open_err(tmp.path()).to_string();
    assert!(msg.contains(t), "{msg}");
    assert!(
        msg.contains("model-00002-of-00005.safetensors")
            && msg.contains("model-00004-of-00005.safetensors"),
        "{msg}"
    );
}

// ---------------------------------------------------------------------------------------
// 9. Missing directory / files
// ---------------------------------------------------------------------------------------

#[test]
fn missing_model_directory_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("no-such-model");
    let e = open_err(&dir);
    let msg = e.to_string();
    assert!(matches!(e, Error::Io { .. }), "{msg}");
    assert!(msg.contains("no-such-model"), "{msg}");
}

#[test]
fn directory_without_config_is_named() {
    let tmp = copy_fixture(BF16);
    fs::remove_file(tmp.path().join("config.json")).unwrap();
    let msg = open_err(tmp.path()).to_string();
    assert!(msg.contains("config.json"), "{msg}");
}

#[test]
fn directory_without_weights_is_named() {
    let tmp = copy_fixture(BF16);
    fs::remove_file(tmp.path().join("model.safetensors")).unwrap();
    fs::remove_file(tmp.path().join(INDEX)).unwrap();
    let msg = open_err(tmp.path()).to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");
}

#[test]
fn single_file_without_index_still_opens() {
    // The index is optional for a one-file checkpoint.
    let tmp = copy_fixture(BF16);
    fs::remove_file(tmp.path().join(INDEX)).unwrap();
    let ckpt = Checkpoint::open(tmp.path()).unwrap_or_else(|e| panic!("{e}"));
    Model::<CpuBackend>::load(&ckpt, &CpuBackend).unwrap_or_else(|e| panic!("{e}"));
}

// ---------------------------------------------------------------------------------------
// Hostile headers: an error naming the shard, never a panic
// ---------------------------------------------------------------------------------------

#[test]
fn header_with_overflowing_shape_does_not_panic() {
    // `b` is inconsistent (4 bytes for F32 x [2]), which makes the header reader look for
    // the culprit; `a` sorts first by name and has a shape whose element count overflows.
    let tmp = copy_fixture(BF16);
    let p = tmp.path().join("model.safetensors");
    let header = json!({
        "__metadata__": {"format": "mlx"},
        "a": {"dtype": "F32", "shape": [4294967296u64, 4294967296u64], "data_offsets": [4, 4]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]},
    });
    write_raw_shard(&p, &header, 4);
    let name = file_name(&p);
    let r = std::panic::catch_unwind(|| Checkpoint::open(tmp.path()).err().map(|e| e.to_string()));
    let msg = r
        .expect("Checkpoint::open panicked on a hostile header")
        .expect("accepted");
    assert!(msg.contains(name.to_str().unwrap()), "{msg}");
}

#[test]
fn header_with_reversed_offsets_does_not_panic() {
    let tmp = copy_fixture(BF16);
    let p = tmp.path().join("model.safetensors");
    let header = json!({
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]},
    });
    write_raw_shard(&p, &header, 8);
    let r = std::panic::catch_unwind(|| Checkpoint::open(tmp.path()).err().map(|e| e.to_string()));
    let msg = r
        .expect("Checkpoint::open panicked on a hostile header")
        .expect("accepted");
    assert!(msg.contains("model.safetensors"), "{msg}");
}
