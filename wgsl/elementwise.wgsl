// elementwise kernels (see src/backend/gpu/elementwise.rs).
