// conv kernels (see src/backend/gpu/conv.rs).
