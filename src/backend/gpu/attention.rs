//! RoPE and attention over the KV cache (`wgsl/attention.wgsl`).
//!
//! RoPE: cos/sin of every (position, frequency) of the call are computed on the host in
//! f64 exactly as the CPU backend does (f32 `sin`/`cos` of angles up to the context
//! length lose digits on the GPU) and uploaded as a `[T, rotary_dim / 2, 2]` table.
//!
//! Attention: `k`, `v` are appended to the cache (capacity doubling), then queries are
//! processed in chunks whose scores `[chunk * Hq, visible]` fit a scratch buffer of at
//! most [`SCRATCH_BYTES`]: tiled `Q K^T`, an in-place row softmax, tiled `P V`. Any
//! context length works; long prefills take several chunks. When `P V` has few output
//! tiles (decode over a long context), its positions are split over more workgroups and
//! the partial outputs summed by a fourth kernel.

use super::device::{grid, uniform_block, Access, Bind, Kernel};
use super::{GpuBackend, GpuKvCache, GpuTensor};
use crate::backend::{AttnDims, Backend, KeyMask};

const ROPE: Kernel = Kernel::new(
    "attention.wgsl",
    "rope",
    &[Access::ReadWrite, Access::Read, Access::ReadWrite],
);

const SCORES: Kernel = Kernel::new(
    "attention.wgsl",
    "attn_scores",
    &[Access::ReadWrite, Access::Read, Access::ReadWrite],
);

const SOFTMAX: Kernel = Kernel::new(
    "attention.wgsl",
    "attn_softmax",
    &[Access::ReadWrite, Access::Read],
);

const PV: Kernel = Kernel::new(
    "attention.wgsl",
    "attn_pv",
    &[Access::ReadWrite, Access::Read, Access::ReadWrite],
);

const SUM: Kernel = Kernel::new(
    "attention.wgsl",
    "attn_sum",
    &[Access::ReadWrite, Access::Read],
);

/// Side of the square tiles of `attn_scores` and `attn_pv` (`TILE` in the shader).
const TILE: usize = 16;
/// Upper bound of the scores scratch of one call (also capped by the binding limit).
const SCRATCH_BYTES: u64 = 128 << 20;
uniform_block! {
    /// `Params` of `wgsl/attention.wgsl`, which every entry binds whole (what each field
    /// means is there).
    pub(super) struct AttnParams {
        n: u32,
        cols: u32,
        head_dim: u32,
        rotary_dim: u32,
        q_heads: u32,
        group: u32,
        kv_dim: u32,
        pos0: u32,
        t_chunk: u32,
        stride: u32,
        /// Tiles along the fast axis (keys or head dims), per kernel.
        tiles: u32,
        scale: f32,
        q_row0: u32,
        span: u32,
        splits: u32,
        split_stride: u32,
        mask_words: u32,
    }
}
/// `attn_pv` splits its positions when it would have fewer workgroups than this.
const PV_TARGET_WORKGROUPS: usize = 256;
/// Fewest positions of one `attn_pv` split.
const PV_MIN_SPAN: usize = 256;
/// Smallest KV cache capacity, in positions.
const MIN_CAPACITY: usize = 64;

pub(super) fn rope(
    b: &GpuBackend,
    x: &GpuTensor,
    head_dim: usize,
    rotary_dim: usize,
    angles: &[(f32, f32)],
) -> GpuTensor {
    assert!(
        head_dim > 0 && x.cols.is_multiple_of(head_dim),
        "rope: {} columns are not whole heads of {head_dim}",
        x.cols
    );
    assert!(
        rotary_dim <= head_dim,
        "rope: rotary dim {rotary_dim} above head dim {head_dim}"
    );
    let out = b.empty(x.rows, x.cols);
    let n = x.rows * x.cols;
    if n == 0 {
        return out;
    }
    assert_eq!(
        angles.len(),
        x.rows * (rotary_dim / 2),
        "rope: one angle row per row"
    );
    let table: Vec<f32> = angles.iter().flat_map(|&(cos, sin)| [cos, sin]).collect();
    // The whole `Params` block of the shader, of which rope reads the first 4 fields.
    let params = AttnParams {
        n: n as u32,
        cols: x.cols as u32,
        head_dim: head_dim as u32,
        rotary_dim: rotary_dim as u32,
        ..Default::default()
    };
    let [gx, gy] = grid(n.div_ceil(256) as u32);
    let binds = [
        Bind::Buffer(&out.buf),
        Bind::Buffer(&x.buf),
        Bind::Data(bytemuck::cast_slice(&table)),
    ];
    b.gpu.dispatch_with(&ROPE, &params, &binds, [gx, gy, 1]);
    out
}

/// Largest buffer a kernel may bind, in bytes.
fn max_binding(b: &GpuBackend) -> u64 {
    b.gpu
        .limits
        .max_storage_buffer_binding_size
        .min(b.gpu.limits.max_buffer_size)
}

/// Makes room for `need` positions, doubling the capacity and copying the valid rows.
fn reserve(b: &GpuBackend, cache: &mut GpuKvCache, need: usize) {
    if need <= cache.capacity && cache.keys.is_some() {
        return;
    }
    let row_bytes = (cache.kv_dim * 4) as u64;
    let max_rows = (max_binding(b) / row_bytes.max(1)) as usize;
    assert!(
        need <= max_rows,
        "KV cache of {need} positions x {} columns exceeds the GPU's largest storage binding ({} bytes)",
        cache.kv_dim,
        max_binding(b)
    );
    let mut cap = cache.capacity.max(MIN_CAPACITY);
    while cap < need {
        cap *= 2;
    }
    let cap = cap.min(max_rows);
    // Plain device buffers: when replaced here or dropped with the session, they leave
    // the bind-group cache too.
    let keys = b.gpu.plain(b.gpu.zeroed(cap as u64 * row_bytes));
    let values = b.gpu.plain(b.gpu.zeroed(cap as u64 * row_bytes));
    let used = cache.len as u64 * row_bytes;
    if let (Some(old_k), Some(old_v)) = (&cache.keys, &cache.values) {
        b.gpu.copy(old_k, 0, &keys, 0, used);
        b.gpu.copy(old_v, 0, &values, 0, used);
    }
    cache.keys = Some(keys);
    cache.values = Some(values);
    cache.capacity = cap;
}

/// A cache holding a copy of the first `len` positions of `cache` (device copies).
pub(super) fn kv_prefix(b: &GpuBackend, cache: &GpuKvCache, len: usize) -> GpuKvCache {
    let bytes = kv_bytes(cache, len);
    let mut out = b.new_kv_cache(cache.kv_dim);
    if len == 0 {
        return out;
    }
    reserve(b, &mut out, len);
    for (src, dst) in [(&cache.keys, &out.keys), (&cache.values, &out.values)] {
        let (src, dst) = (src.as_ref().expect("held"), dst.as_ref().expect("reserved"));
        b.gpu.copy(src, 0, dst, 0, bytes);
    }
    out.len = len;
    out
}

/// Keys and values of the first `len` positions, read back in one wait.
pub(super) fn kv_read(
    b: &GpuBackend,
    cache: &GpuKvCache,
    len: usize,
) -> crate::error::Result<(Vec<f32>, Vec<f32>)> {
    let bytes = kv_bytes(cache, len);
    let (Some(keys), Some(values)) = (&cache.keys, &cache.values) else {
        return Ok((Vec::new(), Vec::new()));
    };
    let mut read = b
        .gpu
        .read_many(&[(keys, 0, bytes), (values, 0, bytes)])?
        .into_iter()
        .map(|v| bytemuck::pod_collect_to_vec::<u8, f32>(&v));
    Ok((
        read.next().unwrap_or_default(),
        read.next().unwrap_or_default(),
    ))
}

/// A cache holding `keys` and `values` `[len, kv_dim]`.
pub(super) fn kv_from(b: &GpuBackend, kv_dim: usize, keys: &[f32], values: &[f32]) -> GpuKvCache {
    assert!(
        keys.len() == values.len() && keys.len().is_multiple_of(kv_dim.max(1)),
        "kv_from: {} keys and {} values of width {kv_dim}",
        keys.len(),
        values.len()
    );
    let mut out = b.new_kv_cache(kv_dim);
    let len = keys.len() / kv_dim.max(1);
    if len == 0 {
        return out;
    }
    reserve(b, &mut out, len);
    for (src, dst) in [(keys, &out.keys), (values, &out.values)] {
        b.gpu.write(
            dst.as_ref().expect("reserved"),
            0,
            bytemuck::cast_slice(src),
        );
    }
    out.len = len;
    out
}

/// Bytes of the first `len` positions of `cache`; panics past its end.
fn kv_bytes(cache: &GpuKvCache, len: usize) -> u64 {
    assert!(
        len <= cache.len,
        "KV prefix of {len} positions of {}",
        cache.len
    );
    (len * cache.kv_dim * 4) as u64
}

pub(super) fn attention(
    b: &GpuBackend,
    q: &GpuTensor,
    k: &GpuTensor,
    v: &GpuTensor,
    cache: &mut GpuKvCache,
    dims: AttnDims,
    mask: Option<&KeyMask>,
) -> GpuTensor {
    let AttnDims {
        q_heads,
        kv_heads,
        head_dim: hd,
        scale,
    } = dims;
    let kv_dim = cache.kv_dim;
    let t_len = q.rows;
    assert!(
        kv_heads > 0 && q_heads % kv_heads == 0,
        "attention: q heads must be a multiple of kv heads"
    );
    assert_eq!(kv_dim, kv_heads * hd, "attention: cache width");
    assert_eq!((k.cols, v.cols), (kv_dim, kv_dim), "attention: kv width");
    assert_eq!((k.rows, v.rows), (t_len, t_len), "attention: kv rows");
    assert_eq!(q.cols, q_heads * hd, "attention: q width");

    let out = b.empty(t_len, q_heads * hd);
    if t_len == 0 {
        return out;
    }
    let past = cache.len;
    let total = past + t_len;
    reserve(b, cache, total);
    let (keys, values) = (
        cache.keys.as_ref().expect("reserved"),
        cache.values.as_ref().expect("reserved"),
    );
    let row_bytes = (kv_dim * 4) as u64;
    b.gpu.copy(
        &k.buf,
        0,
        keys,
        past as u64 * row_bytes,
        t_len as u64 * row_bytes,
    );
    b.gpu.copy(
        &v.buf,
        0,
        values,
        past as u64 * row_bytes,
        t_len as u64 * row_bytes,
    );
    cache.len = total;

    // Queries per chunk: their scores rows [chunk * Hq, total] fit the scratch.
    let budget = SCRATCH_BYTES.min(max_binding(b));
    let row_scores = (q_heads * total * 4) as u64;
    let chunk = ((budget / row_scores) as usize).clamp(1, t_len);
    let scratch = b.gpu.scratch_zeroed(chunk as u64 * row_scores);
    // The softmax reads the mask's words as f32 bit patterns; without a mask it reads
    // nothing, and a 4-byte buffer fills the binding (scratch may not: it is bound
    // read-write in the same dispatch).
    // A mask read by one chunk travels in the data ring; one read by several is uploaded
    // once and bound to each (uncached: it is this call's alone).
    let mask_buf;
    let mask_bind = match mask {
        Some(m) => {
            assert_eq!(
                (m.keys, m.bits.len()),
                (total, t_len * m.words_per_row()),
                "attention: mask shape"
            );
            let bits = bytemuck::cast_slice(&m.bits);
            if chunk >= t_len {
                Bind::Data(bits)
            } else {
                mask_buf = b.gpu.buffer_with(bits);
                Bind::Once(&mask_buf)
            }
        }
        None => Bind::Buffer(&b.gpu.dummy),
    };
    let group = q_heads / kv_heads;

    let mut t0 = 0;
    while t0 < t_len {
        let tc = chunk.min(t_len - t0);
        let pos0 = past + t0;
        // Scores rows hold every position visible to the chunk's last query.
        let stride = pos0 + tc;
        let row_tiles = (tc * group).div_ceil(TILE);
        let mut params = AttnParams {
            n: (tc * q_heads) as u32,
            cols: q.cols as u32,
            head_dim: hd as u32,
            q_heads: q_heads as u32,
            group: group as u32,
            kv_dim: kv_dim as u32,
            pos0: pos0 as u32,
            t_chunk: tc as u32,
            stride: stride as u32,
            scale,
            q_row0: t0 as u32,
            splits: 1,
            mask_words: mask.map_or(0, |m| m.words_per_row() as u32),
            ..Default::default()
        };

        let key_tiles = stride.div_ceil(TILE);
        params.tiles = key_tiles as u32;
        let [gx, gy] = grid((key_tiles * row_tiles) as u32);
        b.gpu.dispatch(
            &SCORES,
            &params,
            &[&scratch, &q.buf, keys],
            [gx, gy, kv_heads as u32],
        );

        let [gx, gy] = grid((tc * q_heads) as u32);
        b.gpu.dispatch_with(
            &SOFTMAX,
            &params,
            &[Bind::Buffer(&scratch), mask_bind],
            [gx, gy, 1],
        );

        let dim_tiles = hd.div_ceil(TILE);
        let tiles = dim_tiles * row_tiles;
        let mut splits = 1;
        if tiles * kv_heads < PV_TARGET_WORKGROUPS {
            splits = PV_TARGET_WORKGROUPS
                .div_ceil(tiles * kv_heads)
                .min(stride / PV_MIN_SPAN)
                .max(1);
        }
        let span = stride.div_ceil(splits).next_multiple_of(TILE);
        let splits = stride.div_ceil(span);
        params.tiles = dim_tiles as u32;
        params.span = span as u32;
        params.splits = splits as u32;
        let [gx, gy] = grid((tiles * splits) as u32);
        if splits == 1 {
            b.gpu.dispatch(
                &PV,
                &params,
                &[&scratch, values, &out.buf],
                [gx, gy, kv_heads as u32],
            );
        } else {
            let n = tc * q.cols;
            let partials = b.gpu.scratch((splits * n * 4) as u64);
            params.n = n as u32;
            params.q_row0 = 0;
            params.split_stride = n as u32;
            b.gpu.dispatch(
                &PV,
                &params,
                &[&scratch, values, &partials],
                [gx, gy, kv_heads as u32],
            );
            params.q_row0 = t0 as u32;
            let [gx, gy] = grid(n.div_ceil(256) as u32);
            b.gpu
                .dispatch(&SUM, &params, &[&out.buf, &partials], [gx, gy, 1]);
        }

        t0 += tc;
    }
    out
}
