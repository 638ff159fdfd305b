//! The wgpu device, kernels compiled from `wgsl/`, and the dispatch machinery every
//! kernel family uses.
//!
//! Conventions for kernels (every file in `wgsl/`):
//! - `@group(0) @binding(0)` is a uniform block of 32-bit parameters; storage buffers
//!   follow at bindings 1.. in the order the Rust side passes them ([`Kernel::bindings`]).
//! - Workgroup counts above 65,535 use a 2-D grid ([`grid`]); a kernel computes its linear
//!   workgroup index as `wid.x + wid.y * nwg.x` and returns early past the end. The z
//!   dimension (tokens or routes) stays below 65,535 because the model runs long inputs
//!   in chunks (`model::PREFILL_CHUNK`).
//! - The uniform block passed must be at least as long as the shader's `Params` struct
//!   (it is padded to 16 bytes, not to the struct).
//! - Dispatches are recorded into one pending command encoder and submitted together at
//!   the next read-back ([`Gpu::flush`]), so a token costs few submissions. Their uniform
//!   blocks go into one buffer at aligned offsets, uploaded at submission.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use wgpu::util::DeviceExt;

use crate::error::{Error, Result};

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

/// Every WGSL file of the crate, embedded at build time: `(file name, source)`.
pub const SHADERS: &[(&str, &str)] = &[
    ("quant.wgsl", include_str!("../../../wgsl/quant.wgsl")),
    (
        "elementwise.wgsl",
        include_str!("../../../wgsl/elementwise.wgsl"),
    ),
    ("norm.wgsl", include_str!("../../../wgsl/norm.wgsl")),
    ("conv.wgsl", include_str!("../../../wgsl/conv.wgsl")),
    (
        "gated_delta.wgsl",
        include_str!("../../../wgsl/gated_delta.wgsl"),
    ),
    (
        "attention.wgsl",
        include_str!("../../../wgsl/attention.wgsl"),
    ),
    ("router.wgsl", include_str!("../../../wgsl/router.wgsl")),
    ("hyper.wgsl", include_str!("../../../wgsl/hyper.wgsl")),
];

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
}

/// Which adapter to use.
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    /// Case-insensitive substring of the adapter name (`--device`, `WGPU_ADAPTER_NAME`).
    pub adapter: Option<String>,
    /// Fill every new output buffer with NaN bit patterns instead of zeros, so a kernel
    /// that leaves an output untouched fails its test instead of passing by accident.
    pub poison_outputs: bool,
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

fn summarize(a: &wgpu::Adapter) -> AdapterSummary {
    let info = a.get_info();
    let l = a.limits();
    AdapterSummary {
        name: info.name,
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info)
            .trim()
            .to_string(),
        max_buffer_size: l.max_buffer_size,
        max_storage_buffer_binding_size: l.max_storage_buffer_binding_size as u64,
        max_compute_workgroups_per_dimension: l.max_compute_workgroups_per_dimension,
        max_compute_invocations_per_workgroup: l.max_compute_invocations_per_workgroup,
        max_compute_workgroup_storage_size: l.max_compute_workgroup_storage_size,
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
    poison: bool,
    pipelines: Mutex<
        HashMap<(&'static str, &'static str), Arc<(wgpu::ComputePipeline, wgpu::BindGroupLayout)>>,
    >,
    recording: Mutex<Recording>,
    /// The uniform blocks of the recorded dispatches, one per `uniform_stride` bytes,
    /// uploaded just before the encoder is submitted (one buffer instead of one each).
    uniforms: wgpu::Buffer,
    uniform_stride: usize,
}

/// Bytes of [`Gpu::uniforms`]: 16,384 dispatches at the usual 256-byte alignment before a
/// submission is forced.
const UNIFORM_RING: u64 = 4 << 20;

/// What has been recorded and not yet submitted.
#[derive(Default)]
struct Recording {
    encoder: Option<wgpu::CommandEncoder>,
    /// Uniform blocks of the recorded dispatches, in [`Gpu::uniforms`]' layout.
    uniforms: Vec<u8>,
}

impl Gpu {
    /// Opens the adapter chosen by `options` (else `WGPU_ADAPTER_NAME`, else wgpu's
    /// high-performance default) with the adapter's own limits, not wgpu's defaults
    /// (which cap a storage binding at 128 MiB).
    /// Errors: no adapter, or none whose name matches.
    pub fn open(options: &GpuOptions) -> Result<Self> {
        let inst = instance();
        let wanted = options
            .adapter
            .clone()
            .or_else(|| std::env::var("WGPU_ADAPTER_NAME").ok())
            .filter(|s| !s.is_empty());
        let adapters = pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()));
        let adapter = match &wanted {
            Some(name) => {
                let lower = name.to_lowercase();
                adapters
                    .into_iter()
                    .find(|a| a.get_info().name.to_lowercase().contains(&lower))
                    .ok_or_else(|| Error::Gpu(format!("no GPU adapter matches `{name}` (see `slotstream devices`)")))?
            }
            None => pollster::block_on(inst.request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            }))
            .map_err(|e| Error::Gpu(format!("no GPU adapter found ({e}); install a Vulkan or Metal driver (on Linux without a GPU: Mesa's lavapipe, package mesa-vulkan-drivers)")))?,
        };
        let limits = adapter.limits();
        let desc = wgpu::DeviceDescriptor {
            label: Some("slotstream"),
            required_features: wgpu::Features::empty(),
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
        let summary = summarize(&adapter);
        tracing::info!(adapter = %summary.name, backend = %summary.backend, "GPU opened");
        Ok(Gpu {
            device,
            queue,
            adapter: summary,
            limits,
            host_import,
            dummy,
            poison: options.poison_outputs,
            pipelines: Mutex::default(),
            recording: Mutex::default(),
            uniforms,
            uniform_stride,
        })
    }

    fn pipeline(&self, k: &Kernel) -> Arc<(wgpu::ComputePipeline, wgpu::BindGroupLayout)> {
        let mut cache = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .entry((k.file, k.entry))
            .or_insert_with(|| {
                let module = self
                    .device
                    .create_shader_module(wgpu::ShaderModuleDescriptor {
                        label: Some(k.file),
                        source: wgpu::ShaderSource::Wgsl(k.source.into()),
                    });
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
                        has_dynamic_offset: false,
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
                            compilation_options: Default::default(),
                            cache: None,
                        });
                Arc::new((pipeline, bgl))
            })
            .clone()
    }

    fn recording(&self) -> MutexGuard<'_, Recording> {
        self.recording.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Uploads the recorded uniform blocks and submits the encoder.
    fn submit(&self, rec: &mut Recording) {
        if let Some(enc) = rec.encoder.take() {
            if !rec.uniforms.is_empty() {
                // Queued before this submission's commands and after the previous
                // submissions' (wgpu orders the write after their reads of the buffer).
                self.queue.write_buffer(&self.uniforms, 0, &rec.uniforms);
                rec.uniforms.clear();
            }
            self.queue.submit([enc.finish()]);
        }
    }

    /// Records one dispatch of `k` over `groups` workgroups (x, y from [`grid`], z given)
    /// with `params` as the uniform block and `buffers` at bindings 1...
    pub fn dispatch(
        &self,
        k: &Kernel,
        params: &[u32],
        buffers: &[&wgpu::Buffer],
        groups: [u32; 3],
    ) {
        debug_assert_eq!(
            buffers.len(),
            k.bindings.len(),
            "{}::{} bindings",
            k.file,
            k.entry
        );
        let pipeline = self.pipeline(k);
        let mut words = params.to_vec();
        // Uniform blocks are read in 16-byte rows.
        words.resize(params.len().next_multiple_of(4).max(4), 0);
        let block = bytemuck::cast_slice::<u32, u8>(&words);
        assert!(
            block.len() <= self.uniform_stride,
            "{}::{}: uniform block too large",
            k.file,
            k.entry
        );
        let mut rec = self.recording();
        if rec.uniforms.len() + self.uniform_stride > UNIFORM_RING as usize {
            self.submit(&mut rec);
        }
        let offset = rec.uniforms.len();
        rec.uniforms.extend_from_slice(block);
        rec.uniforms.resize(offset + self.uniform_stride, 0);
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &self.uniforms,
                offset: offset as u64,
                size: std::num::NonZeroU64::new(block.len() as u64),
            }),
        }];
        for (i, b) in buffers.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: b.as_entire_binding(),
            });
        }
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(k.entry),
            layout: &pipeline.1,
            entries: &entries,
        });
        let enc = rec
            .encoder
            .get_or_insert_with(|| self.device.create_command_encoder(&Default::default()));
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(k.entry),
            timestamp_writes: None,
        });
        pass.set_pipeline(&pipeline.0);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
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
        let enc = rec
            .encoder
            .get_or_insert_with(|| self.device.create_command_encoder(&Default::default()));
        enc.copy_buffer_to_buffer(src, src_off, dst, dst_off, len);
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
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .map(|_| ())
            .map_err(|e| Error::Gpu(format!("waiting for the device: {e}")))
    }

    /// A storage buffer of `len` bytes (at least 4) for a kernel to fill: zeroed, or
    /// NaN-filled when poisoning.
    pub fn buffer(&self, len: u64) -> wgpu::Buffer {
        if self.poison {
            return self.buffer_with(&vec![0xFF; len.max(4) as usize]);
        }
        self.zeroed(len)
    }

    /// A storage buffer of `len` bytes (at least 4), zeroed.
    pub fn zeroed(&self, len: u64) -> wgpu::Buffer {
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
        let contents = if bytes.len() % 4 == 0 && !bytes.is_empty() {
            bytes
        } else {
            padded = bytes.to_vec();
            padded.resize(bytes.len().next_multiple_of(4).max(4), 0);
            &padded
        };
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
            })
    }

    /// Writes `bytes` at `offset` of `dst`, ordered after everything recorded so far.
    pub fn write(&self, dst: &wgpu::Buffer, offset: u64, bytes: &[u8]) {
        // queue.write_buffer lands before the next submission's commands, so anything
        // already recorded must be submitted first.
        self.flush();
        self.queue.write_buffer(dst, offset, bytes);
    }

    /// Copies `len` bytes at `offset` of `src` back to the host (submits and waits).
    /// Errors: the device was lost or the mapping failed.
    pub fn read(&self, src: &wgpu::Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: len.next_multiple_of(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.copy(src, offset, &staging, 0, len.next_multiple_of(4));
        self.flush();
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .map_err(|e| Error::Gpu(format!("waiting for the device: {e}")))?;
        rx.recv()
            .map_err(|_| Error::Gpu("read-back was never completed".into()))?
            .map_err(|e| Error::Gpu(format!("read-back failed: {e}")))?;
        let bytes = slice
            .get_mapped_range()
            .map_err(|e| Error::Gpu(format!("read-back failed: {e}")))?[..len as usize]
            .to_vec();
        staging.unmap();
        Ok(bytes)
    }
}
