//! The per-backend harness: one test body, generic over [`TestBackend`], run as one test
//! case per backend by [`backend_tests!`](crate::common::backend_tests):
//!
//! - `<body>::cpu`: the CPU backend;
//! - `<body>::gpu`: every GPU adapter ([`gpu_adapters`]) with subgroup reductions and
//!   tiled matrix products where it has them (as [`gpu`](super::gpu) opens it);
//! - `<body>::gpu_portable`: every GPU adapter on the portable paths (reductions in shared
//!   memory alone, matrix products of many tokens row by row).
//!
//! GPU outputs start NaN-filled (poisoned), as in every GPU test. A GPU case fails, never
//! skips, when wgpu finds no adapter; a failure on one adapter names it and the path.
//! Bodies take their bounds and their backend-specific checks from the backend
//! ([`TestBackend::device`], [`TestBackend::pick`]).

use std::panic::AssertUnwindSafe;

use slotstream::backend::cpu::CpuBackend;
use slotstream::backend::gpu::{Gpu, GpuBackend, GpuOptions};
use slotstream::backend::Backend;

/// A backend the harness runs a body on.
pub trait TestBackend: Backend + Sized {
    /// The GPU device behind the backend (counters, placements, host copies, tiles);
    /// `None` on the CPU.
    fn device(&self) -> Option<&Gpu>;

    fn is_gpu(&self) -> bool {
        self.device().is_some()
    }

    /// A GPU on its portable paths where the adapter offers faster ones (subgroups or the
    /// workgroup memory for tiles): the `gpu_portable` case, where a costly body may run
    /// fewer of its cases that do not depend on the arithmetic.
    fn is_portable(&self) -> bool {
        self.device().is_some_and(|d| {
            let offers = d.adapter.subgroup_sizes.is_some_and(|(min, _)| min >= 2)
                || d.limits.max_compute_workgroup_storage_size
                    >= slotstream::backend::gpu::TILE_WORKGROUP_BYTES;
            d.subgroup_lanes == 1 && !d.tiled && offers
        })
    }

    /// `cpu` on the CPU backend, `gpu` on a GPU: a bound or a case list per backend.
    fn pick<T>(&self, cpu: T, gpu: T) -> T {
        if self.is_gpu() {
            gpu
        } else {
            cpu
        }
    }
}

impl TestBackend for CpuBackend {
    fn device(&self) -> Option<&Gpu> {
        None
    }
}

impl TestBackend for GpuBackend {
    fn device(&self) -> Option<&Gpu> {
        Some(&self.gpu)
    }
}

/// Declares, for each generic body `fn name<B: TestBackend>(b: &B)` named, a module
/// `name` of three tests: `cpu`, `gpu` and `gpu_portable` (see the module's doc).
#[allow(unused_macros)]
macro_rules! backend_tests {
    ($($body:ident),+ $(,)?) => {$(
        mod $body {
            #[test]
            fn cpu() {
                super::$body(&slotstream::backend::cpu::CpuBackend)
            }

            #[test]
            fn gpu() {
                $crate::common::backends::on_each_gpu(false, |b| super::$body(b))
            }

            #[test]
            fn gpu_portable() {
                $crate::common::backends::on_each_gpu(true, |b| super::$body(b))
            }
        }
    )+};
}
#[allow(unused_imports)]
pub(crate) use backend_tests;

/// The names of the adapters the GPU cases run on: the one `WGPU_ADAPTER_NAME` names
/// where set, else every adapter wgpu lists (once per name), less those of its GL
/// backend (which repeat another backend's, as lavapipe's llvmpipe does on Linux, and
/// which the engine is not tested on).
pub fn gpu_adapters() -> Vec<String> {
    if let Some(name) = GpuOptions::from_env().adapter {
        return vec![name];
    }
    let mut names: Vec<String> = Vec::new();
    for a in slotstream::backend::gpu::list_adapters() {
        if a.backend != "Gl" && !names.contains(&a.name) {
            names.push(a.name);
        }
    }
    names
}

/// Runs `body` on every adapter of [`gpu_adapters`], on the fast paths or (`portable`)
/// the portable ones; panics without an adapter, and names the adapter and path of a
/// failure.
pub fn on_each_gpu(portable: bool, body: impl Fn(&GpuBackend)) {
    let adapters = gpu_adapters();
    assert!(
        !adapters.is_empty(),
        "a GPU adapter is required: install mesa-vulkan-drivers for lavapipe"
    );
    let path = if portable {
        "portable paths"
    } else {
        "subgroups and tiles"
    };
    for name in adapters {
        let b = super::gpu_from(GpuOptions {
            adapter: Some(name.clone()),
            no_subgroups: portable,
            no_tiles: portable,
            ..super::test_options()
        });
        if portable {
            super::check_portable(&b);
        } else {
            super::check_fast(&b);
        }
        let label = format!("{} ({path})", b.name());
        eprintln!("case: {label}");
        if let Err(e) = std::panic::catch_unwind(AssertUnwindSafe(|| body(&b))) {
            let msg = e
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| e.downcast_ref::<&str>().copied())
                .unwrap_or("(a panic without a message)");
            panic!("on {label}: {msg}");
        }
    }
}
