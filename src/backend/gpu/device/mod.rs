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

mod adapter;
mod buffers;
mod counters;
mod kernel;
mod record;

pub use adapter::{chosen_adapter, list_adapters, AdapterSummary, GpuOptions};
pub use buffers::{Bind, BufferPool, DeviceBuffer};
pub use counters::GpuCounters;
pub(crate) use kernel::uniform_block;
pub use kernel::{
    grid, kernel_source, shader, Access, Kernel, Uniform, REDUCE, SHADERS, SUBGROUP_PROBE,
};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::profile::Profiler;
use crate::error::{Error, Result};

use adapter::{choose_adapter, instance, summarize};
use counters::Counters;
use record::Recording;

/// A kernel's compute pipeline and the layout of its bind group.
type CompiledKernel = (wgpu::ComputePipeline, wgpu::BindGroupLayout);
/// What tells compiled kernels apart: file, entry point and defines ([`Kernel::defines`]).
pub(super) type PipelineKey = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

/// The device, its queue and the compiled kernels.
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub adapter: AdapterSummary,
    pub limits: wgpu::Limits,
    /// Whether host memory can be imported as GPU buffers (unified placement).
    pub host_import: bool,
    /// A 16-byte buffer bound where a kernel's binding is unused (16: a binding of `vec4`
    /// elements takes at least one).
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
    pipelines: Mutex<HashMap<PipelineKey, Arc<CompiledKernel>>>,
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

/// Routes per tile the routed tiled products come in, narrow and wide (`GM_NARROW` and
/// `GM` in `wgsl/quant.wgsl`); what [`GpuOptions::route_tile`] may force.
pub const ROUTE_TILE_SIZES: [usize; 2] = [16, 64];

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
/// 32: an all-resident decode step on the H200 (about 370 dispatches) ran 2.7% faster
/// than at 64, 12% faster than at 256 and 38% faster than with no early submits
/// (BENCHMARKS.md, "How often a decode step submits").
pub const SUBMIT_EVERY: usize = 32;
/// Cached bind groups kept before the cache is emptied: a backstop for buffers that are
/// not [`DeviceBuffer`]s and are dropped while the device lives (a dropped model's weights).
const BIND_GROUP_CACHE: usize = 8192;
/// Bytes of free buffers the pool keeps; buffers returned beyond it are destroyed.
const POOL_FREE_BYTES: u64 = 1 << 30;

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
            size: 16,
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
            let ok = ROUTE_TILE_SIZES.contains(&t);
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
            defines: &[],
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

    /// The cap set by [`Gpu::limit_arenas`] (0: none).
    pub fn arena_limit(&self) -> u64 {
        self.arena_bytes.load(Ordering::Relaxed)
    }

    fn pipeline(&self, k: &Kernel) -> Arc<CompiledKernel> {
        let mut cache = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .entry((k.file, k.entry, k.defines))
            .or_insert_with(|| {
                let desc = wgpu::ShaderModuleDescriptor {
                    label: Some(k.file),
                    source: wgpu::ShaderSource::Wgsl(k.wgsl(self.subgroup_lanes).into()),
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
}
