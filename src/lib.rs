//! slotstream: runs Mixture-of-Experts language models larger than memory by keeping the
//! dense part resident and streaming routed experts from the SSD into a shared pool of
//! slots.
//!
//! Layers of the crate, bottom up (ARCHITECTURE.md); a module imports only the layers
//! below it and those before it in its own (`tests/integration/layers.rs` holds the
//! order and checks it):
//! - [`error`], [`atomic_file`], [`machine`]: typed errors, files written whole or not at
//!   all, and the machine's memory as the planner reads it.
//! - Formats: [`config`], [`checkpoint`], [`pack`], [`tokenizer`], [`chat_template`]:
//!   read and validate an MLX checkpoint directory and index every expert record's bytes,
//!   the packed one-read-per-record layout, tokenizing, and rendering conversations so
//!   that control tokens come only from the template. No tokio, no wgpu.
//! - [`io`]: bounded async reads with direct I/O.
//! - [`records`]: the records contract between storage and compute (expert records, slot
//!   addresses, the [`records::ExpertSource`] trait, the pool's memory as a backend
//!   places it).
//! - [`backend`]: the operations of the forward pass behind one trait, with the CPU and
//!   GPU implementations; it knows records, not the pool.
//! - [`pool`], [`plan`]: the shared CLOCK slot pool with lookahead, and the memory plan
//!   that sizes it.
//! - [`experts`]: opens where the forward pass gets expert records from (the pool or the
//!   mapped checkpoint).
//! - [`context`], [`routing_model`], [`ngram`], [`model`]: the context bound, synthetic
//!   routing, Flash-Next's n-gram table, and the Qwen3-Next forward pass over any backend,
//!   with per-sequence state.
//! - [`sampling`], [`constraint`], [`generate`], [`prompt_cache`], [`chat`], [`score`],
//!   [`reply`]: picking each token, grammars' token masks (llguidance), generation, snapshots of sequence states for prompt reuse (in memory and
//!   on disk), multi-turn chat, teacher-forced log-likelihood and perplexity, and reading
//!   reasoning and tool calls out of a reply.
//! - [`engine`]: the async library API.
//! - [`server`]: the OpenAI-compatible HTTP API on the engine; [`tools`]: built on the
//!   engine, never imported by it: synthetic checkpoints ([`tools::synth`]),
//!   `slotstream bench` ([`tools::bench`]) and cache policy replay ([`tools::cachesim`]).

pub mod atomic_file;
pub mod backend;
pub mod chat;
pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod constraint;
pub mod context;
pub mod engine;
pub mod error;
pub mod experts;
pub mod generate;
pub mod image_processor;
pub mod io;
pub mod machine;
pub mod model;
pub mod ngram;
pub mod pack;
pub mod plan;
pub mod pool;
pub mod prompt_cache;
pub mod records;
pub mod reply;
pub mod routing_model;
pub mod sampling;
pub mod score;
pub mod server;
pub mod tokenizer;
pub mod tools;

pub use error::{Error, Result};
