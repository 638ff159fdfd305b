// norm kernels (see src/backend/gpu/norm.rs).
