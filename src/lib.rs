//! slotstream: runs Mixture-of-Experts language models larger than memory by keeping the
//! dense part resident and streaming routed experts from the SSD into a shared pool of
//! slots.
//!
//! Layers of the crate, bottom up:
//! - [`config`] and [`checkpoint`]: read and validate an MLX checkpoint directory, and
//!   index every expert record's bytes.
//! - [`backend`]: the operations of the forward pass behind one trait, with the CPU
//!   implementation.
//! - [`experts`]: where the forward pass gets expert records from.
//! - [`io`], [`pool`], [`pack`]: bounded async reads with direct I/O, the shared CLOCK
//!   slot pool with lookahead, and the packed one-read-per-record layout.
//! - [`model`]: the Qwen3-Next forward pass over any backend, with per-sequence state.
//! - [`score`]: teacher-forced log-likelihood and perplexity.
//! - [`tokenizer`], [`chat_template`], [`reply`]: tokenizing, rendering conversations so
//!   that control tokens come only from the template, and reading reasoning and tool
//!   calls out of a reply.
//! - [`generate`], [`prompt_cache`], [`chat`], [`engine`]: generation, snapshots of
//!   sequence states for prompt reuse (in memory and on disk), multi-turn chat, and the
//!   async library API; [`sampling`] picks each token and [`context`] bounds a sequence.
//! - [`server`]: the OpenAI-compatible HTTP API on the engine.
//! - [`tools`]: built on the engine, never imported by it: synthetic checkpoints
//!   ([`tools::synth`]), `slotstream bench` ([`tools::bench`]) and cache policy replay
//!   ([`tools::cachesim`]).

pub mod atomic_file;
pub mod backend;
pub mod chat;
pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod context;
pub mod engine;
pub mod error;
pub mod experts;
pub mod generate;
pub mod io;
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
