// attention kernels (see src/backend/gpu/attention.rs).
