//! The vision tower's fields (`vision_config` of a Qwen3.5-MoE or Qwen3.8-Flash-Next
//! config, transformers 5.24.0 `Qwen3_5MoeVisionConfig`) and the placeholder token ids
//! the chat template renders around an image (../shared/spec/reference-system.md A.10).

use serde_json::Value;

use super::fields::Fields;
use crate::error::Result;

/// The tensor-name prefixes a tower is stored under, in the order they are looked for.
pub const VISION_PREFIXES: [&str; 2] = ["vision_tower", "model.visual"];

/// Geometry of the vision tower (all sizes in elements, the patch sizes in pixels).
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    /// Transformer blocks (`depth`; 27 released).
    pub depth: usize,
    /// Width of the tower's rows (`hidden_size`; 1152).
    pub hidden_size: usize,
    /// Width of each block's MLP (`intermediate_size`; 4304).
    pub intermediate_size: usize,
    /// Attention heads (`num_heads`; 16), of width `hidden_size / num_heads`.
    pub num_heads: usize,
    /// Colour channels of a pixel (`in_channels`; 3).
    pub in_channels: usize,
    /// Side of a square patch in pixels (`patch_size`; 16).
    pub patch_size: usize,
    /// Frames a patch spans (`temporal_patch_size`; 2: a still image is repeated).
    pub temporal_patch_size: usize,
    /// Side of the square of patches the merger folds into one token (`spatial_merge_size`; 2).
    pub spatial_merge_size: usize,
    /// Width of a merged token, the language model's hidden size (`out_hidden_size`).
    pub out_hidden_size: usize,
    /// Rows of the learned position table, a square grid (`num_position_embeddings`; 2304 = 48²).
    pub num_position_embeddings: usize,
    /// Theta of the 2-D rotary embedding (`rope_parameters.rope_theta`, default 10,000).
    pub rope_theta: f64,
    /// `<|image_pad|>`: the placeholder each of an image's tokens replaces (top-level `image_token_id`).
    pub image_token_id: u32,
    /// `<|vision_start|>` (top-level `vision_start_token_id`).
    pub vision_start_token_id: u32,
    /// `<|vision_end|>` (top-level `vision_end_token_id`).
    pub vision_end_token_id: u32,
}

impl VisionConfig {
    /// Width of an attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Side of the learned position grid (`sqrt(num_position_embeddings)`).
    pub fn position_grid_side(&self) -> usize {
        self.num_position_embeddings.isqrt()
    }

    /// Values of one flattened patch: `in_channels * temporal_patch_size * patch_size²`
    /// (1,536 released), in the processor's order (channel, frame, row, column).
    pub fn patch_values(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Patches merged into one token (`spatial_merge_size²`).
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size * self.spatial_merge_size
    }
}

/// Reads `vision_config` from the top level of `top` (`None` when absent: a text-only
/// checkpoint). Errors: a missing or mistyped field, an activation other than
/// `gelu_pytorch_tanh`, a head width not a multiple of 4 (the axial rotary embedding
/// splits it into rows and columns, each rotated in halves), a position table that is not
/// a square grid, a channel count other than 3.
pub(super) fn parse_vision(top: &Fields<'_>) -> Result<Option<VisionConfig>> {
    let Some(Value::Object(obj)) = top.get("vision_config") else {
        return Ok(None);
    };
    let f = Fields {
        obj,
        path: top.path,
    };
    let act = f
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(f.err(
            "hidden_act",
            format!("`{act}` is not supported (only gelu_pytorch_tanh)"),
        ));
    }
    let rope_theta = match f.get("rope_parameters").and_then(Value::as_object) {
        Some(obj) => Fields {
            obj,
            path: top.path,
        }
        .f64_or("rope_theta", Some(10_000.0))?,
        None => 10_000.0,
    };
    let token = |name: &str, default: usize| -> Result<u32> {
        let v = top.usize_or(name, Some(default))?;
        u32::try_from(v).map_err(|_| top.err(name, format!("{v} is not a token id")))
    };
    let positive = |name: &str, default: Option<usize>| -> Result<usize> {
        match f.usize_or(name, default)? {
            0 => Err(f.err(name, "must be at least 1")),
            n => Ok(n),
        }
    };
    let cfg = VisionConfig {
        depth: f.usize_or("depth", Some(27))?,
        hidden_size: positive("hidden_size", Some(1152))?,
        intermediate_size: positive("intermediate_size", Some(4304))?,
        num_heads: positive("num_heads", Some(16))?,
        in_channels: f.usize_or("in_channels", Some(3))?,
        patch_size: positive("patch_size", Some(16))?,
        temporal_patch_size: positive("temporal_patch_size", Some(2))?,
        spatial_merge_size: positive("spatial_merge_size", Some(2))?,
        out_hidden_size: positive("out_hidden_size", None)?,
        num_position_embeddings: positive("num_position_embeddings", Some(2304))?,
        rope_theta,
        image_token_id: token("image_token_id", 248_056)?,
        vision_start_token_id: token("vision_start_token_id", 248_053)?,
        vision_end_token_id: token("vision_end_token_id", 248_054)?,
    };
    if cfg.in_channels != 3 {
        return Err(f.err("in_channels", "images are RGB: 3 channels"));
    }
    if !cfg.hidden_size.is_multiple_of(cfg.num_heads) || !cfg.head_dim().is_multiple_of(4) {
        return Err(f.err(
            "num_heads",
            format!(
                "hidden_size {} over {} heads is not a head width that is a multiple of 4",
                cfg.hidden_size, cfg.num_heads
            ),
        ));
    }
    let side = cfg.position_grid_side();
    if side * side != cfg.num_position_embeddings {
        return Err(f.err(
            "num_position_embeddings",
            format!("{} is not a square grid", cfg.num_position_embeddings),
        ));
    }
    Ok(Some(cfg))
}
