//! The GPU backend on wgpu: every operation of [`Backend`] as a WGSL kernel from `wgsl/`
//! (Metal on Apple Silicon, Vulkan elsewhere, lavapipe without a GPU).
//!
//! Synchronisation per forward step: dispatches are recorded into one command encoder and
//! submitted at read-backs (and every few hundred dispatches, without waiting). A streamed
//! MoE layer reads back its router's top-k ids and weights, which decide what the slot pool
//! must hold; a layer whose records are all resident (a pool of every record) keeps its
//! routing on the device ([`Backend::moe_experts_resident`]), so such a step waits once,
//! for the logits (and the ids, read back with them for the pool's statistics).

mod attention;
mod conv;
pub mod device;
mod elementwise;
mod gated_delta;
// Host memory the GPU reads in place: VK_EXT_external_memory_host, or Metal no-copy buffers.
#[cfg_attr(target_os = "macos", path = "host_memory_metal.rs")]
mod host_memory;
mod hyper;
mod norm;
mod profile;
mod quant;
mod route_tiles;
mod router;

use std::sync::{Arc, Mutex};

pub use device::{
    chosen_adapter, list_adapters, AdapterSummary, DeviceBuffer, Gpu, GpuCounters, GpuOptions,
    TILE_WORKGROUP_BYTES,
};

use super::{
    AttnDims, Backend, DeltaDims, KeyMask, ResidualAdd, Routing, Shared, SharedExpert,
    PREFILL_CHUNK,
};
use crate::checkpoint::{LinearWeight, RecordLayout};
use crate::config::GateActivation;
use crate::error::Result;
use crate::records::{ExpertRecord, PoolMemory};

/// An f32 matrix `[rows, cols]` in a storage buffer (a kernel's output goes back to the
/// backend's buffer pool when its last clone is dropped).
#[derive(Clone, Debug)]
pub struct GpuTensor {
    pub buf: Arc<DeviceBuffer>,
    pub rows: usize,
    pub cols: usize,
}

/// A resident weight: MLX's packed words for quantized matrices, their scales and biases
/// (bf16 / f16 / f32, unpacked in the shader) in row quads, f32 for dense ones.
#[derive(Debug)]
pub enum GpuWeight {
    Quantized {
        spec: crate::config::QuantSpec,
        rows: usize,
        cols: usize,
        /// 0 = f32, 1 = f16, 2 = bf16 (see `wgsl/quant.wgsl`).
        scale_dtype: u32,
        /// Offsets of the scales and biases in `data`, in elements of `scale_dtype`
        /// (the packed words start at 0): they lie in row quads (`row_quads` in
        /// `quant/mod.rs`), a row's bias 4 elements after its scale.
        s_off: u32,
        b_off: u32,
        data: DeviceBuffer,
    },
    Dense {
        rows: usize,
        cols: usize,
        data: DeviceBuffer,
    },
    /// A weight past the adapter's storage binding limit (a real model's embedding or
    /// lm_head on lavapipe's 128 MiB), split into row ranges of one binding each:
    /// `(first row, part)`, in row order.
    Rows(Vec<(usize, GpuWeight)>),
}

impl GpuWeight {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            GpuWeight::Quantized { rows, cols, .. } | GpuWeight::Dense { rows, cols, .. } => {
                (*rows, *cols)
            }
            GpuWeight::Rows(parts) => {
                let cols = parts.first().map_or(0, |(_, p)| p.shape().1);
                (parts.iter().map(|(_, p)| p.shape().0).sum(), cols)
            }
        }
    }
}

/// Keys and values of one attention layer: `[capacity, kv_dim]` buffers that grow by
/// doubling, of which the first `len` rows are valid.
#[derive(Debug)]
pub struct GpuKvCache {
    pub kv_dim: usize,
    pub len: usize,
    pub capacity: usize,
    pub keys: Option<DeviceBuffer>,
    pub values: Option<DeviceBuffer>,
}

/// Where the GPU reads pool slots from. A slot is (arena, offset); arenas hold whole
/// slots and each stays within `max_storage_buffer_binding_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// The pool's host memory imported as GPU buffers: a miss's `pread` lands where the
    /// kernel reads it (integrated GPUs, lavapipe).
    Unified,
    /// Device-local arenas; a slot is copied in when its record changed (discrete GPUs,
    /// where reading host memory is slow: 48.8 vs 3,414 GB/s on the H200, DESIGN.md).
    Device,
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "unified" => Ok(Placement::Unified),
            "device" => Ok(Placement::Device),
            _ => Err(format!(
                "unknown placement `{s}` (expected unified or device)"
            )),
        }
    }
}

/// The GPU's view of the slot pool.
struct Mirror {
    /// The pool this mirrors ([`crate::records::SlotTag::pool`]).
    pool: u64,
    stride: usize,
    slots_per_arena: usize,
    arenas: Vec<wgpu::Buffer>,
    /// Device placement: generation of the record each slot holds on the device (0: none).
    generations: Vec<u64>,
    /// Unified placement: the pool memory the arenas import, kept alive while the mirror
    /// lives (on Vulkan each imported buffer also holds it until the driver releases it).
    unified: Option<PoolMemory>,
    /// Device placement, where host memory can be imported: the pool's memory as GPU
    /// buffers (a unified mirror), from which slots are copied into the device arenas by
    /// the GPU, in order with the kernels, instead of through `queue.write_buffer`'s
    /// staging copy.
    host: Option<Box<Mirror>>,
}

impl Mirror {
    /// Slots per arena: within the storage binding and buffer limits, and within 2 GiB so
    /// every word and scale offset inside an arena fits the kernels' u32 parameters (and
    /// within [`Gpu::limit_arenas`]); rounded down to whole layers of `layer_records`
    /// where an arena holds one (a pool of every record keeps a layer's records together,
    /// and then each layer's routed experts take one dispatch per projection, not two
    /// where a layer would straddle arenas).
    fn slots_per_arena(gpu: &Gpu, stride: usize, layer_records: usize) -> usize {
        let mut max = gpu
            .limits
            .max_storage_buffer_binding_size
            .min(gpu.limits.max_buffer_size)
            .min(1 << 31);
        if gpu.arena_limit() > 0 {
            max = max.min(gpu.arena_limit());
        }
        let n = ((max / stride as u64) as usize).max(1);
        if layer_records > 0 && n >= layer_records {
            n - n % layer_records
        } else {
            n
        }
    }

    /// Device placement: zeroed device-local arenas, filled as records are used.
    fn device(gpu: &Gpu, pool: u64, slots: usize, stride: usize, layer_records: usize) -> Mirror {
        let per_arena = Self::slots_per_arena(gpu, stride, layer_records).min(slots.max(1));
        Mirror {
            pool,
            stride,
            slots_per_arena: per_arena,
            arenas: (0..slots.div_ceil(per_arena))
                .map(|a| gpu.zeroed((per_arena.min(slots - a * per_arena) * stride) as u64))
                .collect(),
            generations: vec![0; slots],
            unified: None,
            host: None,
        }
    }
}

/// The wgpu backend. Construct with [`GpuBackend::new`].
pub struct GpuBackend {
    pub gpu: Gpu,
    mirror: Mutex<Option<Mirror>>,
    /// The device counters at the last [`Backend::download`] (for the debug log).
    logged: Mutex<(GpuCounters, std::time::Instant)>,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

device::uniform_block! {
    /// `Params` of `wgsl/bandwidth.wgsl`: 16-byte vectors to read.
    struct StreamParams {
        vecs: u32,
    }
}

impl GpuBackend {
    /// Opens a GPU. Errors: no adapter (the message says which driver to install).
    pub fn new(options: &GpuOptions) -> Result<Self> {
        Ok(GpuBackend {
            gpu: Gpu::open(options)?,
            mirror: Mutex::default(),
            logged: Mutex::new((GpuCounters::default(), std::time::Instant::now())),
        })
    }

    /// Logs (at debug level) what the device was asked to do since the last call: with a
    /// download per forward step, the dispatches, submissions, waits and objects created
    /// per token.
    fn log_counters(&self) {
        if !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        let (now, at) = (self.gpu.counters(), std::time::Instant::now());
        let mut last = self.logged.lock().unwrap_or_else(|p| p.into_inner());
        let (d, since) = (now - last.0, last.1);
        *last = (now, at);
        tracing::debug!(
            dispatches = d.dispatches,
            submits = d.submits,
            waits = d.waits,
            buffers_created = d.buffers_created,
            bind_groups_created = d.bind_groups_created,
            wait_ms = d.wait_ns as f64 / 1e6,
            record_ms = d.record_ns as f64 / 1e6,
            submit_ms = d.submit_ns as f64 / 1e6,
            wall_ms = at.duration_since(since).as_secs_f64() * 1e3,
            write_mb = d.write_bytes as f64 / 1e6,
            "GPU work since the last download"
        );
        if let Some(kernels) = self.gpu.profile() {
            let total: u64 = kernels.iter().map(|k| k.2).sum();
            let top: Vec<String> = kernels
                .iter()
                .take(12)
                .map(|(k, n, ns)| format!("{k} {n}x {:.3} ms", *ns as f64 / 1e6))
                .collect();
            tracing::debug!(
                gpu_ms = total as f64 / 1e6,
                kernels = %top.join(", "),
                "GPU time by kernel since the last download"
            );
        }
    }

    /// The placement an adapter type calls for: unified on integrated and CPU adapters
    /// that can import host memory, device-local arenas otherwise.
    pub fn default_placement(&self) -> Placement {
        let shared = matches!(
            self.gpu.adapter.device_type.as_str(),
            "IntegratedGpu" | "Cpu"
        );
        if shared && self.gpu.host_import {
            Placement::Unified
        } else {
            Placement::Device
        }
    }

    /// Makes the GPU read `pool`'s slots with `placement`. Without this call, records that
    /// come from a pool are mirrored in device arenas (device placement).
    /// Errors: unified placement on a device that cannot import host memory.
    pub fn place_pool(&self, pool: &PoolMemory, placement: Placement) -> Result<()> {
        let (stride, slots) = (pool.stride, pool.slots);
        // Arenas over host memory start on host pages: a whole number of pages per arena.
        let unit = host_memory::PAGE / gcd(stride, host_memory::PAGE);
        let layer_records = pool.layer_records;
        let per_arena = Mirror::slots_per_arena(&self.gpu, stride, layer_records).min(slots.max(1));
        // Whole layers too where an arena holds one (see Mirror::slots_per_arena).
        let whole = unit / gcd(unit, layer_records.max(1)) * layer_records.max(1);
        let host_arena = if per_arena >= whole {
            per_arena / whole * whole
        } else {
            (per_arena / unit * unit).max(unit)
        };
        let mirror = match placement {
            Placement::Device => {
                let mut mirror = Mirror::device(&self.gpu, pool.pool, slots, stride, layer_records);
                if self.gpu.host_copies() {
                    match self.import_pool(pool, host_arena) {
                        Ok(host) => mirror.host = Some(Box::new(host)),
                        Err(e) => {
                            tracing::warn!(error = %e, "slots will be copied to the GPU through staging memory")
                        }
                    }
                }
                mirror
            }
            Placement::Unified => self.import_pool(pool, host_arena)?,
        };
        tracing::info!(
            ?placement,
            slots,
            arenas = mirror.arenas.len(),
            host_copies = mirror.host.is_some(),
            "slot pool attached to the GPU"
        );
        let mut guard = self.mirror.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_some() {
            // Recorded work may still read the old mirror (and a unified one's host pages).
            self.gpu.sync()?;
        }
        let old = guard.replace(mirror);
        // Cached bind groups would keep the old arenas alive; they go before the old
        // mirror, whose pool may own the host memory its arenas import.
        self.gpu.forget_bind_groups();
        drop(old);
        Ok(())
    }

    fn import_pool(&self, pool: &PoolMemory, per_arena: usize) -> Result<Mirror> {
        let (base, len) = (pool.memory.as_ptr(), pool.memory.capacity());
        let (stride, slots) = (pool.stride, pool.slots);
        let mut arenas = Vec::new();
        for a in 0..slots.div_ceil(per_arena) {
            let n = per_arena.min(slots - a * per_arena);
            let start = a * per_arena * stride;
            // The last arena's length rounded up to a page; the pool's memory is allocated
            // in whole pages (io::AlignedBuf), so it stays inside.
            let bytes = (n * stride)
                .next_multiple_of(host_memory::PAGE)
                .min(len - start);
            // SAFETY: the range lies inside the pool's memory and starts on a host page
            // (per_arena * stride is a whole number of pages; the allocation is
            // page-aligned); the buffer holds the memory until the driver releases it.
            let buf = unsafe {
                host_memory::import(
                    &self.gpu.device,
                    base.add(start),
                    bytes as u64,
                    pool.memory.clone(),
                )?
            };
            arenas.push(buf);
        }
        Ok(Mirror {
            pool: pool.pool,
            stride,
            slots_per_arena: per_arena,
            arenas,
            generations: Vec::new(),
            unified: Some(pool.clone()),
            host: None,
        })
    }

    fn tensor(&self, buf: wgpu::Buffer, rows: usize, cols: usize) -> GpuTensor {
        GpuTensor {
            buf: Arc::new(self.gpu.plain(buf)),
            rows,
            cols,
        }
    }

    /// A `[rows, cols]` tensor for a kernel to fill, in a reused buffer (NaN when
    /// poisoning outputs, else whatever an earlier use left).
    fn empty(&self, rows: usize, cols: usize) -> GpuTensor {
        GpuTensor {
            buf: Arc::new(self.gpu.scratch((rows * cols * 4) as u64)),
            rows,
            cols,
        }
    }
}

impl Drop for GpuBackend {
    fn drop(&mut self) {
        // Before the mirror (and the pool whose memory it may import) goes: a tensor that
        // outlives the backend keeps the bind-group cache alive.
        self.gpu.forget_bind_groups();
    }
}

/// Most tokens of one prefill pass on a GPU with tiles (see
/// [`GpuBackend::prefill_chunk`](Backend::prefill_chunk)).
pub const MAX_PREFILL_CHUNK: usize = 2048;

/// Most workgroups along one dimension of a dispatch.
const MAX_GROUPS: usize = 65_535;

impl Backend for GpuBackend {
    type Tensor = GpuTensor;
    type Weight = GpuWeight;
    type Index = GpuTensor;
    type KvCache = GpuKvCache;

    fn name(&self) -> String {
        format!("{} ({})", self.gpu.adapter.name, self.gpu.adapter.backend)
    }

    /// With tiles, up to [`MAX_PREFILL_CHUNK`] tokens (a multiple of
    /// [`PREFILL_CHUNK`]): the tiled products read each weight, and each
    /// routed expert's record, once per tile of the chunk's tokens, so a long prompt reads
    /// them fewer times in larger chunks. Bounded so the widest activation fits one
    /// storage binding and a chunk's routes fit one dispatch dimension (the row-by-row
    /// kernels put them in z). Without tiles, [`PREFILL_CHUNK`].
    fn prefill_chunk(&self, row_bytes: usize, routes_per_token: usize) -> usize {
        if !self.gpu.tiled {
            return PREFILL_CHUNK;
        }
        let binding = self.gpu.limits.max_storage_buffer_binding_size as usize;
        let chunk = MAX_PREFILL_CHUNK
            .min(binding / row_bytes.max(1))
            .min(MAX_GROUPS / routes_per_token.max(1));
        (chunk / PREFILL_CHUNK * PREFILL_CHUNK).max(PREFILL_CHUNK)
    }

    fn attach_pool(&self, pool: &PoolMemory, placement: Option<Placement>) -> Result<()> {
        self.place_pool(pool, placement.unwrap_or_else(|| self.default_placement()))
    }

    /// Only when the mirror imports none of the pool's host memory (device arenas filled
    /// through staging copies): an imported range is the driver's mapping too. The device
    /// arenas themselves stay as large as the pool's capacity.
    fn pool_memory_releasable(&self) -> bool {
        let mirror = self.mirror.lock().unwrap_or_else(|p| p.into_inner());
        mirror
            .as_ref()
            .is_none_or(|m| m.unified.is_none() && m.host.is_none())
    }

    /// A device-to-device copy of 1 GiB (or what one binding allows), timed over a few
    /// runs after a warm-up.
    fn copy_bandwidth(&self) -> Result<f64> {
        let limits = &self.gpu.limits;
        let len = (1u64 << 30)
            .min(limits.max_buffer_size / 2)
            .min(limits.max_storage_buffer_binding_size);
        let (src, dst) = (self.gpu.zeroed(len), self.gpu.zeroed(len));
        self.gpu.copy(&src, 0, &dst, 0, len);
        self.gpu.sync()?;
        let runs = 10;
        let start = std::time::Instant::now();
        for _ in 0..runs {
            self.gpu.copy(&src, 0, &dst, 0, len);
        }
        self.gpu.sync()?;
        Ok((2 * len * runs) as f64 / start.elapsed().as_secs_f64())
    }

    /// A streaming-read kernel over a buffer of up to 1 GiB (`wgsl/bandwidth.wgsl`), ten
    /// passes in one submission after a warm-up: what the device's memory delivers to
    /// kernels, rather than a copy engine's rate.
    fn read_bandwidth(&self) -> Result<f64> {
        const STREAM: device::Kernel = device::Kernel::new(
            "bandwidth.wgsl",
            "stream_read",
            &[device::Access::Read, device::Access::ReadWrite],
        );
        let limits = &self.gpu.limits;
        let len = (1u64 << 30)
            .min(limits.max_buffer_size)
            .min(limits.max_storage_buffer_binding_size)
            / 16
            * 16;
        let (src, out) = (self.gpu.zeroed(len), self.gpu.zeroed(4));
        let params = StreamParams {
            vecs: (len / 16) as u32,
        };
        // A few waves of workgroups, each invocation streaming a long strided share.
        let groups = [4096, 1, 1];
        self.gpu.dispatch(&STREAM, &params, &[&src, &out], groups);
        self.gpu.sync()?;
        let runs = 10;
        let start = std::time::Instant::now();
        for _ in 0..runs {
            self.gpu.dispatch(&STREAM, &params, &[&src, &out], groups);
        }
        self.gpu.sync()?;
        Ok((len * runs) as f64 / start.elapsed().as_secs_f64())
    }

    fn upload_weight(&self, w: LinearWeight) -> Result<GpuWeight> {
        quant::upload_weight(self, w)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> GpuTensor {
        assert_eq!(data.len(), rows * cols, "upload shape");
        self.tensor(self.gpu.buffer_with(bytemuck::cast_slice(data)), rows, cols)
    }

    fn upload_index(&self, idx: &[u32]) -> GpuTensor {
        self.tensor(
            self.gpu.buffer_with(bytemuck::cast_slice(idx)),
            1,
            idx.len(),
        )
    }

    fn download(&self, t: &GpuTensor) -> Result<Vec<f32>> {
        let bytes = self.gpu.read(&t.buf, 0, (t.rows * t.cols * 4) as u64)?;
        self.log_counters();
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    fn finish(&self) -> Result<()> {
        // Submits what is still recorded, then waits for every submission.
        self.gpu.sync()
    }

    fn shape(&self, t: &GpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn zeros(&self, rows: usize, cols: usize) -> GpuTensor {
        self.tensor(self.gpu.zeroed((rows * cols * 4) as u64), rows, cols)
    }

    fn rows(&self, x: &GpuTensor, start: usize, count: usize) -> GpuTensor {
        let out = self.empty(count, x.cols);
        self.gpu.copy(
            &x.buf,
            (start * x.cols * 4) as u64,
            &out.buf,
            0,
            (count * x.cols * 4) as u64,
        );
        out
    }

    fn embed(&self, table: &GpuWeight, ids: &[u32]) -> Result<GpuTensor> {
        quant::embed(self, table, ids)
    }

    fn matmul(&self, x: &GpuTensor, w: &GpuWeight) -> GpuTensor {
        quant::matmul(self, x, w)
    }

    fn matmul_parts(&self, x: &GpuTensor, w: &GpuWeight, widths: &[usize]) -> Vec<GpuTensor> {
        quant::matmul_parts(self, x, w, widths)
    }

    fn gather_columns(&self, x: &GpuTensor, idx: &GpuTensor) -> GpuTensor {
        elementwise::gather_columns(self, x, idx)
    }

    fn rms_norm(
        &self,
        x: &GpuTensor,
        weight: Option<&GpuTensor>,
        group: usize,
        eps: f32,
        scale: f32,
    ) -> GpuTensor {
        norm::rms_norm(self, x, weight, group, eps, scale)
    }

    fn rms_norm_gated(
        &self,
        x: &GpuTensor,
        gate: &GpuTensor,
        weight: &GpuTensor,
        group: usize,
        eps: f32,
        act: GateActivation,
    ) -> GpuTensor {
        norm::rms_norm_gated(self, x, gate, weight, group, eps, act)
    }

    fn causal_conv1d_silu(
        &self,
        x: &GpuTensor,
        weight: &GpuTensor,
        state: &mut GpuTensor,
        dilation: usize,
    ) -> GpuTensor {
        conv::causal_conv1d_silu(self, x, weight, state, dilation)
    }

    fn silu(&self, x: &GpuTensor, scale: f32) -> GpuTensor {
        hyper::silu(self, x, scale)
    }

    fn hyper_mix(&self, n: &GpuTensor, mix: &GpuTensor, streams: usize) -> GpuTensor {
        hyper::hyper_mix(self, n, mix, streams)
    }

    fn hyper_inject(&self, h: &GpuTensor, y: &GpuTensor, inject: &GpuTensor) -> GpuTensor {
        hyper::hyper_inject(self, h, y, inject)
    }

    fn ple_gate(&self, key: &GpuTensor, query: &GpuTensor, value: &GpuTensor) -> GpuTensor {
        hyper::ple_gate(self, key, query, value)
    }

    fn gated_delta(
        &self,
        qkv: &GpuTensor,
        ba: &GpuTensor,
        a_log: &GpuTensor,
        dt_bias: &GpuTensor,
        state: &mut GpuTensor,
        dims: DeltaDims,
    ) -> GpuTensor {
        gated_delta::gated_delta(self, qkv, ba, a_log, dt_bias, state, dims)
    }

    fn rope(
        &self,
        x: &GpuTensor,
        head_dim: usize,
        rotary_dim: usize,
        angles: &[(f32, f32)],
    ) -> GpuTensor {
        attention::rope(self, x, head_dim, rotary_dim, angles)
    }

    fn new_kv_cache(&self, kv_dim: usize) -> GpuKvCache {
        GpuKvCache {
            kv_dim,
            len: 0,
            capacity: 0,
            keys: None,
            values: None,
        }
    }

    fn kv_len(&self, cache: &GpuKvCache) -> usize {
        cache.len
    }

    fn kv_prefix(&self, cache: &GpuKvCache, len: usize) -> GpuKvCache {
        attention::kv_prefix(self, cache, len)
    }

    fn kv_truncate(&self, cache: &mut GpuKvCache, len: usize) {
        assert!(
            len <= cache.len,
            "KV prefix of {len} positions of {}",
            cache.len
        );
        cache.len = len;
    }

    fn kv_read(&self, cache: &GpuKvCache, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        attention::kv_read(self, cache, len)
    }

    fn kv_from(&self, kv_dim: usize, keys: &[f32], values: &[f32]) -> GpuKvCache {
        attention::kv_from(self, kv_dim, keys, values)
    }

    fn attention(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        cache: &mut GpuKvCache,
        dims: AttnDims,
        mask: Option<&KeyMask>,
    ) -> GpuTensor {
        attention::attention(self, q, k, v, cache, dims, mask)
    }

    fn mul_sigmoid(&self, x: &GpuTensor, gate: &GpuTensor) -> GpuTensor {
        elementwise::mul_sigmoid(self, x, gate)
    }

    fn swiglu(&self, gate: &GpuTensor, up: &GpuTensor) -> GpuTensor {
        elementwise::swiglu(self, gate, up)
    }

    fn add(&self, a: &GpuTensor, b: &GpuTensor) -> GpuTensor {
        elementwise::add(self, a, b)
    }

    fn matmul_swiglu(&self, x: &GpuTensor, w: &GpuWeight) -> GpuTensor {
        quant::matmul_swiglu(self, x, w)
    }

    fn add_rms_norm(
        &self,
        h: &GpuTensor,
        y: &GpuTensor,
        w: &GpuTensor,
        eps: f32,
    ) -> (GpuTensor, GpuTensor) {
        norm::add_rms_norm(self, h, y, w, eps)
    }

    fn router_top_k(&self, logits: &GpuTensor, k: usize, renormalize: bool) -> Result<Routing> {
        router::router_top_k(self, logits, k, renormalize)
    }

    fn moe_experts(
        &self,
        x: &GpuTensor,
        routing: &Routing,
        records: &[ExpertRecord<'_>],
        layout: &RecordLayout,
        shared: Option<SharedExpert<'_, GpuTensor>>,
    ) -> GpuTensor {
        quant::moe_experts(self, x, routing, records, layout, shared)
    }

    fn router_top_k_device(
        &self,
        logits: &GpuTensor,
        k: usize,
        renormalize: bool,
    ) -> Result<GpuTensor> {
        router::router_top_k_device(self, logits, k, renormalize)
    }

    fn moe_experts_resident(
        &self,
        x: &GpuTensor,
        routing: &GpuTensor,
        k: usize,
        ids: Option<&[u32]>,
        layer: &[ExpertRecord<'_>],
        layout: &RecordLayout,
        shared: Option<Shared<'_, Self>>,
        then: Option<ResidualAdd<'_, GpuTensor>>,
    ) -> Result<(GpuTensor, Option<GpuTensor>)> {
        super::check_routed_ids(ids, super::routing_routes(self, routing), layer.len())?;
        let routes = (routing, k, ids);
        if let Some(out) = quant::moe_experts_resident(self, x, routes, layer, layout, shared, then)
        {
            return Ok(out);
        }
        // Records outside a pool, or a chunk's routes of more experts than the device
        // groups: read the routing back and gather them as usual.
        let out = super::moe_experts_read_back(self, x, routing, k, ids, layer, layout, shared)?;
        Ok(ResidualAdd::apply_to(then, self, out))
    }

    fn prepare_records(&self, records: &[ExpertRecord<'_>]) -> Result<()> {
        if quant::mirror_places(self, records).is_some() {
            self.gpu.settle_writes()?;
        }
        Ok(())
    }

    fn download_many(&self, tensors: &[&GpuTensor]) -> Result<Vec<Vec<f32>>> {
        let ranges: Vec<(&wgpu::Buffer, u64, u64)> = tensors
            .iter()
            .map(|t| (&**t.buf, 0, (t.rows * t.cols * 4) as u64))
            .collect();
        let bytes = self.gpu.read_many(&ranges)?;
        self.log_counters();
        Ok(bytes
            .iter()
            .map(|b| bytemuck::pod_collect_to_vec(b))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::device::{kernel_source, shader, Uniform};

    /// The uniform block of `file`'s kernels, `P`, has the fields of the file's WGSL
    /// `Params` struct, in order, at the offsets and of the types naga lays them out with.
    fn check<P: Uniform>(file: &str) {
        let source = kernel_source(shader(file), 1);
        let module = naga::front::wgsl::parse_str(&source)
            .unwrap_or_else(|e| panic!("{file}: {}", e.emit_to_string(&source)));
        let (_, ty) = module
            .types
            .iter()
            .find(|(_, t)| t.name.as_deref() == Some("Params"))
            .unwrap_or_else(|| panic!("{file} has no Params struct"));
        let naga::TypeInner::Struct { members, span } = &ty.inner else {
            panic!("{file}: Params is not a struct");
        };
        let wgsl: Vec<(String, usize, &str)> = members
            .iter()
            .map(|m| {
                let ty = match module.types[m.ty].inner {
                    naga::TypeInner::Scalar(naga::Scalar::U32) => "u32",
                    naga::TypeInner::Scalar(naga::Scalar::F32) => "f32",
                    ref other => panic!("{file}: Params field of type {other:?}"),
                };
                (m.name.clone().unwrap_or_default(), m.offset as usize, ty)
            })
            .collect();
        let rust: Vec<(String, usize, &str)> = P::FIELDS
            .iter()
            .map(|&(name, offset, ty)| (name.to_string(), offset, ty))
            .collect();
        assert_eq!(
            rust, wgsl,
            "{file}: the Rust block and the WGSL Params differ"
        );
        assert_eq!(std::mem::size_of::<P>(), *span as usize, "{file}: size");
    }

    #[test]
    fn uniform_blocks_match_their_wgsl_structs() {
        check::<super::quant::Params>("quant.wgsl");
        check::<super::attention::AttnParams>("attention.wgsl");
        check::<super::norm::NormParams>("norm.wgsl");
        check::<super::gated_delta::DeltaParams>("gated_delta.wgsl");
        check::<super::conv::ConvParams>("conv.wgsl");
        check::<super::elementwise::ElementwiseParams>("elementwise.wgsl");
        check::<super::hyper::HyperParams>("hyper.wgsl");
        check::<super::router::RouterParams>("router.wgsl");
        check::<super::route_tiles::RouteTileParams>("route_tiles.wgsl");
        check::<super::StreamParams>("bandwidth.wgsl");
    }
}
