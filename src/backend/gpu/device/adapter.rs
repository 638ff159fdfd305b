//! Choosing the adapter: [`GpuOptions`] (with their environment knobs), and the
//! adapters wgpu offers ([`list_adapters`], [`chosen_adapter`]).

use crate::error::{Error, Result};

/// A summary of one adapter, for `slotstream devices`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AdapterSummary {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub max_buffer_size: u64,
    pub max_storage_buffer_binding_size: u64,
    pub max_compute_workgroups_per_dimension: u32,
    pub max_compute_invocations_per_workgroup: u32,
    pub max_compute_workgroup_storage_size: u32,
    /// Smallest and largest subgroup size, where the adapter has subgroup operations (the
    /// kernels' reductions then shuffle within subgroups).
    pub subgroup_sizes: Option<(u32, u32)>,
}

/// Which adapter to use, and how to drive it. The library reads none of these from the
/// environment: the CLI takes them from its flags and the `SLOTSTREAM_GPU_*` variables
/// ([`GpuOptions::from_env`]); [`Default`] is every knob at its default. (wgpu itself
/// still reads `WGPU_BACKEND` to narrow the backends it tries.)
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    /// Case-insensitive substring of the adapter name (`--device`, `WGPU_ADAPTER_NAME`).
    pub adapter: Option<String>,
    /// Fill every new output buffer with NaN bit patterns instead of zeros, so a kernel
    /// that leaves an output untouched fails its test instead of passing by accident.
    pub poison_outputs: bool,
    /// Reduce in shared memory alone, without subgroup operations even where the adapter
    /// has them (`SLOTSTREAM_GPU_SUBGROUPS=0` does the same): the portable path, kept
    /// tested on adapters that have both.
    pub no_subgroups: bool,
    /// Compute matrix products of many tokens row by row, as decode does, rather than in
    /// tiles (`SLOTSTREAM_GPU_TILED=0` does the same): the path kept for adapters without
    /// the workgroup memory tiles need, kept tested on adapters that have it.
    pub no_tiles: bool,
    /// Timestamps per dispatch, reported per kernel at debug level
    /// (`SLOTSTREAM_GPU_PROFILE`); where the adapter lacks them, a warning.
    pub profile: bool,
    /// Kernels compiled with all of wgpu's runtime checks and zeroed workgroup memory
    /// (`SLOTSTREAM_GPU_CHECKS=all`), for debugging (see [`Gpu::pipeline`](super::Gpu::pipeline)).
    pub all_checks: bool,
    /// Pools placed on the device have their slots written through `queue.write_buffer`
    /// rather than copied by the GPU from imported host memory
    /// (`SLOTSTREAM_GPU_HOST_COPY=0`; see [`Gpu::set_host_copies`](super::Gpu::set_host_copies)).
    pub no_host_copy: bool,
    /// Dispatches recorded before they are submitted without a wait
    /// (`SLOTSTREAM_GPU_SUBMIT_EVERY`); `None`: [`SUBMIT_EVERY`](super::SUBMIT_EVERY).
    pub submit_every: Option<usize>,
    /// Microseconds a wait polls before it blocks (`SLOTSTREAM_GPU_SPIN_US`); `None`:
    /// [`SPIN_US`](super::SPIN_US) on a GPU, 0 on a CPU emulation.
    pub spin_us: Option<u64>,
    /// Invocations a quantized matvec aims for (`SLOTSTREAM_GPU_INVOCATIONS`, for tuning
    /// on another GPU); `None`: the built-in figure.
    pub invocations: Option<usize>,
    /// Routes per tile of the routed experts' tiled products, 16 or 64
    /// (`SLOTSTREAM_GPU_ROUTE_TILE`, for tuning and for tests of both); `None`, or any
    /// other value (with a warning): chosen per layer from the routes its records get.
    pub route_tile: Option<usize>,
}

impl GpuOptions {
    /// Options from the environment: `WGPU_ADAPTER_NAME` and the `SLOTSTREAM_GPU_*`
    /// knobs above (on/off knobs take `1`, `on`, `true`, `yes` and `0`, `off`, `false`,
    /// `no`; counts are non-negative integers; any other value warns and keeps the
    /// default). The CLI reads them once, when it opens a backend.
    pub fn from_env() -> Self {
        GpuOptions {
            adapter: std::env::var("WGPU_ADAPTER_NAME")
                .ok()
                .filter(|s| !s.is_empty()),
            poison_outputs: false,
            no_subgroups: !env_switch("SLOTSTREAM_GPU_SUBGROUPS", &[], true),
            no_tiles: !env_switch("SLOTSTREAM_GPU_TILED", &[], true),
            profile: env_switch("SLOTSTREAM_GPU_PROFILE", &[], false),
            all_checks: env_switch("SLOTSTREAM_GPU_CHECKS", &["all"], false),
            no_host_copy: !env_switch("SLOTSTREAM_GPU_HOST_COPY", &[], true),
            submit_every: env_count("SLOTSTREAM_GPU_SUBMIT_EVERY"),
            spin_us: env_count("SLOTSTREAM_GPU_SPIN_US"),
            invocations: env_count("SLOTSTREAM_GPU_INVOCATIONS"),
            route_tile: env_count("SLOTSTREAM_GPU_ROUTE_TILE"),
        }
    }
}

pub(super) fn instance() -> wgpu::Instance {
    // WGPU_BACKEND (vulkan, metal, dx12, gl) narrows the backends, as in wgpu's examples.
    wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env())
}

/// Lists the adapters wgpu finds, with the limits that matter here.
pub fn list_adapters() -> Vec<AdapterSummary> {
    let inst = instance();
    pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()))
        .into_iter()
        .map(|a| summarize(&a))
        .collect()
}

/// The adapter [`Gpu::open`](super::Gpu::open) would open with `options`, without
/// opening a device (so the caller can decide on its kind first). Errors: as
/// [`Gpu::open`](super::Gpu::open)'s.
pub fn chosen_adapter(options: &GpuOptions) -> Result<AdapterSummary> {
    choose_adapter(&instance(), options).map(|a| summarize(&a))
}

/// The adapter whose name contains `options.adapter`, or wgpu's high-performance
/// default. Errors: none found, or none whose name matches.
pub(super) fn choose_adapter(inst: &wgpu::Instance, options: &GpuOptions) -> Result<wgpu::Adapter> {
    let wanted = options.adapter.clone().filter(|s| !s.is_empty());
    match &wanted {
        Some(name) => {
            let lower = name.to_lowercase();
            pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()))
                .into_iter()
                .find(|a| a.get_info().name.to_lowercase().contains(&lower))
                .ok_or_else(|| Error::Gpu(format!("no GPU adapter matches `{name}` (see `slotstream devices`)")))
        }
        None => pollster::block_on(inst.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        }))
        .map_err(|e| Error::Gpu(format!("no GPU adapter found ({e}); install a Vulkan or Metal driver (on Linux without a GPU: Mesa's lavapipe, package mesa-vulkan-drivers)"))),
    }
}

pub(super) fn summarize(a: &wgpu::Adapter) -> AdapterSummary {
    let info = a.get_info();
    let subgroup_sizes = a
        .features()
        .contains(wgpu::Features::SUBGROUP)
        .then_some((info.subgroup_min_size, info.subgroup_max_size));
    let l = a.limits();
    AdapterSummary {
        name: info.name,
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info)
            .trim()
            .to_string(),
        max_buffer_size: l.max_buffer_size,
        max_storage_buffer_binding_size: l.max_storage_buffer_binding_size,
        max_compute_workgroups_per_dimension: l.max_compute_workgroups_per_dimension,
        max_compute_invocations_per_workgroup: l.max_compute_invocations_per_workgroup,
        max_compute_workgroup_storage_size: l.max_compute_workgroup_storage_size,
        subgroup_sizes,
    }
}

/// The count in environment variable `name` (a tuning knob); `None` when it is unset or
/// not a non-negative integer (with a warning naming it).
pub(super) fn env_count<T: std::str::FromStr>(name: &str) -> Option<T> {
    let v = std::env::var(name).ok()?;
    let parsed = v.trim().parse().ok();
    if parsed.is_none() {
        tracing::warn!(value = %v, "{name} is not a non-negative integer in range; using the default");
    }
    parsed
}

/// An on/off environment knob: `1`, `on`, `true` or `yes`, and `0`, `off`, `false` or
/// `no` (any case), plus the extra words in `on` that also mean on; unset gives
/// `default`, and any other value warns and gives `default`.
pub(super) fn env_switch(name: &str, on: &[&str], default: bool) -> bool {
    let Ok(v) = std::env::var(name) else {
        return default;
    };
    let v = v.trim().to_ascii_lowercase();
    if ["1", "on", "true", "yes"].contains(&v.as_str()) || on.contains(&v.as_str()) {
        true
    } else if ["0", "off", "false", "no"].contains(&v.as_str()) {
        false
    } else {
        tracing::warn!(value = %v, %default, "{name} is neither on (1) nor off (0); using the default");
        default
    }
}
