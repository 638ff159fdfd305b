//! Synthetic checkpoints in the exact MLX layout of a Qwen3-Next, Qwen3.5-MoE or
//! Qwen3.8-Flash-Next conversion (tensor names, shapes, dtypes, the quantization each module
//! has in the released conversion, the config's quantization block, one shard per layer plus
//! one for the embeddings), with deterministic random weights, written as a stream (never
//! held in memory). They let the demo, tests and benchmarks run at real shapes without
//! downloading 45-105 GB.
//!
//! The weights are random: quantized values uniform, scales chosen so each dequantized
//! row has unit-scale dot products, norms 1. Text generated from them is noise; the point
//! is the layout, the sizes and the I/O they cause.
//!
//! Qwen3.8-Flash-Next ([`QWEN38_FLASH_NEXT`], `qwen4_exp`) is written as the released MLX
//! 4-bit conversion stores it (../shared/spec/reference-system.md A.1-A.9): 4-stream
//! hyper-connections, split gated-DeltaNet projections, QSA attention with its indexer,
//! the PLE layer at layer 1 with its hashed n-gram table in 128 shards (4 bits, group 32),
//! bf16 routers, inject weights, indexer and a/b projections, norms with the `+1` folded
//! in. The multimodal presets (Qwen3.5-MoE, Flash-Next) carry the vision tower (A.10) at
//! its released shape, in its own shard, unless a preset drops it (`vision: None`); the
//! MTP head (A.11) is left out.
//!
//! A random router routes almost uniformly, so by default a checkpoint also carries a
//! synthetic routing model ([`crate::routing_model`], `synthetic_routing.json`) calibrated
//! to real traces, which picks the routed expert ids instead.
//!
//! The submodules, by concern: the presets and their checks (`presets`), config.json
//! (`config_json`), the tensors as specs (`tensors`, with Flash-Next's own in
//! `flash_next`), the safetensors writer and filler (`writer`), the byte-level tokenizer
//! (`tokenizer`) and the directory writer that puts them together (`checkpoint`).

mod checkpoint;
mod config_json;
mod flash_next;
mod presets;
mod tensors;
mod tokenizer;
mod writer;

#[cfg(test)]
mod tests;

pub use checkpoint::{write_checkpoint, write_checkpoint_with};
pub use flash_next::NgramGeometry;
pub use presets::{
    preset, FlashNextShape, Preset, VisionShape, DEMO, FLASH_NEXT_SHAPE, PRESETS, QWEN35_35B,
    QWEN38_FLASH_NEXT, QWEN3_NEXT_80B, SMALL_VISION_SHAPE, VISION_SHAPE,
};
pub use tokenizer::refresh_tokenizer;
pub use writer::{Filler, SafetensorsWriter};
