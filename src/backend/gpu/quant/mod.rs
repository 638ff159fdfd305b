//! Quantized matmul, embedding rows and the routed-expert gather-matmul (`wgsl/quant.wgsl`).
//!
//! Routed experts are computed from slot memory: each dispatch gets a table of
//! (record base, token) per route, or, when the routing stayed on the device, the routed
//! ids and the layer's table of (arena, record base) per expert, so one dispatch covers
//! every routed expert of a layer that lives in one arena. Records from a pool are
//! mirrored in device arenas and copied only when a slot's generation changed; records
//! without a slot are uploaded per call. The routed experts' combine also adds the shared
//! expert.
//!
//! This file uploads weights and runs the dense and quantized products of resident
//! weights and the embedding; the kernels and their launch parameters are in `params.rs`,
//! the routed experts in `experts.rs`.

mod experts;
mod params;

pub(super) use experts::{mirror_places, moe_experts, moe_experts_resident};
pub(super) use params::Params;

use super::device::Bind;
use super::{GpuBackend, GpuTensor, GpuWeight};
use crate::checkpoint::LinearWeight;
use crate::error::{Error, Result};

use params::{dtype_code, elem_bytes, EMBED, MAX_PARTS};

/// Packed words, then scales and biases in row quads ([`row_quads`]), in one buffer (the
/// quads starting on a 16-byte boundary, which also ends the whole), as the kernels read
/// them.
pub(super) fn upload_weight(b: &GpuBackend, w: LinearWeight) -> Result<GpuWeight> {
    let max = b.gpu.limits.max_storage_buffer_binding_size;
    let (rows, cols) = w.shape();
    // Bytes per row as laid out below, and the padding a part may add (16-byte alignment,
    // and a last row quad of up to three rows past the end).
    let (row_bytes, padding) = match &w {
        LinearWeight::Quantized(q) => {
            let rows = rows.max(1) as u64;
            let sb = (q.scales.len() + q.biases.len()) as u64 / rows;
            (q.packed.len() as u64 * 4 / rows + sb, 32 + 3 * sb)
        }
        LinearWeight::Dense(_) => (cols as u64 * 4, 0),
    };
    if row_bytes * rows as u64 + padding > max {
        let per = (max.saturating_sub(padding) / row_bytes.max(1)) as usize;
        if per == 0 {
            return Err(Error::Gpu(format!(
                "one row of a {rows}x{cols} weight needs {row_bytes} bytes, above the adapter's storage binding limit of {max}"
            )));
        }
        let parts = (0..rows)
            .step_by(per)
            .map(|first| {
                let range: Vec<usize> = (first..(first + per).min(rows)).collect();
                Ok((first, upload_part(b, w.select_rows(&range), max)?))
            })
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(
            rows,
            cols,
            parts = parts.len(),
            "weight split into row ranges"
        );
        return Ok(GpuWeight::Rows(parts));
    }
    upload_part(b, w, max)
}

/// One binding's worth of [`upload_weight`].
fn upload_part(b: &GpuBackend, w: LinearWeight, max: u64) -> Result<GpuWeight> {
    match w {
        LinearWeight::Quantized(q) => {
            let code = dtype_code(q.scale_dtype);
            let mut bytes: Vec<u8> = bytemuck::cast_slice(&q.packed).to_vec();
            // The row quads' blocks start on a 16-byte vector.
            bytes.resize(bytes.len().next_multiple_of(16), 0);
            let s_start = bytes.len();
            let groups = q.cols / q.spec.group_size;
            bytes.extend(row_quads(
                &q.scales,
                &q.biases,
                q.rows,
                groups,
                elem_bytes(code),
            ));
            if bytes.len() as u64 > max {
                return Err(Error::Gpu(format!(
                    "a {}x{} weight needs {} bytes, above the adapter's storage binding limit of {max}",
                    q.rows,
                    q.cols,
                    bytes.len()
                )));
            }
            Ok(GpuWeight::Quantized {
                spec: q.spec,
                rows: q.rows,
                cols: q.cols,
                scale_dtype: code,
                s_off: (s_start / elem_bytes(code)) as u32,
                // A row's bias lies 4 elements after its scale.
                b_off: (s_start / elem_bytes(code)) as u32 + 4,
                data: b.gpu.plain(b.gpu.buffer_with(&bytes)),
            })
        }
        LinearWeight::Dense(d) => {
            let bytes = (d.data.len() * 4) as u64;
            if bytes > max {
                return Err(Error::Gpu(format!(
                    "a {}x{} f32 weight needs {bytes} bytes, above the adapter's storage binding limit of {max}",
                    d.rows, d.cols
                )));
            }
            Ok(GpuWeight::Dense {
                rows: d.rows,
                cols: d.cols,
                data: b
                    .gpu
                    .plain(b.gpu.buffer_with(bytemuck::cast_slice(&d.data))),
            })
        }
    }
}

/// A `rows x groups` weight's scales and biases (MLX's layout: all scales by row, then all
/// biases, `elem` bytes each) in row quads: for rows `4q .. 4q + 3` and group `g`, the
/// four rows' scales then their four biases (zeros past the last row), block `q groups + g`.
/// A matvec lane that computes four rows loads them as one 16-byte vector (two at f32)
/// where MLX's layout takes one per row for each (`quad_sb` in `wgsl/quant.wgsl`).
fn row_quads(scales: &[u8], biases: &[u8], rows: usize, groups: usize, elem: usize) -> Vec<u8> {
    let mut out = vec![0u8; rows.div_ceil(4) * groups * 8 * elem];
    for r in 0..rows {
        for g in 0..groups {
            let from = (r * groups + g) * elem;
            let to = ((r / 4 * groups + g) * 8 + r % 4) * elem;
            out[to..to + elem].copy_from_slice(&scales[from..from + elem]);
            out[to + 4 * elem..to + 5 * elem].copy_from_slice(&biases[from..from + elem]);
        }
    }
    out
}

/// [`crate::backend::Backend::matmul_swiglu`]: a quantized `[Wg; Wu]` in one fused
/// dispatch, a dense one as a matmul and an elementwise SwiGLU over the halves.
pub(super) fn matmul_swiglu(b: &GpuBackend, x: &GpuTensor, w: &GpuWeight) -> GpuTensor {
    let Some((params, data)) = Params::resident_swiglu(w) else {
        return super::elementwise::swiglu_halves(b, &matmul(b, x, w));
    };
    assert_eq!(x.cols, params.cols as usize, "matmul_swiglu input width");
    let out = b.empty(x.rows, params.rows as usize);
    let (kernel, params, groups) = params.launch(x.rows, b.gpu.tiled, b.gpu.invocations);
    let dummy = &b.gpu.dummy;
    b.gpu.dispatch(
        kernel,
        &params,
        &[&x.buf, data, dummy, &out.buf, dummy, dummy],
        groups,
    );
    out
}

pub(super) fn embed(b: &GpuBackend, table: &GpuWeight, ids: &[u32]) -> Result<GpuTensor> {
    let (rows, cols) = table.shape();
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= rows) {
        return Err(Error::InvalidInput(format!(
            "token id {bad} is out of range for a vocabulary of {rows}"
        )));
    }
    let out = b.empty(ids.len(), cols);
    embed_into(b, table, ids, &out);
    Ok(out)
}

/// Row `ids[t]` of `table` into row `t` of `out`, for every `t` whose id is not [`SKIP`].
fn embed_into(b: &GpuBackend, table: &GpuWeight, ids: &[u32], out: &GpuTensor) {
    let cols = out.cols;
    match table {
        GpuWeight::Quantized { .. } => {
            let (params, data) = Params::resident(table).expect("a quantized weight");
            let ids = bytemuck::cast_slice(ids);
            let binds = [
                Bind::Buffer(&b.gpu.dummy),
                Bind::Buffer(data),
                Bind::Data(ids),
                Bind::Buffer(&out.buf),
            ];
            b.gpu
                .dispatch_with(&EMBED, &params, &binds, [1, 1, ids.len() as u32 / 4]);
        }
        GpuWeight::Dense { data, .. } => {
            for (t, &id) in ids.iter().enumerate().filter(|(_, &id)| id != SKIP) {
                b.gpu.copy(
                    data,
                    (id as usize * cols * 4) as u64,
                    &out.buf,
                    (t * cols * 4) as u64,
                    (cols * 4) as u64,
                );
            }
        }
        GpuWeight::Rows(parts) => {
            for (first, part) in parts {
                let range = *first as u32..(*first + part.shape().0) as u32;
                let local: Vec<u32> = ids
                    .iter()
                    .map(|&id| {
                        if range.contains(&id) {
                            id - range.start
                        } else {
                            SKIP
                        }
                    })
                    .collect();
                if local.iter().any(|&id| id != SKIP) {
                    embed_into(b, part, &local, out);
                }
            }
        }
    }
}

/// An embedding id that the part of a split table at hand does not hold
/// (`0xFFFFFFFF` in `wgsl/quant.wgsl`'s `embed`).
const SKIP: u32 = u32::MAX;

/// [`crate::backend::Backend::matmul_parts`]: a quantized weight of up to [`MAX_PARTS`]
/// parts in one dispatch that writes each part's output; otherwise one matmul, then a
/// column gather per part.
pub(super) fn matmul_parts(
    b: &GpuBackend,
    x: &GpuTensor,
    w: &GpuWeight,
    widths: &[usize],
) -> Vec<GpuTensor> {
    let (rows, cols) = w.shape();
    assert_eq!(x.cols, cols, "matmul_parts input width");
    assert_eq!(
        widths.iter().sum::<usize>(),
        rows,
        "matmul_parts: part widths"
    );
    assert!(widths.iter().all(|&n| n > 0), "matmul_parts: an empty part");
    let Some((whole, data)) = Params::resident(w).filter(|_| widths.len() <= MAX_PARTS) else {
        return crate::backend::matmul_parts_by_gather(b, x, w, widths);
    };
    let outs: Vec<GpuTensor> = widths.iter().map(|&n| b.empty(x.rows, n)).collect();
    let mut part_ends = [rows as u32; 3];
    let mut end = 0;
    for (slot, &n) in part_ends.iter_mut().zip(widths) {
        end += n as u32;
        *slot = end;
    }
    let params = Params {
        part_end_a: part_ends[0],
        part_end_b: part_ends[1],
        part_end_c: part_ends[2],
        ..whole
    };
    let (kernel, params, groups) = params.launch(x.rows, b.gpu.tiled, b.gpu.invocations);
    let dummy = &b.gpu.dummy;
    // Bindings of parts that do not exist repeat the first output, which they never write.
    let out = |i: usize| &outs.get(i).unwrap_or(&outs[0]).buf;
    b.gpu.dispatch(
        kernel,
        &params,
        &[
            &x.buf,
            data,
            dummy,
            out(0),
            dummy,
            dummy,
            out(1),
            out(2),
            out(3),
        ],
        groups,
    );
    outs
}

pub(super) fn matmul(b: &GpuBackend, x: &GpuTensor, w: &GpuWeight) -> GpuTensor {
    let (rows, cols) = w.shape();
    assert_eq!(x.cols, cols, "matmul input width");
    let out = b.empty(x.rows, rows);
    matmul_into(b, x, w, &out, 0);
    out
}

/// `x W^T` into columns `first ..` of `out`.
fn matmul_into(b: &GpuBackend, x: &GpuTensor, w: &GpuWeight, out: &GpuTensor, first: usize) {
    let dummy = &b.gpu.dummy;
    let placed = |params: Params| Params {
        out_cols: out.cols as u32,
        out_first: first as u32,
        ..params
    };
    match w {
        GpuWeight::Quantized { .. } => {
            let (params, data) = Params::resident(w).expect("a quantized weight");
            let params = placed(params);
            let (kernel, params, groups) = params.launch(x.rows, b.gpu.tiled, b.gpu.invocations);
            b.gpu.dispatch(
                kernel,
                &params,
                &[&x.buf, data, dummy, &out.buf, dummy, dummy],
                groups,
            );
        }
        GpuWeight::Dense { rows, cols, data } => {
            let params = placed(Params {
                rows: *rows as u32,
                cols: *cols as u32,
                ..Default::default()
            });
            let (kernel, params, groups) = params.launch(x.rows, b.gpu.tiled, b.gpu.invocations);
            b.gpu.dispatch(
                kernel,
                &params,
                &[&x.buf, data, dummy, &out.buf, dummy, dummy],
                groups,
            );
        }
        GpuWeight::Rows(parts) => {
            for (part_first, part) in parts {
                matmul_into(b, x, part, out, first + part_first);
            }
        }
    }
}
