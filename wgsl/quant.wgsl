// quant kernels (see src/backend/gpu/quant.rs).
