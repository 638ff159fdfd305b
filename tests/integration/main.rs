//! Every integration test that needs no GPU, in one binary (one link step in CI instead of
//! fifteen, and one pool of test threads for all): checkpoints good and bad, the CLI, the
//! engine, the server, the pool, the CPU kernels, parity with mlx-lm and transformers,
//! and the generation matrix. The GPU tests are tests/gpu/.

#[path = "../common/mod.rs"]
mod common;

mod bad_checkpoints;
mod bench;
mod chat;
mod cli_families;
mod cpu_kernels;
mod demo;
mod engine;
mod flash_next;
mod generate;
mod generate_matrix;
mod layers;
mod parity;
mod pool;
mod routing;
mod serve;
mod wgsl_translation;
