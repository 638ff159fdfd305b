//! `slotstream devices`: the GPU adapters and their limits.

use anyhow::Result;

use slotstream::backend::gpu::list_adapters;

pub fn devices() -> Result<()> {
    let adapters = list_adapters();
    if adapters.is_empty() {
        println!("no GPU adapter found (on Linux without a GPU, install Mesa's lavapipe: mesa-vulkan-drivers)");
    }
    for a in adapters {
        println!("{} [{} {}] {}", a.name, a.backend, a.device_type, a.driver);
        println!(
            "  max buffer {} MiB, max storage binding {} MiB, workgroups/dim {}, invocations/workgroup {}, shared memory {} KiB",
            a.max_buffer_size >> 20,
            a.max_storage_buffer_binding_size >> 20,
            a.max_compute_workgroups_per_dimension,
            a.max_compute_invocations_per_workgroup,
            a.max_compute_workgroup_storage_size >> 10
        );
        match a.subgroup_sizes {
            Some((lo, hi)) => println!("  subgroups of {lo} to {hi} invocations"),
            None => println!("  no subgroup operations (reductions in shared memory alone)"),
        }
    }
    Ok(())
}
