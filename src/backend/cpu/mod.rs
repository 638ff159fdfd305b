//! The CPU backend: Rust in f32, parallel over output rows, heads and experts with rayon.
//! Matmuls (resident projections, head, routed experts) run on SIMD kernels for the CPU's
//! instruction set, picked at run time (simd.rs, matmul.rs, experts.rs; 4-bit weights in
//! integers on AVX-512 VNNI, int8.rs);
//! [`CpuBackend::scalar`] keeps the plain kernels (scalar.rs), the reference the SIMD and
//! GPU kernels are tested against.

mod attention;
mod experts;
mod gated_delta;
mod int8;
mod lanes;
mod matmul;
mod memory;
mod scalar;
mod simd;

pub use simd::Isa;

use super::{
    dequantize_row, AttnDims, Backend, DeltaDims, Floats, KeyMask, QuantView, Routing, SharedExpert,
};
use crate::checkpoint::{LinearWeight, PieceKind, Projection, RecordLayout};
use crate::config::GateActivation;
use crate::error::{Error, Result};
use crate::records::{ExpertRecord, PoolMemory};
use rayon::prelude::*;

/// An f32 matrix `[rows, cols]`, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl CpuTensor {
    fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        debug_assert_eq!(data.len(), rows * cols);
        CpuTensor { rows, cols, data }
    }

    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    fn map2(&self, other: &CpuTensor, f: impl Fn(f32, f32) -> f32 + Sync) -> CpuTensor {
        assert_eq!(
            (self.rows, self.cols),
            (other.rows, other.cols),
            "elementwise shapes"
        );
        let data = self
            .data
            .iter()
            .zip(&other.data)
            .map(|(&a, &b)| f(a, b))
            .collect();
        CpuTensor::new(self.rows, self.cols, data)
    }
}

/// Keys and values `[len, kv_dim]` of one attention layer.
#[derive(Clone, Debug, Default)]
pub struct CpuKvCache {
    kv_dim: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// The CPU backend: which kernels it runs, nothing else; cheap to copy.
///
/// `CpuBackend` is also a constant, the SIMD backend, so that code written when this was a
/// unit struct (`Model::load(&ckpt, &CpuBackend)`) keeps working.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuBackend {
    kernels: Kernels,
}

/// Which kernels a [`CpuBackend`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernels {
    /// The plain kernels (scalar.rs).
    Scalar,
    /// The SIMD kernels for an instruction set this CPU runs, or for the fastest one
    /// ([`Isa::detect`], at each call: std caches the detection) when `None`.
    Simd(Option<Isa>),
}

/// The CPU backend with the SIMD kernels (see [`CpuBackend`]).
#[allow(non_upper_case_globals)]
pub const CpuBackend: CpuBackend = CpuBackend::simd();

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::simd()
    }
}

impl CpuBackend {
    /// The SIMD kernels for the fastest instruction set this CPU has (AVX-512, AVX2 with
    /// FMA, else the portable kernels: NEON on aarch64), chosen at run time.
    pub const fn simd() -> Self {
        CpuBackend {
            kernels: Kernels::Simd(None),
        }
    }

    /// The SIMD kernels for `isa` (for tests and benchmarks of each instruction set).
    /// Errors: [`Error::InvalidInput`] when this CPU does not run `isa`.
    pub fn with_isa(isa: Isa) -> Result<Self> {
        if !isa.is_supported() {
            return Err(Error::InvalidInput(format!("this CPU does not run {isa}")));
        }
        Ok(CpuBackend {
            kernels: Kernels::Simd(Some(isa)),
        })
    }

    /// The plain kernels (a row dequantized into a buffer, then dot products): the oracle
    /// the SIMD kernels and the GPU's are tested against.
    pub const fn scalar() -> Self {
        CpuBackend {
            kernels: Kernels::Scalar,
        }
    }

    /// Whether this backend runs the plain kernels.
    pub fn is_scalar(&self) -> bool {
        self.kernels == Kernels::Scalar
    }

    /// The instruction set of the SIMD kernels (`None` for the plain ones).
    pub fn isa(&self) -> Option<Isa> {
        match self.kernels {
            Kernels::Scalar => None,
            Kernels::Simd(isa) => Some(isa.unwrap_or_else(Isa::detect)),
        }
    }

    /// `x W^T` for `x` `[t, in]`: `[t, out]`, on this backend's kernels.
    fn matmul_rows(&self, x: &[f32], t: usize, w: &Rows<'_>) -> Vec<f32> {
        match self.isa() {
            Some(isa) if matmul::supports(w) => matmul::matmul(isa, x, t, w),
            _ => scalar::matmul(x, t, w, true),
        }
    }
}

/// Rows of a weight matrix, produced one at a time into a scratch buffer.
enum Rows<'a> {
    Quant(QuantView<'a>),
    Dense { data: &'a [f32], cols: usize },
}

impl<'a> Rows<'a> {
    fn of(w: &'a LinearWeight) -> Self {
        match w {
            LinearWeight::Quantized(q) => Rows::Quant(q.view()),
            LinearWeight::Dense(d) => Rows::Dense {
                data: &d.data,
                cols: d.cols,
            },
        }
    }

    fn shape(&self) -> (usize, usize) {
        match self {
            Rows::Quant(q) => (q.rows, q.cols),
            Rows::Dense { data, cols } => (data.len() / cols, *cols),
        }
    }

    /// Row `r`, dequantized into `buf` if needed.
    fn row<'b>(&'b self, r: usize, buf: &'b mut [f32]) -> &'b [f32] {
        match self {
            Rows::Quant(q) => {
                dequantize_row(q, r, buf);
                buf
            }
            Rows::Dense { data, cols } => &data[r * cols..(r + 1) * cols],
        }
    }
}

/// `a . b` in f32, summed in 8 lanes (lets the compiler vectorize).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1 + exp(x))` without overflow (mlx `nn.softplus` = `logaddexp(x, 0)`).
#[inline]
fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// A projection of an expert record as a quantized view.
fn record_view<'a>(record: &'a [u8], layout: &RecordLayout, proj: Projection) -> QuantView<'a> {
    let (rows, cols) = layout.shape(proj);
    let piece = |kind| layout.slice(record, RecordLayout::piece(proj, kind));
    let floats = |kind| Floats {
        dtype: layout.scale_dtype,
        bytes: piece(kind),
    };
    let spec = layout.specs[proj.index()];
    QuantView {
        spec,
        rows,
        cols,
        packed: piece(PieceKind::Weight),
        scales: floats(PieceKind::Scales),
        biases: floats(PieceKind::Biases),
    }
}

/// Values (keys or values alike) in the first `len` positions of `cache`; panics past its end.
fn kv_values(b: &CpuBackend, cache: &CpuKvCache, len: usize) -> usize {
    let held = b.kv_len(cache);
    assert!(len <= held, "KV prefix of {len} positions of {held}");
    len * cache.kv_dim
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = LinearWeight;
    type Index = Vec<u32>;
    type KvCache = CpuKvCache;

    fn multi_position_passes_pay(&self) -> bool {
        false
    }

    fn name(&self) -> String {
        let threads = rayon::current_num_threads();
        match self.isa() {
            Some(isa) => format!("cpu ({threads} threads, {isa})"),
            None => format!("cpu ({threads} threads, plain kernels)"),
        }
    }

    /// The slots are read in place; their memory is moved to huge pages (memory.rs). The
    /// pool zeroes its memory when it allocates it, which faults it in as 4 KiB pages, so
    /// advice for later faults alone would leave it there: measured, 0.4 of 4.7 GB on huge
    /// pages at 4 layers of Qwen3-Next shapes. Collapsing copies it once, at load.
    fn attach_pool(
        &self,
        pool: &PoolMemory,
        _placement: Option<super::gpu::Placement>,
    ) -> Result<()> {
        memory::advise_huge_pages(pool.memory.as_ptr(), pool.memory.capacity(), true);
        Ok(())
    }

    /// A streaming read of 512 MiB on huge pages by every thread (memory.rs).
    fn read_bandwidth(&self) -> Result<f64> {
        Ok(memory::read_bandwidth(512 << 20))
    }

    /// The weight stays where it is, moved to huge pages (memory.rs).
    fn upload_weight(&self, w: LinearWeight) -> Result<LinearWeight> {
        match &w {
            LinearWeight::Quantized(q) => {
                memory::advise_slice(&q.packed);
                memory::advise_slice(&q.scales);
                memory::advise_slice(&q.biases);
            }
            LinearWeight::Dense(d) => memory::advise_slice(&d.data),
        }
        Ok(w)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> CpuTensor {
        assert_eq!(data.len(), rows * cols, "upload shape");
        CpuTensor::new(rows, cols, data.to_vec())
    }

    fn upload_index(&self, idx: &[u32]) -> Vec<u32> {
        idx.to_vec()
    }

    fn download(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn finish(&self) -> Result<()> {
        // Every operation ran to completion in its call.
        Ok(())
    }

    fn shape(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn zeros(&self, rows: usize, cols: usize) -> CpuTensor {
        CpuTensor::new(rows, cols, vec![0.0; rows * cols])
    }

    fn rows(&self, x: &CpuTensor, start: usize, count: usize) -> CpuTensor {
        CpuTensor::new(
            count,
            x.cols,
            x.data[start * x.cols..(start + count) * x.cols].to_vec(),
        )
    }

    fn embed(&self, table: &LinearWeight, ids: &[u32]) -> Result<CpuTensor> {
        let rows = Rows::of(table);
        let (vocab, dim) = rows.shape();
        let mut data = vec![0.0f32; ids.len() * dim];
        let mut buf = vec![0.0f32; dim];
        for (t, &id) in ids.iter().enumerate() {
            if id as usize >= vocab {
                return Err(Error::InvalidInput(format!(
                    "token id {id} is out of range for a vocabulary of {vocab}"
                )));
            }
            data[t * dim..(t + 1) * dim].copy_from_slice(rows.row(id as usize, &mut buf));
        }
        Ok(CpuTensor::new(ids.len(), dim, data))
    }

    fn matmul(&self, x: &CpuTensor, w: &LinearWeight) -> CpuTensor {
        let rows = Rows::of(w);
        let out = rows.shape().0;
        CpuTensor::new(x.rows, out, self.matmul_rows(&x.data, x.rows, &rows))
    }

    fn gather_columns(&self, x: &CpuTensor, idx: &Vec<u32>) -> CpuTensor {
        let mut data = Vec::with_capacity(x.rows * idx.len());
        for r in 0..x.rows {
            let row = x.row(r);
            data.extend(idx.iter().map(|&c| row[c as usize]));
        }
        CpuTensor::new(x.rows, idx.len(), data)
    }

    fn rms_norm(
        &self,
        x: &CpuTensor,
        weight: Option<&CpuTensor>,
        group: usize,
        eps: f32,
        scale: f32,
    ) -> CpuTensor {
        let wlen = weight.map_or(group, |w| w.data.len());
        assert!(
            wlen == group || wlen == x.cols,
            "rms_norm: weight of {wlen} for groups of {group} in rows of {}",
            x.cols
        );
        let mut data = x.data.clone();
        for (g, chunk) in data.chunks_exact_mut(group).enumerate() {
            let ss: f32 = chunk.iter().map(|v| v * v).sum();
            let inv = 1.0 / (ss / group as f32 + eps).sqrt();
            let w0 = (g * group) % wlen;
            for (i, v) in chunk.iter_mut().enumerate() {
                let w = weight.map_or(1.0, |w| w.data[w0 + i]);
                *v = scale * (w * (*v * inv));
            }
        }
        CpuTensor::new(x.rows, x.cols, data)
    }

    fn rms_norm_gated(
        &self,
        x: &CpuTensor,
        gate: &CpuTensor,
        weight: &CpuTensor,
        group: usize,
        eps: f32,
        act: GateActivation,
    ) -> CpuTensor {
        let normed = self.rms_norm(x, Some(weight), group, eps, 1.0);
        match act {
            GateActivation::Silu => normed.map2(gate, |n, z| silu(z) * n),
            GateActivation::Sigmoid => normed.map2(gate, |n, z| sigmoid(z) * n),
        }
    }

    fn causal_conv1d_silu(
        &self,
        x: &CpuTensor,
        weight: &CpuTensor,
        state: &mut CpuTensor,
        dilation: usize,
    ) -> CpuTensor {
        let (c, k) = (weight.rows, weight.cols);
        let keep = (k - 1) * dilation;
        assert_eq!(
            (state.rows, state.cols, x.cols),
            (keep, c, c),
            "conv shapes"
        );
        let mut input = state.data.clone();
        input.extend_from_slice(&x.data);
        let mut out = vec![0.0f32; x.rows * c];
        for t in 0..x.rows {
            for ch in 0..c {
                let mut acc = 0.0f32;
                for j in 0..k {
                    acc += weight.data[ch * k + j] * input[(t + j * dilation) * c + ch];
                }
                out[t * c + ch] = silu(acc);
            }
        }
        let total = keep + x.rows;
        state.data.copy_from_slice(&input[(total - keep) * c..]);
        CpuTensor::new(x.rows, c, out)
    }

    fn gated_delta(
        &self,
        qkv: &CpuTensor,
        ba: &CpuTensor,
        a_log: &CpuTensor,
        dt_bias: &CpuTensor,
        state: &mut CpuTensor,
        dims: DeltaDims,
    ) -> CpuTensor {
        let DeltaDims {
            key_heads,
            value_heads,
            key_dim: dk,
            value_dim: dv,
        } = dims;
        let t_len = qkv.rows;
        let kd = key_heads * dk;
        assert_eq!(qkv.cols, 2 * kd + value_heads * dv, "gated_delta qkv shape");
        assert_eq!(
            (ba.rows, ba.cols),
            (t_len, 2 * value_heads),
            "gated_delta ba shape"
        );
        let columns = |from: usize, len: usize| {
            let data = (0..t_len)
                .flat_map(|t| &qkv.row(t)[from..from + len])
                .copied()
                .collect();
            CpuTensor::new(t_len, len, data)
        };
        let (eps, q_scale, k_scale) = dims.qk_norm();
        let q = self.rms_norm(&columns(0, kd), None, dk, eps, q_scale);
        let k = self.rms_norm(&columns(kd, kd), None, dk, eps, k_scale);
        let v = columns(2 * kd, value_heads * dv);
        let group = value_heads / key_heads;
        let step = if self.is_scalar() {
            scalar::delta_step
        } else {
            gated_delta::delta_step
        };
        let per_head: Vec<Vec<f32>> = state
            .data
            .par_chunks_mut(dv * dk)
            .enumerate()
            .map(|(h, s)| {
                let kh = h / group;
                let mut y = vec![0.0f32; t_len * dv];
                let decay_rate = a_log.data[h].exp();
                for t in 0..t_len {
                    let (b, a) = (ba.row(t)[h], ba.row(t)[value_heads + h]);
                    let g = (-decay_rate * softplus(a + dt_bias.data[h])).exp();
                    let beta = sigmoid(b);
                    let kt = &k.row(t)[kh * dk..(kh + 1) * dk];
                    let qt = &q.row(t)[kh * dk..(kh + 1) * dk];
                    let vt = &v.row(t)[h * dv..(h + 1) * dv];
                    step(s, kt, qt, vt, g, beta, &mut y[t * dv..(t + 1) * dv]);
                }
                y
            })
            .collect();
        let mut out = vec![0.0f32; t_len * value_heads * dv];
        for (h, y) in per_head.iter().enumerate() {
            for t in 0..t_len {
                let at = t * value_heads * dv + h * dv;
                out[at..at + dv].copy_from_slice(&y[t * dv..(t + 1) * dv]);
            }
        }
        CpuTensor::new(t_len, value_heads * dv, out)
    }

    fn rope(
        &self,
        x: &CpuTensor,
        head_dim: usize,
        rotary_dim: usize,
        angles: &[(f32, f32)],
    ) -> CpuTensor {
        let half = rotary_dim / 2;
        assert_eq!(angles.len(), x.rows * half, "rope: one angle row per row");
        let table = angles;
        let mut data = x.data.clone();
        for (t, row) in data.chunks_exact_mut(x.cols).enumerate() {
            let angles = &table[t * half..(t + 1) * half];
            for head in row.chunks_exact_mut(head_dim) {
                super::rotate_half(head, angles);
            }
        }
        CpuTensor::new(x.rows, x.cols, data)
    }

    fn new_kv_cache(&self, kv_dim: usize) -> CpuKvCache {
        CpuKvCache {
            kv_dim,
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    fn kv_len(&self, cache: &CpuKvCache) -> usize {
        cache.keys.len() / cache.kv_dim.max(1)
    }

    fn kv_prefix(&self, cache: &CpuKvCache, len: usize) -> CpuKvCache {
        let n = kv_values(self, cache, len);
        CpuKvCache {
            kv_dim: cache.kv_dim,
            keys: cache.keys[..n].to_vec(),
            values: cache.values[..n].to_vec(),
        }
    }

    fn kv_truncate(&self, cache: &mut CpuKvCache, len: usize) {
        let n = kv_values(self, cache, len);
        for rows in [&mut cache.keys, &mut cache.values] {
            if rows.len() > n {
                rows.truncate(n);
                rows.shrink_to_fit();
            }
        }
    }

    fn kv_read(&self, cache: &CpuKvCache, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = kv_values(self, cache, len);
        Ok((cache.keys[..n].to_vec(), cache.values[..n].to_vec()))
    }

    fn kv_from(&self, kv_dim: usize, keys: &[f32], values: &[f32]) -> CpuKvCache {
        assert!(
            keys.len() == values.len() && keys.len().is_multiple_of(kv_dim.max(1)),
            "kv_from: {} keys and {} values of width {kv_dim}",
            keys.len(),
            values.len()
        );
        CpuKvCache {
            kv_dim,
            keys: keys.to_vec(),
            values: values.to_vec(),
        }
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        cache: &mut CpuKvCache,
        dims: AttnDims,
        mask: Option<&KeyMask>,
    ) -> CpuTensor {
        attention::attention(q, k, v, cache, dims, mask)
    }

    fn mul_sigmoid(&self, x: &CpuTensor, gate: &CpuTensor) -> CpuTensor {
        let data = if gate.cols == x.cols {
            x.map2(gate, |a, g| a * sigmoid(g)).data
        } else {
            assert_eq!(
                (gate.rows, gate.cols),
                (x.rows, 1),
                "gate must be [T, cols] or [T, 1]"
            );
            let mut data = x.data.clone();
            for (row, &g) in data.chunks_exact_mut(x.cols).zip(&gate.data) {
                let s = sigmoid(g);
                row.iter_mut().for_each(|v| *v *= s);
            }
            data
        };
        CpuTensor::new(x.rows, x.cols, data)
    }

    fn silu(&self, x: &CpuTensor, scale: f32) -> CpuTensor {
        CpuTensor::new(
            x.rows,
            x.cols,
            x.data.iter().map(|&v| silu(scale * v)).collect(),
        )
    }

    fn hyper_mix(&self, n: &CpuTensor, mix: &CpuTensor, streams: usize) -> CpuTensor {
        assert_eq!((n.rows, n.cols), (mix.rows, mix.cols), "hyper_mix shapes");
        assert_eq!(
            n.cols % streams,
            0,
            "hyper_mix: {} columns in {streams} streams",
            n.cols
        );
        let h = n.cols / streams;
        let mut data = vec![0.0f32; n.rows * h];
        for (t, out) in data.chunks_exact_mut(h).enumerate() {
            let (nr, mr) = (n.row(t), mix.row(t));
            for (j, o) in out.iter_mut().enumerate() {
                let sum: f32 = (0..streams)
                    .map(|s| sigmoid(mr[s * h + j]) * nr[s * h + j])
                    .sum();
                *o = sum / streams as f32;
            }
        }
        CpuTensor::new(n.rows, h, data)
    }

    fn hyper_inject(&self, h: &CpuTensor, y: &CpuTensor, inject: &CpuTensor) -> CpuTensor {
        let streams = inject.cols;
        assert_eq!(
            (h.rows, h.cols),
            (y.rows, y.cols * streams),
            "hyper_inject shapes"
        );
        assert_eq!(inject.rows, h.rows, "hyper_inject: inject rows");
        let mut data = h.data.clone();
        for (t, row) in data.chunks_exact_mut(h.cols).enumerate() {
            let yr = y.row(t);
            for (s, part) in row.chunks_exact_mut(y.cols).enumerate() {
                let w = 2.0 * sigmoid(inject.row(t)[s] / streams as f32);
                part.iter_mut().zip(yr).for_each(|(o, &v)| *o += v * w);
            }
        }
        CpuTensor::new(h.rows, h.cols, data)
    }

    fn ple_gate(&self, key: &CpuTensor, query: &CpuTensor, value: &CpuTensor) -> CpuTensor {
        let width = value.cols;
        assert_eq!(
            (key.rows, key.cols),
            (query.rows, query.cols),
            "ple_gate shapes"
        );
        assert_eq!(
            (key.rows, key.cols % width),
            (value.rows, 0),
            "ple_gate: value shape"
        );
        let mut data = vec![0.0f32; key.rows * key.cols];
        let inv = 1.0 / (width as f32).sqrt();
        for (t, row) in data.chunks_exact_mut(key.cols).enumerate() {
            let (kr, qr, vr) = (key.row(t), query.row(t), value.row(t));
            for (s, part) in row.chunks_exact_mut(width).enumerate() {
                let g = dot(
                    &kr[s * width..(s + 1) * width],
                    &qr[s * width..(s + 1) * width],
                ) * inv;
                // torch's sign(0) is 0 where f32::signum gives 1.
                let sign = if g == 0.0 { 0.0 } else { g.signum() };
                let g = sigmoid(g.abs().max(1e-6).sqrt() * sign);
                part.iter_mut().zip(vr).for_each(|(o, &v)| *o = g * v);
            }
        }
        CpuTensor::new(key.rows, key.cols, data)
    }

    fn swiglu(&self, gate: &CpuTensor, up: &CpuTensor) -> CpuTensor {
        gate.map2(up, |g, u| silu(g) * u)
    }

    fn matmul_swiglu(&self, x: &CpuTensor, w: &LinearWeight) -> CpuTensor {
        let y = self.matmul(x, w);
        assert_eq!(y.cols % 2, 0, "matmul_swiglu: odd row count {}", y.cols);
        let inter = y.cols / 2;
        let data = y
            .data
            .chunks_exact(y.cols)
            .flat_map(|row| {
                let (gate, up) = row.split_at(inter);
                gate.iter().zip(up).map(|(&g, &u)| silu(g) * u)
            })
            .collect();
        CpuTensor::new(x.rows, inter, data)
    }

    fn add(&self, a: &CpuTensor, b: &CpuTensor) -> CpuTensor {
        a.map2(b, |x, y| x + y)
    }

    fn router_top_k(&self, logits: &CpuTensor, k: usize, renormalize: bool) -> Result<Routing> {
        if k > logits.cols {
            return Err(Error::InvalidInput(format!(
                "top-{k} of {} experts",
                logits.cols
            )));
        }
        let mut ids = Vec::with_capacity(logits.rows * k);
        let mut weights = Vec::with_capacity(logits.rows * k);
        for t in 0..logits.rows {
            let row = logits.row(t);
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = row.iter().map(|&x| (x - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            let probs: Vec<f32> = exps.iter().map(|e| e / sum).collect();
            let mut order: Vec<u32> = (0..row.len() as u32).collect();
            // Highest probability first; ties keep the lower id first. A total order, so
            // selecting the k first and sorting those is the full sort's prefix.
            let first = |x: &u32, y: &u32| {
                probs[*y as usize]
                    .total_cmp(&probs[*x as usize])
                    .then(x.cmp(y))
            };
            if k > 0 && k < order.len() {
                order.select_nth_unstable_by(k - 1, first);
            }
            let top = &mut order[..k];
            top.sort_by(first);
            let norm = if renormalize {
                top.iter().map(|&e| probs[e as usize]).sum::<f32>()
            } else {
                1.0
            };
            ids.extend_from_slice(top);
            weights.extend(top.iter().map(|&e| probs[e as usize] / norm));
        }
        Ok(Routing {
            top_k: k,
            ids,
            weights,
        })
    }

    fn moe_experts(
        &self,
        x: &CpuTensor,
        routing: &Routing,
        records: &[ExpertRecord<'_>],
        layout: &RecordLayout,
        shared: Option<SharedExpert<'_, CpuTensor>>,
    ) -> CpuTensor {
        assert_eq!(
            records.len(),
            routing.ids.len(),
            "one record per routed (token, expert)"
        );
        let d = x.cols;
        assert_eq!(d, layout.hidden, "moe_experts: input width");
        let mut out = match self.isa() {
            Some(isa) => experts::moe_experts(isa, &x.data, x.rows, routing, records, layout),
            None => scalar::moe_experts(&x.data, x.rows, routing, records, layout),
        };
        if let Some(s) = shared {
            s.check_shapes(self, x.rows, d);
            let gated = self.mul_sigmoid(s.y, s.gate);
            out.iter_mut().zip(&gated.data).for_each(|(o, g)| *o += g);
        }
        CpuTensor::new(x.rows, d, out)
    }
}
