//! The compute interface the model is written against, and its CPU implementation.
//!
//! Activations are f32 matrices `[rows, cols]`, one row per token. Every operation of
//! the Qwen3-Next forward pass is one method here, so the model code (src/model) is
//! written once and runs on any backend; the CPU backend is also the oracle that other
//! backends' kernels are tested against.

pub mod cpu;
pub mod gpu;
mod in_flight;

pub use in_flight::InFlight;

// The MLX quantized format is the checkpoint's; the backends read it through these.
pub use crate::checkpoint::{dequantize_row, Floats, QuantView};

use crate::checkpoint::{LinearWeight, RecordLayout};
use crate::config::{GateActivation, MRope, ModelConfig};
use crate::error::{Error, Result};
use crate::records::{ExpertRecord, PoolMemory};

/// A compute backend chosen at run time.
pub enum Compute {
    Cpu(cpu::CpuBackend),
    Gpu(Box<gpu::GpuBackend>),
}

/// Opens the backend `device` names: `cpu`; `gpu` (the first GPU adapter of any kind,
/// an error without one); or part of an adapter's name. `None` takes the first GPU, but
/// the CPU backend when there is none or when the adapter is itself a CPU emulation such
/// as lavapipe, which is slower than the CPU backend; then no GPU device is opened.
///
/// A GPU opens with `gpu` (its adapter, when `device` names none, is `gpu.adapter`).
/// Logs one line (at info level) saying which backend runs and why; the GPU's settings
/// are logged at debug level ("GPU opened").
pub fn open_compute(device: Option<&str>, gpu: &gpu::GpuOptions) -> Result<Compute> {
    let base = gpu;
    let options = |adapter: Option<&str>| gpu::GpuOptions {
        adapter: adapter.map(str::to_string).or_else(|| base.adapter.clone()),
        ..base.clone()
    };
    let gpu = |adapter: Option<&str>, why: &str| -> Result<Compute> {
        let g = gpu::GpuBackend::new(&options(adapter))?;
        let a = &g.gpu.adapter;
        tracing::info!(adapter = %a.name, api = %a.backend, kind = %a.device_type, "using the GPU backend: {why}");
        Ok(Compute::Gpu(Box::new(g)))
    };
    let cpu = |why: String| {
        tracing::info!("using the CPU backend: {why}");
        Ok(Compute::Cpu(cpu::CpuBackend))
    };
    match device {
        Some("cpu") => cpu("--device cpu".into()),
        Some("gpu") => gpu(None, "--device gpu"),
        Some(name) => gpu(Some(name), "its name matches --device"),
        None => match gpu::chosen_adapter(&options(None)) {
            Ok(a) if a.device_type == "Cpu" => cpu(format!(
                "the only GPU adapter, {}, is a CPU emulation, slower than the CPU backend (--device gpu uses it)",
                a.name
            )),
            Ok(_) => gpu(None, "the first GPU adapter (--device cpu for the CPU backend)"),
            Err(e) => cpu(format!("no GPU adapter ({e})")),
        },
    }
}

/// RoPE rotation table for rows at positions `start .. start + rows`: `[rows, rotary_dim / 2]`
/// pairs `(cos, sin)` of `pos * theta^(-2j / rotary_dim)`, computed in f64 and rounded to
/// f32 (non-traditional half-split RoPE, ../shared/spec/models.md §2.5). Shared by every
/// backend so they rotate by exactly the same angles.
pub fn rope_table(start: usize, rows: usize, rotary_dim: usize, theta: f64) -> Vec<(f32, f32)> {
    let half = rotary_dim / 2;
    let inv_freq = rope_inv_freq(rotary_dim, theta);
    let mut table = Vec::with_capacity(rows * half);
    for t in 0..rows {
        let pos = (start + t) as f64;
        table.extend(inv_freq.iter().map(|f| rope_angle(pos * f)));
    }
    table
}

/// [`rope_table`] for rows at multimodal positions (M-RoPE, transformers 5.24
/// `Qwen3_5MoeTextRotaryEmbedding`): row `t`'s frequency `j` turns by
/// `positions[t][mrope.axis(j)]`, its (t, h, w) position's axis for that frequency. A text
/// row (three equal positions) gets exactly [`rope_table`]'s pairs.
pub fn mrope_table(
    positions: &[[usize; 3]],
    rotary_dim: usize,
    theta: f64,
    mrope: &MRope,
) -> Vec<(f32, f32)> {
    let inv_freq = rope_inv_freq(rotary_dim, theta);
    positions
        .iter()
        .flat_map(|p| {
            inv_freq
                .iter()
                .enumerate()
                .map(|(j, f)| rope_angle(p[mrope.axis(j)] as f64 * f))
        })
        .collect()
}

/// `theta^(-2j / rotary_dim)` for `j < rotary_dim / 2`, in f64.
fn rope_inv_freq(rotary_dim: usize, theta: f64) -> Vec<f64> {
    (0..rotary_dim / 2)
        .map(|j| theta.powf(-((2 * j) as f64) / rotary_dim as f64))
        .collect()
}

/// `(cos, sin)` of an angle, rounded to f32.
fn rope_angle(angle: f64) -> (f32, f32) {
    let (sin, cos) = angle.sin_cos();
    (cos as f32, sin as f32)
}

/// Rotates one head by RoPE's `(cos, sin)` pairs (one row of [`rope_table`]): values `j`
/// and `j + half` of the first `2 * half` form the pair rotated by angle `j`
/// (non-traditional half split). The CPU backend's `rope` and the QSA indexer's pooled
/// keys both use it.
pub fn rotate_half(head: &mut [f32], angles: &[(f32, f32)]) {
    let half = angles.len();
    for (j, &(cos, sin)) in angles.iter().enumerate() {
        let (x1, x2) = (head[j], head[j + half]);
        head[j] = x1 * cos - x2 * sin;
        head[j + half] = x1 * sin + x2 * cos;
    }
}

/// Head geometry of a gated DeltaNet layer.
#[derive(Clone, Copy, Debug)]
pub struct DeltaDims {
    pub key_heads: usize,
    pub value_heads: usize,
    /// Per-head key (and query) width `Dk`.
    pub key_dim: usize,
    /// Per-head value width `Dv`.
    pub value_dim: usize,
}

impl DeltaDims {
    /// `(eps, q scale, k scale)` of [`Backend::gated_delta`]'s q/k normalization for key
    /// width `Dk`: `x * rsqrt(mean(x^2) + eps) * scale`, as mlx-lm `qwen3_next.py` does.
    pub fn qk_norm(&self) -> (f32, f32, f32) {
        let inv_scale = (self.key_dim as f64).powf(-0.5);
        (
            (1e-6 * inv_scale * inv_scale) as f32,
            (inv_scale * inv_scale) as f32,
            inv_scale as f32,
        )
    }
}

/// Head geometry of a full-attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Multiplier of `q . k` before the softmax (`head_dim^-0.5`).
    pub scale: f32,
}

/// Which cached keys each query of an attention call may see, on top of the causal rule
/// (the QSA indexer's selection, ../shared/spec/reference-system.md A.5): bit `j % 32` of
/// word `t * words_per_row() + j / 32` is set when query `t` keeps key position `j`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyMask {
    /// Key positions covered: the cache length after the call's keys are appended.
    pub keys: usize,
    /// `[T, keys.div_ceil(32)]` words.
    pub bits: Vec<u32>,
}

impl KeyMask {
    /// A mask of `rows` queries over `keys` positions with nothing kept.
    pub fn new(rows: usize, keys: usize) -> Self {
        KeyMask {
            keys,
            bits: vec![0; rows * keys.div_ceil(32)],
        }
    }

    /// A mask of the last `rows` queries over `keys` positions that keeps every causal
    /// key (query `r` sits at position `keys - rows + r`).
    pub fn causal(rows: usize, keys: usize) -> Self {
        assert!(
            rows <= keys,
            "a causal mask of {rows} queries over {keys} keys"
        );
        let mut m = KeyMask::new(rows, keys);
        for r in 0..rows {
            for k in 0..=keys - rows + r {
                m.keep(r, k);
            }
        }
        m
    }

    /// u32 words per query.
    pub fn words_per_row(&self) -> usize {
        self.keys.div_ceil(32)
    }

    /// Keeps key `key` for query `row`.
    pub fn keep(&mut self, row: usize, key: usize) {
        let w = self.words_per_row();
        self.bits[row * w + key / 32] |= 1 << (key % 32);
    }

    /// Whether query `row` keeps key `key`.
    pub fn kept(&self, row: usize, key: usize) -> bool {
        self.bits[row * self.words_per_row() + key / 32] >> (key % 32) & 1 == 1
    }
}

/// `ids` sorted ascending without repeats.
pub fn distinct_ids(mut ids: Vec<u32>) -> Vec<u32> {
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The router's choice for a batch of tokens: `top_k` experts per token, highest first.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    /// `[tokens, top_k]` expert ids.
    pub ids: Vec<u32>,
    /// `[tokens, top_k]` mixing weights (softmax probabilities, renormalized if asked).
    pub weights: Vec<f32>,
}

impl Routing {
    /// Number of tokens routed.
    pub fn tokens(&self) -> usize {
        self.ids.len() / self.top_k.max(1)
    }

    /// Distinct expert ids, ascending.
    pub fn distinct(&self) -> Vec<u32> {
        distinct_ids(self.ids.clone())
    }

    /// The routing in a [`Backend::router_top_k_device`] tensor's values: `n` ids (u32
    /// bits) then `n` weights. Errors: an odd length, or an id not below `experts`.
    pub fn from_device(values: &[f32], top_k: usize, experts: usize) -> Result<Routing> {
        if !values.len().is_multiple_of(2) {
            return Err(Error::Internal(format!(
                "a device routing of {} values",
                values.len()
            )));
        }
        let n = values.len() / 2;
        let ids: Vec<u32> = values[..n].iter().map(|v| v.to_bits()).collect();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= experts) {
            return Err(Error::Gpu(format!(
                "router: the device chose expert id {bad} of {experts}"
            )));
        }
        Ok(Routing {
            top_k,
            ids,
            weights: values[n..].to_vec(),
        })
    }

    /// This routing as a [`Backend::router_top_k_device`] tensor's values.
    pub fn to_device(&self) -> Vec<f32> {
        self.ids
            .iter()
            .map(|&id| f32::from_bits(id))
            .chain(self.weights.iter().copied())
            .collect()
    }
}

/// Tokens per pass of a long input on the CPU, and the least any backend takes (see
/// [`Backend::prefill_chunk`] and `Model::prefill_chunk`).
pub const PREFILL_CHUNK: usize = 256;

/// Bytes of the widest activation row one token of a pass holds (the routed experts'
/// outputs, the stacked input projections, the attention queries with their gates, a
/// dense MLP's gate and up, the residual streams, and with `all_logits` every position's
/// logits): what a backend sizes a chunk of tokens by.
pub fn widest_row_bytes(cfg: &ModelConfig, all_logits: bool) -> usize {
    let widest = [
        cfg.num_experts_per_tok * cfg.hidden_size.max(cfg.moe_intermediate_size),
        cfg.conv_dim() + cfg.linear_value_dim() + 2 * cfg.linear_num_value_heads,
        4 * cfg.num_attention_heads * cfg.head_dim,
        2 * cfg.intermediate_size,
        cfg.residual_width(),
        if all_logits { cfg.vocab_size } else { 0 },
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    widest * 4
}

/// Tokens per prefill pass of a model of `cfg` on `backend` (for every position's logits
/// with `all_logits`, else the last's).
pub fn prefill_chunk<B: Backend + ?Sized>(
    backend: &B,
    cfg: &ModelConfig,
    all_logits: bool,
) -> usize {
    backend.prefill_chunk(widest_row_bytes(cfg, all_logits), cfg.num_experts_per_tok)
}

/// The operations of the forward pass. Shapes are `[rows, cols]` of f32 unless stated.
/// Arithmetic is f32 throughout, matching mlx-lm run with `set_dtype(float32)`.
pub trait Backend: Send + Sync {
    /// Activations (f32, row-major `[rows, cols]`).
    type Tensor: Send + Sync;
    /// A resident linear-layer weight (quantized or dense).
    type Weight: Send + Sync;
    /// A list of column indices.
    type Index: Send + Sync;
    /// Keys and values of one attention layer for one sequence.
    type KvCache: Send + Sync;

    /// A human-readable name ("cpu", or the GPU adapter's name).
    fn name(&self) -> String;

    /// Whether a forward pass of a few positions costs clearly less than as many one-token
    /// steps, so that verifying drafts in one pass can pay (`--mtp auto` drafts only
    /// then). The default says yes: a GPU reads each weight once per pass. The CPU
    /// backend says no: its kernels are bound by their instructions, and a verify pass of
    /// 2 positions costs about 2.5 one-token steps (BENCHMARKS.md, issue 37).
    fn multi_position_passes_pay(&self) -> bool {
        true
    }

    /// Tells the backend the memory of the slot pool its expert records will come from,
    /// and where the device should read the slots (`None`: the backend's choice for its
    /// adapter). The CPU reads slots in place (it asks the kernel to back them with huge
    /// pages). Errors: a placement the device cannot provide.
    fn attach_pool(&self, _pool: &PoolMemory, _placement: Option<gpu::Placement>) -> Result<()> {
        Ok(())
    }

    /// Whether pages of the attached pool's memory may be given back to the OS
    /// (`madvise`) while the backend uses the pool, as an elastic pool's shrink does with
    /// the slots it retires: true (the default) where the device reads the slots through
    /// the process's own mapping (the CPU) or copies them out of it; false where it holds
    /// a mapping of its own (host memory a GPU imported: a driver that pins the pages
    /// would go on reading the old ones after the process's mapping was emptied).
    fn pool_memory_releasable(&self) -> bool {
        true
    }

    /// Bytes per second (read plus written) of a large copy in the memory this backend
    /// computes from: the ceiling a bandwidth-bound decode step is compared with. The
    /// default times a 512 MiB host copy on the rayon pool (the CPU backend's threads).
    /// Errors: the memory cannot be allocated.
    fn copy_bandwidth(&self) -> Result<f64> {
        use rayon::prelude::*;
        const LEN: usize = 512 << 20;
        const CHUNK: usize = 4 << 20;
        let src = vec![1u8; LEN];
        let mut dst = vec![0u8; LEN];
        let copy = |dst: &mut [u8]| {
            dst.par_chunks_mut(CHUNK)
                .zip(src.par_chunks(CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s))
        };
        copy(&mut dst); // fault the pages in
        let runs = 4;
        let start = std::time::Instant::now();
        for _ in 0..runs {
            copy(&mut dst);
        }
        Ok((2 * LEN * runs) as f64 / start.elapsed().as_secs_f64())
    }

    /// Tokens a pass of a long input computes at once, for a model whose widest
    /// activation row is `row_bytes` bytes a token with `routes_per_token` routed experts
    /// (top-k): larger chunks read each weight once for more tokens, and cost workspace
    /// memory. The default is [`PREFILL_CHUNK`].
    fn prefill_chunk(&self, _row_bytes: usize, _routes_per_token: usize) -> usize {
        PREFILL_CHUNK
    }

    /// Bytes per second a bandwidth-bound kernel reads from the memory this backend
    /// computes from: the ceiling of a decode step that reads each active byte once. The
    /// default is [`Backend::copy_bandwidth`] (a host copy, read plus written).
    /// Errors: a device that cannot allocate the test buffers (a host allocation that
    /// fails aborts, as any Rust allocation does).
    fn read_bandwidth(&self) -> Result<f64> {
        self.copy_bandwidth()
    }

    /// Makes a weight resident. Errors: the backend cannot hold it.
    fn upload_weight(&self, w: LinearWeight) -> Result<Self::Weight>;
    /// Uploads `[rows, cols]` values.
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Self::Tensor;
    /// Uploads a column index list for [`Backend::gather_columns`].
    fn upload_index(&self, idx: &[u32]) -> Self::Index;
    /// Reads a tensor back to the host, row-major. Like every read-back of at least one
    /// value, it returns only after the device has finished every operation recorded
    /// before the call ([`InFlight`] relies on it). Errors: a lost device.
    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    /// Waits until the device has finished every operation recorded so far (an
    /// [`InFlight`] dropped while holding values calls it before releasing them). The CPU
    /// computes each operation when it is called, so it returns at once.
    /// Errors: a lost device.
    fn finish(&self) -> Result<()>;
    /// `(rows, cols)` of a tensor.
    fn shape(&self, t: &Self::Tensor) -> (usize, usize);
    /// A `[rows, cols]` tensor of zeros.
    fn zeros(&self, rows: usize, cols: usize) -> Self::Tensor;
    /// Rows `start .. start + count` of `x`.
    fn rows(&self, x: &Self::Tensor, start: usize, count: usize) -> Self::Tensor;

    /// Dequantized rows of an embedding table: `[ids.len(), cols]`
    /// (mlx `QuantizedEmbedding`). Errors: an id beyond the table.
    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor>;
    /// `x W^T`: `[T, in] x [out, in] -> [T, out]`.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight) -> Self::Tensor;
    /// `x W^T` split by columns into consecutive parts of `widths` (nonzero, summing to
    /// W's rows): the outputs of projections of one input stacked into one weight at
    /// load, computed in one pass. `[T, in] x [out, in] -> [T, widths[i]]` each; every
    /// value is what [`Backend::matmul`] gives for that column.
    /// The default is [`matmul_parts_by_gather`].
    fn matmul_parts(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        widths: &[usize],
    ) -> Vec<Self::Tensor> {
        matmul_parts_by_gather(self, x, w, widths)
    }
    /// `out[:, j] = x[:, idx[j]]`.
    fn gather_columns(&self, x: &Self::Tensor, idx: &Self::Index) -> Self::Tensor;
    /// RMSNorm over consecutive groups of `group` columns:
    /// `scale * w * x / sqrt(mean(x^2) + eps)`, `w` of length `group` (the same weight
    /// for every group), or of length `cols` (a weight per column: Flash-Next's group
    /// norms over the hyper-connection streams), or 1 if `None`.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: Option<&Self::Tensor>,
        group: usize,
        eps: f32,
        scale: f32,
    ) -> Self::Tensor;
    /// Gated RMSNorm (Qwen3-Next `Qwen3NextRMSNormGated` with `precise_swiglu`):
    /// `act(gate) * w * rms_norm(x)` per group of `group` columns; `act` is SiLU, or the
    /// sigmoid for Flash-Next (`output_gate_type`).
    fn rms_norm_gated(
        &self,
        x: &Self::Tensor,
        gate: &Self::Tensor,
        weight: &Self::Tensor,
        group: usize,
        eps: f32,
        act: GateActivation,
    ) -> Self::Tensor;
    /// Dilated causal depthwise conv then SiLU: `out[t,c] = silu(sum_j w[c,j] * in[t+j*d,c])`
    /// over `in = [state; x]`, `w` `[C, K]`, dilation `d`, state `[(K-1)*d, C]` updated to
    /// the last `(K-1)*d` inputs (torch `Conv1d(groups=C, dilation=d)` on left-padded input).
    fn causal_conv1d_silu(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        state: &mut Self::Tensor,
        dilation: usize,
    ) -> Self::Tensor;
    /// `silu(scale * x)`.
    fn silu(&self, x: &Self::Tensor, scale: f32) -> Self::Tensor;
    /// The mixing half of Flash-Next's hyper-connection (transformers `Qwen4ExpTextGatedResidual`):
    /// `out[t, j] = mean_s sigmoid(mix[t, s*H + j]) * n[t, s*H + j]` over `streams`
    /// streams of width `H`; `n`, `mix` `[T, streams*H]`, out `[T, H]`.
    fn hyper_mix(&self, n: &Self::Tensor, mix: &Self::Tensor, streams: usize) -> Self::Tensor;
    /// The residual half: `h[t, s*H + j] + y[t, j] * 2 sigmoid(inject[t, s] / streams)`;
    /// `h` `[T, streams*H]`, `y` `[T, H]`, `inject` `[T, streams]` (the raw
    /// `block_inject_weight` output).
    fn hyper_inject(
        &self,
        h: &Self::Tensor,
        y: &Self::Tensor,
        inject: &Self::Tensor,
    ) -> Self::Tensor;
    /// The PLE gate (transformers `Qwen4ExpTextPLELayer.forward`): per stream `s`,
    /// `g = sum_j key[t, s*H+j] * query[t, s*H+j] / sqrt(H)`, `g = sign(g) sqrt(max(|g|, 1e-6))`,
    /// `out[t, s*H + j] = sigmoid(g) * value[t, j]`; `key`, `query` `[T, S*H]`, `value` `[T, H]`.
    fn ple_gate(
        &self,
        key: &Self::Tensor,
        query: &Self::Tensor,
        value: &Self::Tensor,
    ) -> Self::Tensor;
    /// The gated delta rule, recurrent form (mlx-lm `gated_delta.py`, `gated_delta_ops`):
    /// per token and value head `h` (key head `h / (Hv/Hk)`):
    /// `S = g S; S += k (beta (v - S k))^T; y = S q` with `g = exp(-exp(A_log) softplus(a + dt_bias))`,
    /// `beta = sigmoid(b)`.
    ///
    /// `qkv` `[T, 2 Hk Dk + Hv Dv]` is the short conv's output `[q | k | v]`; q and k are
    /// normalized here per key head as mlx-lm's `qwen3_next.py` does: `rms_norm` without
    /// weight at eps `1e-6 / Dk`, then q scaled by `1 / Dk` and k by `1 / sqrt(Dk)` (an L2
    /// norm at eps 1e-6 on `sum(x^2)`, q times `1 / sqrt(Dk)`). `ba` `[T, 2 Hv]` is
    /// `[b | a]`, state `[Hv, Dv*Dk]` (row = value dim). Returns y `[T, Hv*Dv]`.
    fn gated_delta(
        &self,
        qkv: &Self::Tensor,
        ba: &Self::Tensor,
        a_log: &Self::Tensor,
        dt_bias: &Self::Tensor,
        state: &mut Self::Tensor,
        dims: DeltaDims,
    ) -> Self::Tensor;
    /// Non-traditional (half-split) RoPE on the first `rotary_dim` columns of each head
    /// of width `head_dim`; row `t` turns by `angles[t * rotary_dim / 2 ..][..rotary_dim / 2]`
    /// (`(cos, sin)` pairs: [`rope_table`] for consecutive positions, [`mrope_table`] for
    /// an image's). Panics unless `angles` has `rows * rotary_dim / 2` pairs.
    fn rope(
        &self,
        x: &Self::Tensor,
        head_dim: usize,
        rotary_dim: usize,
        angles: &[(f32, f32)],
    ) -> Self::Tensor;
    /// An empty KV cache for `kv_dim = kv_heads * head_dim` columns.
    fn new_kv_cache(&self, kv_dim: usize) -> Self::KvCache;
    /// Number of positions held in a KV cache.
    fn kv_len(&self, cache: &Self::KvCache) -> usize;
    /// A new cache holding a copy of the first `len` positions of `cache`: a sequence that
    /// continues from a prompt-cache snapshot taken on another sequence's cache gets its
    /// own rows, and the other's stay as they are. Panics if `len` exceeds the cache.
    fn kv_prefix(&self, cache: &Self::KvCache, len: usize) -> Self::KvCache;
    /// Drops the positions from `len` on (the next append writes at `len`). The CPU frees
    /// their memory; a GPU keeps its buffers for the next appends. Panics if `len`
    /// exceeds the cache.
    fn kv_truncate(&self, cache: &mut Self::KvCache, len: usize);
    /// Keys and values of the first `len` positions, `[len, kv_dim]` each, row-major (to
    /// write a snapshot to disk). Panics if `len` exceeds the cache. Errors: a lost device.
    fn kv_read(&self, cache: &Self::KvCache, len: usize) -> Result<(Vec<f32>, Vec<f32>)>;
    /// A cache of `keys.len() / kv_dim` positions holding `keys` and `values`
    /// (`[len, kv_dim]` each, as [`Backend::kv_read`] gives them). Panics unless both are
    /// the same whole number of rows.
    fn kv_from(&self, kv_dim: usize, keys: &[f32], values: &[f32]) -> Self::KvCache;
    /// Appends `k`, `v` `[T, kv_dim]` to the cache and returns causal softmax attention of
    /// `q` `[T, q_heads*head_dim]` over all cached positions; query head `h` reads kv head
    /// `h / (q_heads / kv_heads)`. With a `mask` (covering the cache after the append),
    /// query `t` sees only the causal positions its row keeps, and must keep at least one.
    /// Returns `[T, q_heads*head_dim]`.
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        cache: &mut Self::KvCache,
        dims: AttnDims,
        mask: Option<&KeyMask>,
    ) -> Self::Tensor;
    /// `x * sigmoid(gate)`; `gate` is `[T, cols]` or `[T, 1]` (broadcast over the row).
    fn mul_sigmoid(&self, x: &Self::Tensor, gate: &Self::Tensor) -> Self::Tensor;
    /// `silu(gate) * up`.
    fn swiglu(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Self::Tensor;
    /// A SwiGLU MLP's first half, `silu(x Wg^T) * (x Wu^T)`, from `w = [Wg; Wu]`
    /// `[2 I, in]` (gate and up projections stacked at load, so a backend can compute both
    /// in one pass): `[T, in] -> [T, I]`.
    fn matmul_swiglu(&self, x: &Self::Tensor, w: &Self::Weight) -> Self::Tensor;
    /// `a + b`.
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Self::Tensor;
    /// `(h + y, rms_norm(h + y, w))` with the norm over whole rows: a residual add and the
    /// next block's input norm, which a backend may do in one pass.
    fn add_rms_norm(
        &self,
        h: &Self::Tensor,
        y: &Self::Tensor,
        w: &Self::Tensor,
        eps: f32,
    ) -> (Self::Tensor, Self::Tensor) {
        let sum = self.add(h, y);
        let cols = self.shape(&sum).1;
        let normed = self.rms_norm(&sum, Some(w), cols, eps, 1.0);
        (sum, normed)
    }
    /// Softmax over each row of router logits `[T, E]` in f32, the `k` largest
    /// probabilities, renormalized to sum 1 if `renormalize`. This is the one read-back of
    /// a layer: the ids decide which records the pool must hold. As a read-back it returns
    /// only after the device has finished every operation recorded before the call
    /// (see [`Backend::download`]).
    fn router_top_k(&self, logits: &Self::Tensor, k: usize, renormalize: bool) -> Result<Routing>;
    /// Routed SwiGLU experts: `out[t] = sum_j w[t,j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`
    /// with `e = routing.ids[t,j]`, whose record (laid out by `layout`) is `records[t*k + j]`,
    /// plus the shared expert when given (added in the same pass, see [`SharedExpert`]).
    fn moe_experts(
        &self,
        x: &Self::Tensor,
        routing: &Routing,
        records: &[ExpertRecord<'_>],
        layout: &RecordLayout,
        shared: Option<SharedExpert<'_, Self::Tensor>>,
    ) -> Self::Tensor;

    /// [`Backend::router_top_k`] whose result stays on the backend, for
    /// [`Backend::moe_experts_resident`]: a `[1, 2 * T * k]` tensor of the ids `[T, k]` (as
    /// u32 bits) then the weights `[T, k]` ([`Routing::from_device`] reads it). Nothing is
    /// read back. The default computes [`Backend::router_top_k`] and uploads it.
    /// Errors: as [`Backend::router_top_k`].
    fn router_top_k_device(
        &self,
        logits: &Self::Tensor,
        k: usize,
        renormalize: bool,
    ) -> Result<Self::Tensor> {
        let routing = self.router_top_k(logits, k, renormalize)?;
        let values = routing.to_device();
        Ok(self.upload(&values, 1, values.len()))
    }

    /// [`Backend::moe_experts`] when every record of the layer is at hand: `layer[e]` is
    /// expert `e`'s record. The weights come from `routing` (a
    /// [`Backend::router_top_k_device`] tensor), the ids from `ids` (`[T, k]`, e.g. a
    /// synthetic routing model's) or else from `routing`, so a backend can route without
    /// reading anything back; the shared expert, when given, is added as by
    /// [`Backend::moe_experts`] (computed here from its weights where given so, see
    /// [`Shared`]). Returns the block's output `[T, hidden]`, or with `then` the sum
    /// `h + out` and, where `then` has a norm, the next block's input `rms_norm(h + out)`
    /// as [`Backend::add_rms_norm`] computes it (a backend may do both in the pass that
    /// combines the experts). The default reads the routing back and calls
    /// [`Backend::moe_experts`], then [`ResidualAdd::apply`].
    /// Errors: a failed read-back, an id beyond `layer`.
    #[allow(clippy::too_many_arguments)]
    fn moe_experts_resident(
        &self,
        x: &Self::Tensor,
        routing: &Self::Tensor,
        k: usize,
        ids: Option<&[u32]>,
        layer: &[ExpertRecord<'_>],
        layout: &RecordLayout,
        shared: Option<Shared<'_, Self>>,
        then: Option<ResidualAdd<'_, Self::Tensor>>,
    ) -> Result<(Self::Tensor, Option<Self::Tensor>)> {
        check_routed_ids(ids, routing_routes(self, routing), layer.len())?;
        let out = moe_experts_read_back(self, x, routing, k, ids, layer, layout, shared)?;
        Ok(ResidualAdd::apply_to(then, self, out))
    }

    /// Gets records that will be computed from soon ready where the backend reads them
    /// (a GPU copies pool slots into its device arenas); the default does nothing.
    /// Errors: a lost device.
    fn prepare_records(&self, _records: &[ExpertRecord<'_>]) -> Result<()> {
        Ok(())
    }

    /// Reads several tensors back (a backend may wait for the device once for all); with
    /// at least one value to read, it returns only after the device has finished every
    /// operation recorded before the call (see [`Backend::download`]).
    /// Errors: a lost device.
    fn download_many(&self, tensors: &[&Self::Tensor]) -> Result<Vec<Vec<f32>>> {
        tensors.iter().map(|t| self.download(t)).collect()
    }
}

/// Routes in a [`Backend::router_top_k_device`] tensor (ids then weights).
pub(crate) fn routing_routes<B: Backend + ?Sized>(b: &B, routing: &B::Tensor) -> usize {
    let (rows, cols) = b.shape(routing);
    rows * cols / 2
}

/// Checks ids given to [`Backend::moe_experts_resident`] in place of the router's: one per
/// route, each below the layer's `experts`. Errors: [`Error::InvalidInput`] naming both.
pub fn check_routed_ids(ids: Option<&[u32]>, routes: usize, experts: usize) -> Result<()> {
    match ids {
        Some(ids) if ids.len() != routes || ids.iter().any(|&id| id as usize >= experts) => {
            Err(Error::InvalidInput(format!(
                "{} routed ids (for {routes} routes) with a layer of {experts} experts",
                ids.len()
            )))
        }
        _ => Ok(()),
    }
}

/// [`Backend::matmul_parts`] as one [`Backend::matmul`] and a [`Backend::gather_columns`]
/// per part: the trait's default, and a backend's path for weights its one-pass kernel
/// does not take.
pub fn matmul_parts_by_gather<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    w: &B::Weight,
    widths: &[usize],
) -> Vec<B::Tensor> {
    let y = b.matmul(x, w);
    assert_eq!(
        widths.iter().sum::<usize>(),
        b.shape(&y).1,
        "matmul_parts: part widths"
    );
    let mut first = 0;
    widths
        .iter()
        .map(|&n| {
            let idx: Vec<u32> = (first..first + n as u32).collect();
            first += n as u32;
            b.gather_columns(&y, &b.upload_index(&idx))
        })
        .collect()
}

/// A MoE block's shared expert, which the pass that sums the routed experts adds in:
/// `out += sigmoid(gate) * y`, with `y` `[T, hidden]` the shared expert's SwiGLU output and
/// `gate` `[T, 1]` its gate logit (Qwen3-Next's `shared_expert_gate`, models.md).
#[derive(Debug)]
pub struct SharedExpert<'a, T> {
    pub y: &'a T,
    pub gate: &'a T,
}

/// What a block's output `y` is added to where the block ends: the residual stream `h`
/// `[T, hidden]` and, where the next block is pre-normed, that block's norm weight
/// `[hidden]` and epsilon (see [`Backend::moe_experts_resident`], which may fold both
/// into its last pass).
pub struct ResidualAdd<'a, T> {
    pub h: &'a T,
    pub norm: Option<(&'a T, f32)>,
}

// By hand, as for SharedExpert: only references are copied.
impl<T> Clone for ResidualAdd<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for ResidualAdd<'_, T> {}

impl<T> ResidualAdd<'_, T> {
    /// `(h + y, rms_norm(h + y, w))` by [`Backend::add_rms_norm`] with a norm, else
    /// `(h + y, None)`.
    pub fn apply<B: Backend<Tensor = T> + ?Sized>(&self, b: &B, y: &T) -> (T, Option<T>) {
        match self.norm {
            Some((w, eps)) => {
                let (sum, normed) = b.add_rms_norm(self.h, y, w, eps);
                (sum, Some(normed))
            }
            None => (b.add(self.h, y), None),
        }
    }

    /// [`ResidualAdd::apply`] where there is something to add `y` to, else `(y, None)`.
    pub fn apply_to<B: Backend<Tensor = T> + ?Sized>(
        then: Option<Self>,
        b: &B,
        y: T,
    ) -> (T, Option<T>) {
        match then {
            Some(r) => r.apply(b, &y),
            None => (y, None),
        }
    }
}

/// A MoE block's shared expert for [`Backend::moe_experts_resident`]: its output, or its
/// SwiGLU MLP's weights (a stacked `[Wg; Wu]` `[2 I, hidden]` for
/// [`Backend::matmul_swiglu`] and the down projection `[hidden, I]`), so that a backend
/// can compute it in the passes that compute the routed experts rather than in passes of
/// its own; `gate` `[T, 1]` is its gate logit either way.
pub enum Shared<'a, B: Backend + ?Sized> {
    Output(SharedExpert<'a, B::Tensor>),
    Mlp {
        gate_up: &'a B::Weight,
        down: &'a B::Weight,
        gate: &'a B::Tensor,
    },
}

// By hand, as for SharedExpert: only references are copied.
impl<B: Backend + ?Sized> Clone for Shared<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend + ?Sized> Copy for Shared<'_, B> {}

impl<'a, B: Backend + ?Sized> Shared<'a, B> {
    /// The shared expert's output on `x` where only its weights are given
    /// (`down(matmul_swiglu(x))`, as the model's dense MLP computes it), else `None`.
    pub fn output(&self, b: &B, x: &B::Tensor) -> Option<B::Tensor> {
        match self {
            Shared::Output(_) => None,
            Shared::Mlp { gate_up, down, .. } => Some(b.matmul(&b.matmul_swiglu(x, gate_up), down)),
        }
    }

    /// The shared expert as its output: `y` is [`Shared::output`]'s result, which
    /// [`Shared::Mlp`] needs. Panics on [`Shared::Mlp`] without `y`.
    pub fn computed<'b>(self, y: Option<&'b B::Tensor>) -> SharedExpert<'b, B::Tensor>
    where
        'a: 'b,
    {
        match self {
            Shared::Output(s) => s,
            Shared::Mlp { gate, .. } => SharedExpert {
                y: y.expect("the shared expert's output"),
                gate,
            },
        }
    }
}

// By hand: the derives would ask `T: Copy`, and only the references are copied.
impl<T> Clone for SharedExpert<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedExpert<'_, T> {}

impl<T> SharedExpert<'_, T> {
    /// Panics unless `y` is `[tokens, hidden]` and `gate` `[tokens, 1]` on backend `b`.
    pub fn check_shapes<B: Backend<Tensor = T> + ?Sized>(
        &self,
        b: &B,
        tokens: usize,
        hidden: usize,
    ) {
        assert_eq!(b.shape(self.y), (tokens, hidden), "shared expert output");
        assert_eq!(b.shape(self.gate), (tokens, 1), "shared expert gate");
    }
}

/// [`Backend::moe_experts_resident`] by reading the routing back and gathering the routed
/// records with [`Backend::moe_experts`] (which adds `shared`, computed first where only
/// its weights are given): the trait's default, and a backend's path for records it
/// cannot route on the device. `ids` must have passed [`check_routed_ids`].
/// Errors: a failed read-back, an id beyond `layer`.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_read_back<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    routing: &B::Tensor,
    k: usize,
    ids: Option<&[u32]>,
    layer: &[ExpertRecord<'_>],
    layout: &RecordLayout,
    shared: Option<Shared<'_, B>>,
) -> Result<B::Tensor> {
    let y = shared.and_then(|s| s.output(b, x));
    let shared = shared.map(|s| s.computed(y.as_ref()));
    let mut r = Routing::from_device(&b.download(routing)?, k, layer.len())?;
    if let Some(ids) = ids {
        r.ids.copy_from_slice(ids);
    }
    let records: Vec<ExpertRecord<'_>> = r.ids.iter().map(|&e| layer[e as usize]).collect();
    Ok(b.moe_experts(x, &r, &records, layout, shared))
}
