//! The wgpu device, kernels compiled from `wgsl/`, and the dispatch machinery every
//! kernel family uses.
//!
//! Conventions for kernels (every file in `wgsl/`):
//! - `@group(0) @binding(0)` is a uniform block of 32-bit parameters; storage buffers
//!   follow at bindings 1.. in the order the Rust side passes them ([`Kernel::bindings`]).
//! - Workgroup counts above 65,535 use a 2-D grid ([`grid`]); a kernel computes its linear
//!   workgroup index as `wid.x + wid.y * nwg.x` and returns early past the end. The z
//!   dimension (tokens or routes) stays below 65,535 because the model runs long inputs
//!   in chunks that keep it so (`GpuBackend::prefill_chunk`).
//! - The uniform block is a [`Uniform`] struct declared with [`uniform_block!`] beside the
//!   kernel's launcher, the WGSL `Params` struct field for field (a unit test compares the
//!   two through naga's reflection); entries of one file share it.
//! - Dispatches are recorded into one compute pass of one pending command encoder, which is
//!   submitted at the next read-back ([`Gpu::flush`]) or every [`SUBMIT_EVERY`] dispatches
//!   (so the device starts on a long step while the host still records it). Their uniform
//!   blocks go into one ring buffer at aligned offsets, bound through a dynamic offset, and
//!   small per-dispatch storage data ([`Bind::Data`]: route tables, ids, RoPE angles) into a
//!   second ring; both are uploaded at submission.
//! - Bind groups are cached by kernel and buffers, and kernel outputs come from a pool of
//!   reusable buffers ([`DeviceBuffer`]), so a decode step creates almost no wgpu objects.
//!   A cached bind group keeps its buffers alive, so it goes when one of its buffers
//!   does: a [`DeviceBuffer`] that is dropped for good and a buffer the pool discards
//!   leave the cache, a replaced slot mirror empties it ([`Gpu::forget_bind_groups`]),
//!   and bindings of one dispatch alone ([`Bind::Once`], [`Bind::Data`] beyond the ring)
//!   are never cached.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use wgpu::util::DeviceExt;

use super::profile::Profiler;
use crate::error::{Error, Result};

/// A kernel's compute pipeline and the layout of its bind group.
type CompiledKernel = (wgpu::ComputePipeline, wgpu::BindGroupLayout);

/// How a kernel uses one storage binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
}

/// One compute entry point and its storage bindings (after the uniform at binding 0).
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    /// WGSL file name under `wgsl/`, for messages and the pipeline cache.
    pub file: &'static str,
    pub source: &'static str,
    pub entry: &'static str,
    pub bindings: &'static [Access],
}

impl Kernel {
    /// Entry point `entry` of `wgsl/<file>` with its storage `bindings`.
    pub const fn new(
        file: &'static str,
        entry: &'static str,
        bindings: &'static [Access],
    ) -> Kernel {
        Kernel {
            file,
            source: shader(file),
            entry,
            bindings,
        }
    }
}

/// A kernel's uniform block (binding 0): a `#[repr(C)]` struct of 4-byte fields that
/// mirrors the `Params` struct of its WGSL file field for field, in order (the tests check
/// each against the WGSL through naga's reflection). Declare one with [`uniform_block!`].
pub trait Uniform: bytemuck::Pod {
    /// Each field's name, byte offset and type (`u32` or `f32`), in declaration order.
    const FIELDS: &'static [(&'static str, usize, &'static str)];
}

/// Declares a [`Uniform`] struct: `#[repr(C)]`, `Pod`, `Default`, with its field list.
macro_rules! uniform_block {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $( $(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name {
            $( $(#[$fmeta])* $fvis $field: $ty ),*
        }

        impl $crate::backend::gpu::device::Uniform for $name {
            const FIELDS: &'static [(&'static str, usize, &'static str)] = &[$((
                stringify!($field),
                std::mem::offset_of!($name, $field),
                stringify!($ty),
            )),*];
        }
    };
}
pub(crate) use uniform_block;

/// Every WGSL file of the crate, embedded at build time: `(file name, source)`.
pub const SHADERS: &[(&str, &str)] = &[
    ("quant.wgsl", include_str!("../../../../wgsl/quant.wgsl")),
    (
        "elementwise.wgsl",
        include_str!("../../../../wgsl/elementwise.wgsl"),
    ),
    ("norm.wgsl", include_str!("../../../../wgsl/norm.wgsl")),
    ("conv.wgsl", include_str!("../../../../wgsl/conv.wgsl")),
    (
        "gated_delta.wgsl",
        include_str!("../../../../wgsl/gated_delta.wgsl"),
    ),
    (
        "attention.wgsl",
        include_str!("../../../../wgsl/attention.wgsl"),
    ),
    ("router.wgsl", include_str!("../../../../wgsl/router.wgsl")),
    (
        "route_tiles.wgsl",
        include_str!("../../../../wgsl/route_tiles.wgsl"),
    ),
    ("hyper.wgsl", include_str!("../../../../wgsl/hyper.wgsl")),
    (
        "bandwidth.wgsl",
        include_str!("../../../../wgsl/bandwidth.wgsl"),
    ),
];

/// The check of the reductions' assumptions about subgroups, run when the device opens
/// with subgroup operations (see [`Gpu::open`]); compiled like the kernels.
pub const SUBGROUP_PROBE: &str = include_str!("../../../../wgsl/subgroup_probe.wgsl");

/// Reductions over a workgroup's invocations, put before every kernel (see
/// [`kernel_source`]).
pub const REDUCE: &str = include_str!("../../../../wgsl/reduce.wgsl");

/// What the device compiles for a kernel file: a prelude, [`REDUCE`], then `source`.
/// The prelude gives `SUBGROUP_LANES`, how many consecutive invocations are known to share
/// a subgroup (a power of two), and `lane_xor_f32` / `lane_xor_u32`, the value held by the
/// invocation whose subgroup index is this one's XOR `mask` (`subgroupShuffleXor`). With
/// `subgroup_lanes` 1 (no subgroup operations) the functions return their argument and
/// are never called: every reduction step then goes through shared memory.
pub fn kernel_source(source: &str, subgroup_lanes: u32) -> String {
    // naga takes the subgroup built-ins without `enable subgroups;` (and rejects it).
    let shuffle = if subgroup_lanes > 1 {
        "subgroupShuffleXor(v, mask)"
    } else {
        "v"
    };
    let mut out = format!("const SUBGROUP_LANES: u32 = {subgroup_lanes}u;\n");
    for ty in ["f32", "u32"] {
        out += &format!("fn lane_xor_{ty}(v: {ty}, mask: u32) -> {ty} {{ return {shuffle}; }}\n");
    }
    out + REDUCE + source
}

/// The source of `file` from [`SHADERS`] (empty if unknown).
pub const fn shader(file: &str) -> &'static str {
    let mut i = 0;
    while i < SHADERS.len() {
        let (name, src) = SHADERS[i];
        if const_eq(name, file) {
            return src;
        }
        i += 1;
    }
    ""
}

const fn const_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Workgroup grid for `n` workgroups: 1-D up to 65,535, else 2-D.
pub fn grid(n: u32) -> [u32; 2] {
    const MAX: u32 = 65_535;
    if n <= MAX {
        [n.max(1), 1]
    } else {
        let y = n.div_ceil(MAX);
        [n.div_ceil(y), y]
    }
}

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
    /// (`SLOTSTREAM_GPU_CHECKS=all`), for debugging (see [`Gpu::pipeline`]).
    pub all_checks: bool,
    /// Pools placed on the device have their slots written through `queue.write_buffer`
    /// rather than copied by the GPU from imported host memory
    /// (`SLOTSTREAM_GPU_HOST_COPY=0`; see [`Gpu::set_host_copies`]).
    pub no_host_copy: bool,
    /// Dispatches recorded before they are submitted without a wait
    /// (`SLOTSTREAM_GPU_SUBMIT_EVERY`); `None`: [`SUBMIT_EVERY`].
    pub submit_every: Option<usize>,
    /// Microseconds a wait polls before it blocks (`SLOTSTREAM_GPU_SPIN_US`); `None`:
    /// [`SPIN_US`] on a GPU, 0 on a CPU emulation.
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

fn instance() -> wgpu::Instance {
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

/// The adapter [`Gpu::open`] would open with `options`, without opening a device (so the
/// caller can decide on its kind first). Errors: as [`Gpu::open`]'s.
pub fn chosen_adapter(options: &GpuOptions) -> Result<AdapterSummary> {
    choose_adapter(&instance(), options).map(|a| summarize(&a))
}

/// The adapter whose name contains `options.adapter`, or wgpu's high-performance
/// default. Errors: none found, or none whose name matches.
fn choose_adapter(inst: &wgpu::Instance, options: &GpuOptions) -> Result<wgpu::Adapter> {
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

fn summarize(a: &wgpu::Adapter) -> AdapterSummary {
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

/// The device, its queue and the compiled kernels.
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub adapter: AdapterSummary,
    pub limits: wgpu::Limits,
    /// Whether host memory can be imported as GPU buffers (unified placement).
    pub host_import: bool,
    /// A 4-byte buffer bound where a kernel's binding is unused.
    pub dummy: wgpu::Buffer,
    /// Invocations known to share a subgroup: the adapter's smallest subgroup size where
    /// subgroup operations are on and laid out as the reductions assume (checked by
    /// [`SUBGROUP_PROBE`]), else 1 (see [`kernel_source`]).
    pub subgroup_lanes: u32,
    /// Whether matrix products of many tokens run in tiles (`gemm` entries of
    /// `wgsl/quant.wgsl`): the adapter has [`TILE_WORKGROUP_BYTES`] of workgroup memory and
    /// [`GpuOptions::no_tiles`] did not turn them off.
    pub tiled: bool,
    /// Invocations a quantized matvec dispatch aims for ([`GpuOptions::invocations`]).
    pub invocations: usize,
    /// Routes per tile of the routed tiled products when forced
    /// ([`GpuOptions::route_tile`], checked).
    pub route_tile: Option<usize>,
    /// Kernels compiled with all of wgpu's runtime checks and zeroed workgroup memory
    /// ([`GpuOptions::all_checks`]), else without the loop counters and the
    /// zeroing these kernels do not need (see [`Gpu::pipeline`]).
    all_checks: bool,
    poison: bool,
    pipelines: Mutex<HashMap<(&'static str, &'static str), Arc<CompiledKernel>>>,
    recording: Mutex<Recording>,
    /// The uniform blocks of the recorded dispatches, one per `uniform_stride` bytes,
    /// uploaded just before the encoder is submitted (one buffer instead of one each).
    uniforms: wgpu::Buffer,
    uniform_stride: usize,
    /// [`Bind::Data`] of the recorded dispatches, uploaded like the uniform blocks.
    data: wgpu::Buffer,
    data_align: usize,
    /// Free kernel-output buffers ([`Gpu::scratch`]) and the bind-group cache.
    pool: Arc<BufferPool>,
    /// A NaN-filled buffer copied over reused outputs when poisoning.
    poison_source: Mutex<Option<wgpu::Buffer>>,
    /// Dispatches recorded before a submission is forced.
    submit_every: usize,
    counters: Counters,
    /// Most bytes of one slot arena (0: only the device's limits), see [`Gpu::limit_arenas`].
    arena_bytes: AtomicU64,
    /// How long a wait for the device polls before it blocks ([`Gpu::wait`]).
    spin: std::time::Duration,
    /// Whether device placement copies slots from imported host memory (see
    /// [`Gpu::set_host_copies`]).
    host_copies: std::sync::atomic::AtomicBool,
}

/// Workgroup memory the tiled matrix products use (`tile_w` and `tile_x` in
/// `wgsl/quant.wgsl`).
pub const TILE_WORKGROUP_BYTES: u32 = 24 << 10;

/// Routes per tile the routed tiled products come in (`GM_NARROW` and `GM` in
/// `wgsl/quant.wgsl`).
pub const ROUTE_TILES: [usize; 2] = [16, 64];

/// Bytes of [`Gpu::uniforms`]: 16,384 dispatches at the usual 256-byte alignment before a
/// submission is forced.
const UNIFORM_RING: u64 = 4 << 20;
/// Bytes of [`Gpu::data`]; a [`Bind::Data`] beyond what is left goes into a buffer of its own.
const DATA_RING: u64 = 4 << 20;
/// Microseconds a wait polls the device before blocking, on GPUs that are not CPU
/// emulations (`SLOTSTREAM_GPU_SPIN_US` overrides; 0 always blocks): a blocking wait can
/// take far longer to wake up than a short step takes to finish.
const SPIN_US: u64 = 20_000;
/// Invocations a quantized matvec dispatch aims for by default: a decode step's matrices
/// of few rows (a router's 512, a gate's 1) get more lanes per row rather than leave the
/// GPU idle ([`GpuOptions::invocations`] overrides it).
pub const INVOCATIONS: usize = 1 << 17;
/// Default number of dispatches recorded before they are submitted without waiting
/// (`SLOTSTREAM_GPU_SUBMIT_EVERY` overrides; 0 submits only at read-backs and writes).
pub const SUBMIT_EVERY: usize = 64;
/// Cached bind groups kept before the cache is emptied: a backstop for buffers that are
/// not [`DeviceBuffer`]s and are dropped while the device lives (a dropped model's weights).
const BIND_GROUP_CACHE: usize = 8192;
/// Bytes of free buffers the pool keeps; buffers returned beyond it are destroyed.
const POOL_FREE_BYTES: u64 = 1 << 30;

/// The count in environment variable `name` (a tuning knob); `None` when it is unset or
/// not a non-negative integer (with a warning naming it).
fn env_count<T: std::str::FromStr>(name: &str) -> Option<T> {
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
fn env_switch(name: &str, on: &[&str], default: bool) -> bool {
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

/// What has been recorded and not yet submitted.
#[derive(Default)]
struct Recording {
    /// The open compute pass of `encoder` (ended before copies and at submission; declared
    /// first so that it is also dropped before the encoder).
    pass: Option<wgpu::ComputePass<'static>>,
    encoder: Option<wgpu::CommandEncoder>,
    /// Uniform blocks of the recorded dispatches, in [`Gpu::uniforms`]' layout.
    uniforms: Vec<u8>,
    /// Staged [`Bind::Data`] bytes, in [`Gpu::data`]'s layout.
    data: Vec<u8>,
    dispatches: usize,
    /// Timestamps per dispatch (`SLOTSTREAM_GPU_PROFILE`).
    profiler: Option<Profiler>,
}

impl Recording {
    /// The encoder with no pass open, for copies and clears.
    fn encoder(&mut self, device: &wgpu::Device) -> &mut wgpu::CommandEncoder {
        // Ending the pass (dropping it) unlocks the encoder.
        self.pass = None;
        self.encoder
            .get_or_insert_with(|| device.create_command_encoder(&Default::default()))
    }
}

/// A storage binding of a dispatch (after the uniform block at binding 0).
#[derive(Clone, Copy, Debug)]
pub enum Bind<'a> {
    /// A whole buffer that outlives many dispatches (its bind groups are cached).
    Buffer(&'a wgpu::Buffer),
    /// A whole buffer bound for this dispatch alone (its bind group is not cached, so it
    /// does not keep the buffer alive).
    Once(&'a wgpu::Buffer),
    /// Small bytes for this dispatch alone (padded to 4-byte words), staged in a ring
    /// buffer uploaded at submission instead of a buffer of their own. At most one per
    /// dispatch may be bound read-write.
    Data(&'a [u8]),
}

impl<'a> From<&'a wgpu::Buffer> for Bind<'a> {
    fn from(b: &'a wgpu::Buffer) -> Self {
        Bind::Buffer(b)
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct BindKey {
    kernel: (&'static str, &'static str),
    /// (buffer, offset, size) per storage binding.
    buffers: Vec<(wgpu::Buffer, u64, u64)>,
}

/// Bind groups by kernel and bound buffer ranges (the uniform ring is bound through a
/// dynamic offset, so it is not part of the key).
#[derive(Default)]
struct BindGroups {
    map: Mutex<HashMap<BindKey, wgpu::BindGroup>>,
}

impl BindGroups {
    fn lock(&self) -> MutexGuard<'_, HashMap<BindKey, wgpu::BindGroup>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops the bind groups that bind `buf`, so that they no longer keep it alive.
    fn forget(&self, buf: &wgpu::Buffer) {
        self.lock()
            .retain(|key, _| key.buffers.iter().all(|(b, _, _)| b != buf));
    }
}

/// Counts of what the device was asked to do (see [`Gpu::counters`]).
#[derive(Default)]
struct Counters {
    dispatches: AtomicU64,
    submits: AtomicU64,
    waits: AtomicU64,
    buffers_created: AtomicU64,
    bind_groups_created: AtomicU64,
    wait_ns: AtomicU64,
    record_ns: AtomicU64,
    submit_ns: AtomicU64,
    write_bytes: AtomicU64,
}

/// A snapshot of [`Gpu`]'s counters since it was opened, for profiles.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuCounters {
    /// Compute dispatches recorded.
    pub dispatches: u64,
    /// Command encoders submitted.
    pub submits: u64,
    /// Waits for the device (read-backs and syncs).
    pub waits: u64,
    /// wgpu buffers created (kernel outputs the pool could not serve, uploads, read-back
    /// staging).
    pub buffers_created: u64,
    /// Bind groups created (the cache missed).
    pub bind_groups_created: u64,
    /// Nanoseconds spent waiting for the device.
    pub wait_ns: u64,
    /// Nanoseconds spent recording dispatches ([`Gpu::dispatch_with`], submissions it
    /// forces excluded).
    pub record_ns: u64,
    /// Nanoseconds spent ending passes, finishing encoders and submitting them.
    pub submit_ns: u64,
    /// Bytes written through the queue ([`Gpu::write`]).
    pub write_bytes: u64,
}

impl std::ops::Sub for GpuCounters {
    type Output = GpuCounters;
    fn sub(self, o: GpuCounters) -> GpuCounters {
        GpuCounters {
            dispatches: self.dispatches - o.dispatches,
            submits: self.submits - o.submits,
            waits: self.waits - o.waits,
            buffers_created: self.buffers_created - o.buffers_created,
            bind_groups_created: self.bind_groups_created - o.bind_groups_created,
            wait_ns: self.wait_ns - o.wait_ns,
            record_ns: self.record_ns - o.record_ns,
            submit_ns: self.submit_ns - o.submit_ns,
            write_bytes: self.write_bytes - o.write_bytes,
        }
    }
}

/// Free kernel-output buffers by size class.
///
/// Why reuse is safe without waiting for the device: a buffer comes back here when the
/// last tensor holding it is dropped, which can happen while dispatches that read or write
/// it are recorded but not yet executed (or not even submitted). Its next user records its
/// own dispatches (or copies) later on the same queue, and wgpu orders every use of a
/// buffer on a queue: within a command encoder it inserts a barrier before each dispatch
/// whose use of a buffer conflicts with an earlier one (read then write, write then write,
/// write then read; compute passes track usage per dispatch), and across submissions it
/// transitions buffers from their last state at the start of each submission. So the new
/// writer's dispatch runs only after the old readers have finished, just as if the buffer
/// were new. The only writes that bypass the encoder are `queue.write_buffer` ones, which
/// land before the *next* submission's commands; [`Gpu::write`] therefore submits
/// everything recorded first, and kernel outputs are never written that way.
#[derive(Default)]
pub struct BufferPool {
    free: Mutex<FreeLists>,
    /// The device's bind-group cache, told when a buffer goes for good.
    bind_groups: BindGroups,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BufferPool")
    }
}

/// Free buffers by size class, ordered by wgpu's buffer ids: a request takes the lowest,
/// so a step that frees what it took finds the same buffers again in the next step and
/// its dispatches bind the same buffers (their bind groups stay cached). Taking the last
/// freed instead would shift buffers between tensors that outlive a step and the rest.
#[derive(Default)]
struct FreeLists {
    by_size: HashMap<u64, std::collections::BTreeSet<wgpu::Buffer>>,
    bytes: u64,
}

/// Size class of a request of `len` bytes: 256 bytes at least, then eight classes per
/// power of two, so buffers of slightly different lengths (a growing context) share one.
fn size_class(len: u64) -> u64 {
    let len = len.max(256);
    let step = (len.next_power_of_two() / 8).max(256);
    len.next_multiple_of(step)
}

impl BufferPool {
    fn take(&self, size: u64) -> Option<wgpu::Buffer> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let buf = free.by_size.get_mut(&size)?.pop_first()?;
        free.bytes -= size;
        Some(buf)
    }

    fn put(&self, buf: wgpu::Buffer) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let size = buf.size();
        if free.bytes + size > POOL_FREE_BYTES {
            drop(free);
            self.bind_groups.forget(&buf);
            return; // destroyed when dropped here
        }
        free.bytes += size;
        free.by_size.entry(size).or_default().insert(buf);
    }
}

/// A storage buffer that goes back to its [`BufferPool`] when dropped, or a plain one
/// (uploads, states, KV caches) that is destroyed then; either way no cached bind group
/// keeps a destroyed buffer alive. Derefs to the `wgpu::Buffer`, which may be longer than
/// asked for.
#[derive(Debug)]
pub struct DeviceBuffer {
    buf: wgpu::Buffer,
    pool: Arc<BufferPool>,
    pooled: bool,
}

impl std::ops::Deref for DeviceBuffer {
    type Target = wgpu::Buffer;
    fn deref(&self) -> &wgpu::Buffer {
        &self.buf
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.pooled {
            self.pool.put(self.buf.clone());
        } else {
            self.pool.bind_groups.forget(&self.buf);
        }
    }
}

impl Gpu {
    /// Opens the adapter chosen by `options` (else wgpu's high-performance default) with the adapter's own limits, not wgpu's defaults
    /// (which cap a storage binding at 128 MiB).
    /// Errors: no adapter, or none whose name matches.
    pub fn open(options: &GpuOptions) -> Result<Self> {
        let adapter = choose_adapter(&instance(), options)?;
        let limits = adapter.limits();
        let profile = options.profile && {
            let ok = adapter.features().contains(Profiler::features());
            if !ok {
                tracing::warn!("GPU profile: the adapter has no timestamps inside passes");
            }
            ok
        };
        let info = adapter.get_info();
        let subgroups = !options.no_subgroups
            && adapter.features().contains(wgpu::Features::SUBGROUP)
            && info.subgroup_min_size.is_power_of_two()
            && info.subgroup_min_size <= 256;
        let subgroup_lanes = if subgroups { info.subgroup_min_size } else { 1 };
        let tiled =
            !options.no_tiles && limits.max_compute_workgroup_storage_size >= TILE_WORKGROUP_BYTES;
        let mut required_features = wgpu::Features::empty();
        if profile {
            required_features |= Profiler::features();
        }
        if subgroups {
            required_features |= wgpu::Features::SUBGROUP;
        }
        let desc = wgpu::DeviceDescriptor {
            label: Some("slotstream"),
            required_features,
            required_limits: limits.clone(),
            ..Default::default()
        };
        let with_import = super::host_memory::open_device(&adapter, &desc);
        let (device, queue) = match with_import {
            Some(Ok(pair)) => pair,
            other => {
                if let Some(Err(e)) = other {
                    tracing::warn!(error = %e, "host-memory import unavailable");
                }
                pollster::block_on(adapter.request_device(&desc)).map_err(|e| {
                    Error::Gpu(format!("could not open {}: {e}", adapter.get_info().name))
                })?
            }
        };
        let host_import = super::host_memory::supported(&device);
        let dummy = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("unused binding"),
            size: 4,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let uniforms = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("uniform blocks"),
            size: UNIFORM_RING,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let uniform_stride = (limits.min_uniform_buffer_offset_alignment as usize).max(256);
        let data = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("dispatch data"),
            size: DATA_RING,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let data_align = (limits.min_storage_buffer_offset_alignment as usize).max(16);
        let submit_every = options.submit_every.unwrap_or(SUBMIT_EVERY);
        let summary = summarize(&adapter);
        let spin_default = if summary.device_type == "Cpu" {
            0
        } else {
            SPIN_US
        };
        let spin_us = options.spin_us.unwrap_or(spin_default);
        let all_checks = options.all_checks;
        let invocations = options.invocations.unwrap_or(INVOCATIONS);
        let route_tile = options.route_tile.filter(|&t| {
            let ok = ROUTE_TILES.contains(&t);
            if !ok {
                tracing::warn!(
                    route_tile = t,
                    "routes per tile are 16 or 64; choosing per layer"
                );
            }
            ok
        });
        // At debug level: `open_compute` logs the one line saying which backend runs.
        tracing::debug!(adapter = %summary.name, backend = %summary.backend, submit_every, spin_us, subgroup_lanes, tiled, all_checks, profile, "GPU opened");
        let profiler = profile.then(|| Profiler::new(&device, &queue));
        let mut gpu = Gpu {
            device,
            queue,
            adapter: summary,
            limits,
            host_import,
            dummy,
            subgroup_lanes,
            tiled,
            route_tile,
            all_checks,
            poison: options.poison_outputs,
            pipelines: Mutex::default(),
            recording: Mutex::new(Recording {
                profiler,
                ..Default::default()
            }),
            uniforms,
            uniform_stride,
            data,
            data_align,
            pool: Arc::default(),
            poison_source: Mutex::default(),
            submit_every,
            counters: Counters::default(),
            arena_bytes: AtomicU64::new(0),
            spin: std::time::Duration::from_micros(spin_us),
            host_copies: std::sync::atomic::AtomicBool::new(host_import && !options.no_host_copy),
            invocations,
        };
        if gpu.subgroup_lanes > 1 && !gpu.subgroups_as_assumed()? {
            tracing::warn!(
                "subgroups are not laid out as the reductions assume; reducing in shared memory"
            );
            gpu.subgroup_lanes = 1;
        }
        Ok(gpu)
    }

    /// Runs [`SUBGROUP_PROBE`]: whether every invocation of a workgroup finds its
    /// subgroup as the reductions assume. Errors: the read-back failed.
    fn subgroups_as_assumed(&self) -> Result<bool> {
        const PROBE: Kernel = Kernel {
            file: "subgroup_probe.wgsl",
            source: SUBGROUP_PROBE,
            entry: "subgroup_probe",
            bindings: &[Access::ReadWrite],
        };
        uniform_block! {
            /// The probe reads no parameters; a block is bound all the same.
            struct NoParams {
                unused: u32,
            }
        }
        let out = self.zeroed(256 * 4);
        self.dispatch(&PROBE, &NoParams::default(), &[&out], [1, 1, 1]);
        let bytes = self.read(&out, 0, 256 * 4)?;
        let lanes: &[u32] = bytemuck::cast_slice(&bytes);
        Ok(lanes.iter().all(|&ok| ok == 1))
    }

    /// Whether pools attached with device placement from now on have their slots copied
    /// into the device arenas by the GPU from the pool's memory imported as buffers (the
    /// default where host memory can be imported; `SLOTSTREAM_GPU_HOST_COPY=0` turns it
    /// off) rather than written through `queue.write_buffer`'s staging copy.
    pub fn set_host_copies(&self, on: bool) {
        self.host_copies
            .store(on && self.host_import, Ordering::Relaxed);
    }

    /// See [`Gpu::set_host_copies`].
    pub fn host_copies(&self) -> bool {
        self.host_copies.load(Ordering::Relaxed)
    }

    /// Waits until the device has finished every submission (and run the callbacks of
    /// the finished work): polls for up to the spin time, then blocks.
    /// Errors: a lost device.
    pub fn wait(&self) -> Result<()> {
        let start = std::time::Instant::now();
        Self::count(&self.counters.waits);
        let lost = |e: wgpu::PollError| Error::Gpu(format!("waiting for the device: {e}"));
        let mut done = false;
        while !done && start.elapsed() < self.spin {
            done = self
                .device
                .poll(wgpu::PollType::Poll)
                .map_err(lost)?
                .is_queue_empty();
            if !done {
                std::hint::spin_loop();
            }
        }
        if !done {
            self.device
                .poll(wgpu::PollType::Wait {
                    submission_index: None,
                    timeout: None,
                })
                .map_err(lost)?;
        }
        self.counters
            .wait_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Caps the bytes of each slot arena of pools attached from now on (0: no cap), so
    /// tests can spread a small pool over several arenas as a large one is on a GPU.
    pub fn limit_arenas(&self, bytes: u64) {
        self.arena_bytes.store(bytes, Ordering::Relaxed);
    }

    /// GPU time per kernel since the last call, most first (kernel, dispatches,
    /// nanoseconds); `None` unless profiling (`SLOTSTREAM_GPU_PROFILE=1`).
    pub fn profile(&self) -> Option<Vec<(&'static str, u64, u64)>> {
        self.recording().profiler.as_mut().map(Profiler::take)
    }

    /// Cached bind groups that bind `buf` (each keeps it alive).
    pub fn cached_bind_groups_of(&self, buf: &wgpu::Buffer) -> usize {
        self.pool
            .bind_groups
            .lock()
            .keys()
            .filter(|key| key.buffers.iter().any(|(b, _, _)| b == buf))
            .count()
    }

    /// Drops every cached bind group, so buffers that only they still reference (a replaced
    /// pool mirror's arenas) are freed.
    pub fn forget_bind_groups(&self) {
        self.pool.bind_groups.lock().clear();
    }

    /// The cap set by [`Gpu::limit_arenas`] (0: none).
    pub fn arena_limit(&self) -> u64 {
        self.arena_bytes.load(Ordering::Relaxed)
    }

    /// What the device was asked to do since it was opened.
    pub fn counters(&self) -> GpuCounters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        GpuCounters {
            dispatches: get(&c.dispatches),
            submits: get(&c.submits),
            waits: get(&c.waits),
            buffers_created: get(&c.buffers_created),
            bind_groups_created: get(&c.bind_groups_created),
            wait_ns: get(&c.wait_ns),
            record_ns: get(&c.record_ns),
            submit_ns: get(&c.submit_ns),
            write_bytes: get(&c.write_bytes),
        }
    }

    fn count(a: &AtomicU64) {
        a.fetch_add(1, Ordering::Relaxed);
    }

    fn pipeline(&self, k: &Kernel) -> Arc<CompiledKernel> {
        let mut cache = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .entry((k.file, k.entry))
            .or_insert_with(|| {
                let desc = wgpu::ShaderModuleDescriptor {
                    label: Some(k.file),
                    source: wgpu::ShaderSource::Wgsl(
                        kernel_source(k.source, self.subgroup_lanes).into(),
                    ),
                };
                let module = if self.all_checks {
                    self.device.create_shader_module(desc)
                } else {
                    // SAFETY: wgpu's bounds checks, division guards and the rest stay on;
                    // what is turned off is naga's counter in every loop, which only stops
                    // a loop that would not end. Every loop of these kernels runs over a
                    // range bounded by its parameters and steps by a nonzero constant, by
                    // a lane count of at least 1 (16 or more in quant.wgsl), or halves or
                    // doubles a power of two towards a bound.
                    unsafe {
                        self.device.create_shader_module_trusted(
                            desc,
                            wgpu::ShaderRuntimeChecks {
                                force_loop_bounding: false,
                                ..wgpu::ShaderRuntimeChecks::checked()
                            },
                        )
                    }
                };
                let storage = |read_only| wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                };
                let mut entries = vec![wgpu::BindGroupLayoutEntry {
                    binding: 0,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: true,
                        min_binding_size: None,
                    },
                    count: None,
                }];
                for (i, a) in k.bindings.iter().enumerate() {
                    entries.push(wgpu::BindGroupLayoutEntry {
                        binding: i as u32 + 1,
                        visibility: wgpu::ShaderStages::COMPUTE,
                        ty: storage(*a == Access::Read),
                        count: None,
                    });
                }
                let bgl = self
                    .device
                    .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                        label: Some(k.entry),
                        entries: &entries,
                    });
                let layout = self
                    .device
                    .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                        label: Some(k.entry),
                        bind_group_layouts: &[Some(&bgl)],
                        immediate_size: 0,
                    });
                let pipeline =
                    self.device
                        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                            label: Some(k.entry),
                            layout: Some(&layout),
                            module: &module,
                            entry_point: Some(k.entry),
                            // Every kernel writes its workgroup memory before it
                            // reads it, so zeroing it first would be wasted.
                            compilation_options: wgpu::PipelineCompilationOptions {
                                zero_initialize_workgroup_memory: self.all_checks,
                                ..Default::default()
                            },
                            cache: None,
                        });
                Arc::new((pipeline, bgl))
            })
            .clone()
    }

    fn recording(&self) -> MutexGuard<'_, Recording> {
        self.recording.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Uploads the recorded uniform blocks and data and submits the encoder.
    fn submit(&self, rec: &mut Recording) {
        let start = std::time::Instant::now();
        rec.pass = None;
        if let Some(mut enc) = rec.encoder.take() {
            let profiled = rec.profiler.as_ref().is_some_and(|p| p.resolve(&mut enc));
            // Queued before this submission's commands and after the previous
            // submissions' (wgpu orders the writes after their reads of the buffers).
            if !rec.uniforms.is_empty() {
                self.queue.write_buffer(&self.uniforms, 0, &rec.uniforms);
                rec.uniforms.clear();
            }
            if !rec.data.is_empty() {
                self.queue.write_buffer(&self.data, 0, &rec.data);
                rec.data.clear();
            }
            rec.dispatches = 0;
            self.queue.submit([enc.finish()]);
            Self::count(&self.counters.submits);
            if let (true, Some(p)) = (profiled, rec.profiler.as_mut()) {
                if let Err(e) = p.collect(&self.device) {
                    tracing::warn!(error = %e, "GPU profile: timestamps not read");
                }
            }
        }
        Self::add_ns(&self.counters.submit_ns, start);
    }

    fn add_ns(counter: &AtomicU64, since: std::time::Instant) {
        counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Records one dispatch of `k` over `groups` workgroups (x, y from [`grid`], z given)
    /// with `params` as the uniform block and `buffers` at bindings 1...
    pub fn dispatch<P: Uniform>(
        &self,
        k: &Kernel,
        params: &P,
        buffers: &[&wgpu::Buffer],
        groups: [u32; 3],
    ) {
        let binds: Vec<Bind<'_>> = buffers.iter().map(|&b| Bind::Buffer(b)).collect();
        self.dispatch_with(k, params, &binds, groups);
    }

    /// [`Gpu::dispatch`] with bindings that may be staged data ([`Bind::Data`]).
    pub fn dispatch_with<P: Uniform>(
        &self,
        k: &Kernel,
        params: &P,
        binds: &[Bind<'_>],
        groups: [u32; 3],
    ) {
        debug_assert_eq!(
            binds.len(),
            k.bindings.len(),
            "{}::{} bindings",
            k.file,
            k.entry
        );
        let start = std::time::Instant::now();
        let pipeline = self.pipeline(k);
        let mut words: Vec<u32> = bytemuck::cast_slice(bytemuck::bytes_of(params)).to_vec();
        // Uniform blocks are read in 16-byte rows.
        words.resize(words.len().next_multiple_of(4).max(4), 0);
        let block = bytemuck::cast_slice::<u32, u8>(&words);
        assert!(
            block.len() <= self.uniform_stride,
            "{}::{}: uniform block too large",
            k.file,
            k.entry
        );
        let staged: usize = binds
            .iter()
            .map(|b| match b {
                Bind::Data(d) => d
                    .len()
                    .next_multiple_of(4)
                    .max(4)
                    .next_multiple_of(self.data_align),
                Bind::Buffer(_) | Bind::Once(_) => 0,
            })
            .sum();
        let ring = staged <= DATA_RING as usize;
        let mut rec = self.recording();
        if rec.uniforms.len() + self.uniform_stride > UNIFORM_RING as usize
            || (ring && rec.data.len() + staged > DATA_RING as usize)
            || rec.profiler.as_ref().is_some_and(Profiler::full)
        {
            self.submit(&mut rec);
        }
        // Staged data goes into the ring when all of it fits; it is written at the
        // submission that also carries this dispatch (both are recorded under one lock),
        // so no later submission can overwrite it first. Otherwise each piece gets a
        // buffer of its own.
        let mut own = false;
        let mut ranges = Vec::with_capacity(binds.len());
        for b in binds {
            match *b {
                Bind::Buffer(buf) => ranges.push((buf.clone(), 0, buf.size())),
                Bind::Once(buf) => {
                    own = true;
                    ranges.push((buf.clone(), 0, buf.size()));
                }
                Bind::Data(bytes) => {
                    let len = bytes.len().next_multiple_of(4).max(4);
                    if ring {
                        let at = rec.data.len();
                        rec.data.extend_from_slice(bytes);
                        rec.data
                            .resize(at + len.next_multiple_of(self.data_align), 0);
                        ranges.push((self.data.clone(), at as u64, len as u64));
                    } else {
                        own = true;
                        ranges.push((self.buffer_with(bytes), 0, len as u64));
                    }
                }
            }
        }
        let offset = rec.uniforms.len();
        rec.uniforms.extend_from_slice(block);
        rec.uniforms.resize(offset + self.uniform_stride, 0);
        let key = BindKey {
            kernel: (k.file, k.entry),
            buffers: ranges,
        };
        let bind = {
            let mut cache = self.pool.bind_groups.lock();
            match cache.get(&key) {
                Some(bg) => bg.clone(),
                None => {
                    let mut entries = vec![wgpu::BindGroupEntry {
                        binding: 0,
                        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: &self.uniforms,
                            offset: 0,
                            size: std::num::NonZeroU64::new(self.uniform_stride as u64),
                        }),
                    }];
                    for (i, (buf, off, size)) in key.buffers.iter().enumerate() {
                        entries.push(wgpu::BindGroupEntry {
                            binding: i as u32 + 1,
                            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                buffer: buf,
                                offset: *off,
                                size: std::num::NonZeroU64::new(*size),
                            }),
                        });
                    }
                    let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some(k.entry),
                        layout: &pipeline.1,
                        entries: &entries,
                    });
                    Self::count(&self.counters.bind_groups_created);
                    tracing::trace!(kernel = k.entry, offsets = ?key.buffers.iter().map(|b| b.1).collect::<Vec<_>>(), "bind group created");
                    // Bind groups over one-off buffers are not worth keeping, and would
                    // keep them alive.
                    if !own {
                        if cache.len() >= BIND_GROUP_CACHE {
                            cache.clear();
                        }
                        cache.insert(key, bg.clone());
                    }
                    bg
                }
            }
        };
        if rec.pass.is_none() {
            let enc = rec
                .encoder
                .get_or_insert_with(|| self.device.create_command_encoder(&Default::default()));
            let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            });
            rec.pass = Some(pass.forget_lifetime());
        }
        let recording = &mut *rec;
        let pass = recording.pass.as_mut().expect("a compute pass is open");
        if let Some(p) = recording.profiler.as_mut() {
            p.before(pass, k.entry);
        }
        pass.set_pipeline(&pipeline.0);
        pass.set_bind_group(0, &bind, &[offset as u32]);
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        if let Some(p) = &recording.profiler {
            p.after(pass);
        }
        Self::count(&self.counters.dispatches);
        rec.dispatches += 1;
        Self::add_ns(&self.counters.record_ns, start);
        if self.submit_every > 0 && rec.dispatches >= self.submit_every {
            self.submit(&mut rec);
        }
    }

    /// Records a buffer-to-buffer copy in order with the dispatches.
    pub fn copy(
        &self,
        src: &wgpu::Buffer,
        src_off: u64,
        dst: &wgpu::Buffer,
        dst_off: u64,
        len: u64,
    ) {
        if len == 0 {
            return;
        }
        let mut rec = self.recording();
        rec.encoder(&self.device)
            .copy_buffer_to_buffer(src, src_off, dst, dst_off, len);
    }

    /// Records zeroing the first `len` bytes of `dst`, in order with the dispatches.
    pub fn clear(&self, dst: &wgpu::Buffer, len: u64) {
        let mut rec = self.recording();
        rec.encoder(&self.device)
            .clear_buffer(dst, 0, Some(len.next_multiple_of(4)));
    }

    /// Submits everything recorded so far.
    pub fn flush(&self) {
        let mut rec = self.recording();
        self.submit(&mut rec);
    }

    /// Submits everything recorded and waits until the device has finished it (for
    /// benchmarks and tests; the forward pass synchronises through read-backs).
    pub fn sync(&self) -> Result<()> {
        self.flush();
        self.wait()
    }

    /// A buffer of at least `len` bytes for a kernel to fill, from the pool of free
    /// outputs (see [`BufferPool`] for why reuse needs no wait). It holds what an earlier
    /// use left (NaN when poisoning, so a kernel that leaves part of its output unwritten
    /// fails its tests with reused buffers too).
    pub fn scratch(&self, len: u64) -> DeviceBuffer {
        let max = self
            .limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size);
        let size = size_class(len.max(4)).min(max).max(len.next_multiple_of(4));
        let buf = self.pool.take(size).unwrap_or_else(|| self.zeroed(size));
        if self.poison {
            let mut source = self.poison_source.lock().unwrap_or_else(|p| p.into_inner());
            if source.as_ref().is_none_or(|s| s.size() < size) {
                *source = Some(self.buffer_with(&vec![0xFF; size as usize]));
            }
            self.copy(source.as_ref().expect("poison source"), 0, &buf, 0, size);
        }
        DeviceBuffer {
            buf,
            pool: self.pool.clone(),
            pooled: true,
        }
    }

    /// [`Gpu::scratch`] with its first `len` bytes zeroed (a recorded clear).
    pub fn scratch_zeroed(&self, len: u64) -> DeviceBuffer {
        let buf = self.scratch(len);
        self.clear(&buf, len.max(4));
        buf
    }

    /// `buf` as a [`DeviceBuffer`] that is destroyed, not pooled, when dropped.
    pub fn plain(&self, buf: wgpu::Buffer) -> DeviceBuffer {
        DeviceBuffer {
            buf,
            pool: self.pool.clone(),
            pooled: false,
        }
    }

    /// A storage buffer of `len` bytes (at least 4), zeroed.
    pub fn zeroed(&self, len: u64) -> wgpu::Buffer {
        Self::count(&self.counters.buffers_created);
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: len.max(4).next_multiple_of(4),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A storage buffer holding `bytes` (padded with zeros to a multiple of 4).
    pub fn buffer_with(&self, bytes: &[u8]) -> wgpu::Buffer {
        let mut padded;
        let contents = if bytes.len().is_multiple_of(4) && !bytes.is_empty() {
            bytes
        } else {
            padded = bytes.to_vec();
            padded.resize(bytes.len().next_multiple_of(4).max(4), 0);
            &padded
        };
        Self::count(&self.counters.buffers_created);
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
            })
    }

    /// Submits the writes queued so far and waits for them, so their staging memory is
    /// freed (a long run of [`Gpu::write`]s would otherwise hold all of it until the next
    /// submission).
    pub fn settle_writes(&self) -> Result<()> {
        self.flush();
        self.queue.submit([]);
        self.sync()
    }

    /// Writes `bytes` at `offset` of `dst`, ordered after everything recorded so far.
    pub fn write(&self, dst: &wgpu::Buffer, offset: u64, bytes: &[u8]) {
        // queue.write_buffer lands before the next submission's commands, so anything
        // already recorded must be submitted first.
        self.flush();
        self.counters
            .write_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.queue.write_buffer(dst, offset, bytes);
    }

    /// Copies `len` bytes at `offset` of `src` back to the host (submits and waits).
    /// Errors: the device was lost or the mapping failed.
    pub fn read(&self, src: &wgpu::Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        Ok(self
            .read_many(&[(src, offset, len)])?
            .pop()
            .unwrap_or_default())
    }

    /// Reads several ranges `(buffer, offset, len)` back with one submission and one wait.
    /// Errors: the device was lost or the mapping failed.
    pub fn read_many(&self, ranges: &[(&wgpu::Buffer, u64, u64)]) -> Result<Vec<Vec<u8>>> {
        let total: u64 = ranges.iter().map(|r| r.2.next_multiple_of(4)).sum();
        if total == 0 {
            return Ok(ranges.iter().map(|_| Vec::new()).collect());
        }
        Self::count(&self.counters.buffers_created);
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: total,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut at = 0;
        for &(src, offset, len) in ranges {
            self.copy(src, offset, &staging, at, len.next_multiple_of(4));
            at += len.next_multiple_of(4);
        }
        self.flush();
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|_| Error::Gpu("read-back was never completed".into()))?
            .map_err(|e| Error::Gpu(format!("read-back failed: {e}")))?;
        let out = {
            let mapped = slice
                .get_mapped_range()
                .map_err(|e| Error::Gpu(format!("read-back failed: {e}")))?;
            let mut at = 0usize;
            ranges
                .iter()
                .map(|&(_, _, len)| {
                    let v = mapped[at..at + len as usize].to_vec();
                    at += len.next_multiple_of(4) as usize;
                    v
                })
                .collect()
        };
        staging.unmap();
        Ok(out)
    }
}
