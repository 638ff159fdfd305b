//! Every integration test, in one binary (one link step in CI instead of fifteen, and one
//! pool of test threads for all): checkpoints good and bad, the CLI, the engine, the
//! server, `launch` and `stop` with stand-in coding agents, the pool, the CPU kernels,
//! parity with mlx-lm and transformers, and the generation matrix. Properties that hold on every backend (parity, the generation
//! matrix, warm runs, KV cache copies) are written once and run on the CPU and on each GPU
//! adapter's two paths by `backend_tests!` (tests/common/backends.rs); their GPU cases,
//! like the few CLI runs with `--device gpu`, fail without an adapter. The GPU-only tests
//! are tests/gpu/.

#[path = "../common/mod.rs"]
mod common;

mod bad_checkpoints;
mod bench;
mod chat;
mod cli_families;
mod constrained;
mod cpu_kernels;
mod demo;
mod dialects;
mod elastic;
mod engine;
mod flash_next;
mod generate;
mod generate_matrix;
mod launch;
mod layer_major;
mod layers;
mod mirror;
mod mtp;
mod parity;
mod plots;
mod pool;
mod pull;
mod routing;
mod serve;
mod vision;
mod web;
mod wgsl_translation;
