// router kernels (see src/backend/gpu/router.rs).
