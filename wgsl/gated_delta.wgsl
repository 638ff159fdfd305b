// gated_delta kernels (see src/backend/gpu/gated_delta.rs).
