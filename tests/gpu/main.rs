//! Every GPU test, in one binary (one link step in CI): the kernels against the CPU
//! backend, the quantized matmuls and routed experts, and the whole forward pass against
//! mlx-lm's fixtures. Each test needs a GPU adapter and fails without one (Mesa's lavapipe
//! will do); none is skipped.

#[path = "../common/mod.rs"]
mod common;

mod flash_next_kernels;
mod in_flight;
mod kernels;
mod parity;
mod quant;
mod sequence_kernels;
