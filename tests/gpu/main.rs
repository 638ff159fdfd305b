//! Every GPU-only test, in one binary (one link step in CI): the kernels against the CPU
//! backend, the quantized matmuls and routed experts, and what only a GPU does with the
//! whole forward pass (steps routed on the device, dispatch counts). Each test needs a GPU
//! adapter and fails without one (Mesa's lavapipe will do); none is skipped. Model-level
//! properties that hold on every backend run on the GPU through the per-backend harness
//! in tests/integration (`backend_tests!`, tests/common/backends.rs).

#[path = "../common/mod.rs"]
mod common;

mod device_steps;
mod flash_next_kernels;
mod in_flight;
mod kernels;
mod quant;
mod sequence_kernels;
