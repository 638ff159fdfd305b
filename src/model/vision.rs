//! The vision tower of Qwen3.5-MoE and Qwen3.8-Flash-Next (transformers 5.24.0
//! `Qwen3_5MoeVisionModel`, ../shared/spec/reference-system.md A.10): an image's patches
//! (from [`crate::image_processor`]) to one row of the language model's width per token.
//!
//! ```text
//! x = patches W_patch^T + b                       # Conv3d over (channel, frame, row, col)
//! x += bilinear(pos_embed, grid)                  # the learned square grid resampled
//! for each block:                                 #   (align_corners) to the image's grid
//!     x += proj(attention(rope2d(qkv(ln1(x)))))   # every patch sees every patch
//!     x += fc2(gelu_tanh(fc1(ln2(x))))
//! out = fc2(gelu(fc1(ln(x).view(tokens, 4 hidden))))   # the patch merger
//! ```
//!
//! The rotary embedding is axial: of each head's `d` values, the first quarter pairs
//! (rotate-half over the whole head) turn by the patch's row, the second by its column,
//! at frequencies `theta^(-4j/d)`. Patches come in the spatial merge's order, so the
//! merger folds four consecutive rows into one token.
//!
//! It runs on the CPU backend's kernels (its matmuls: dense or quantized linear weights),
//! in f32, whatever backend runs the language model.
//!
//! Weights are read under the MLX conversions' names, `vision_tower.*` (the patch
//! embedding's Conv3d weight channels-last, `[out, frames, rows, cols, channels]`, as
//! mlx-vlm stores it), or under the Hugging Face names `model.visual.*` (channels-first,
//! `[out, channels, frames, rows, cols]`); the layout is told from the shape.

use rayon::prelude::*;

use super::ImageEmbedding;
use crate::backend::cpu::{CpuBackend, CpuTensor};
use crate::backend::{rotate_half, Backend};
use crate::checkpoint::{Checkpoint, LinearWeight};
use crate::config::VisionConfig;
use crate::error::{Error, Result};
use crate::image_processor::Patches;

/// LayerNorm eps of every norm of the tower (transformers hard-codes 1e-6).
const LN_EPS: f32 = 1e-6;

pub use crate::config::VISION_PREFIXES;

/// A LayerNorm's weight and bias.
struct LayerNorm {
    weight: Vec<f32>,
    bias: Vec<f32>,
}

/// A linear layer with a bias: `x W^T + b`.
struct Linear {
    weight: LinearWeight,
    bias: Vec<f32>,
}

struct Block {
    norm1: LayerNorm,
    norm2: LayerNorm,
    qkv: Linear,
    proj: Linear,
    fc1: Linear,
    fc2: Linear,
}

/// The vision tower's weights, resident in f32 (or as stored, for quantized linears).
pub struct VisionTower {
    cfg: VisionConfig,
    /// The patch embedding as a linear layer over a patch's values in the processor's
    /// order (channel, frame, row, column): `[hidden, patch_values]`.
    patch_embed: Linear,
    /// `[num_position_embeddings, hidden]`.
    pos_embed: Vec<f32>,
    blocks: Vec<Block>,
    merger_norm: LayerNorm,
    merger_fc1: Linear,
    merger_fc2: Linear,
    cpu: CpuBackend,
}

/// Reads the tower's tensors under one prefix.
struct Reader<'a> {
    ckpt: &'a Checkpoint,
    prefix: &'static str,
}

impl Reader<'_> {
    fn name(&self, rest: &str) -> String {
        format!("{}.{rest}", self.prefix)
    }

    fn norm(&self, module: &str, width: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: self
                .ckpt
                .floats(&self.name(&format!("{module}.weight")), &[width])?,
            bias: self
                .ckpt
                .floats(&self.name(&format!("{module}.bias")), &[width])?,
        })
    }

    fn linear(&self, module: &str, out: usize, inp: usize) -> Result<Linear> {
        Ok(Linear {
            weight: self.ckpt.linear(&self.name(module), out, inp)?,
            bias: self
                .ckpt
                .floats(&self.name(&format!("{module}.bias")), &[out])?,
        })
    }
}

impl VisionTower {
    /// Loads the tower of `ckpt`, whose config must have a `vision_config`.
    /// Errors: [`Error::InvalidInput`] when the config has no `vision_config` or the
    /// checkpoint no tower; a missing tensor, a wrong shape or dtype.
    pub fn load(ckpt: &Checkpoint) -> Result<Self> {
        let cfg = ckpt.config.vision.clone().ok_or_else(|| {
            Error::InvalidInput("this model has no vision tower (no vision_config)".into())
        })?;
        let prefix = VISION_PREFIXES
            .into_iter()
            .find(|p| ckpt.contains(&format!("{p}.pos_embed.weight")))
            .ok_or_else(|| {
                Error::InvalidInput(
                    "this checkpoint has no vision tower (no vision_tower.* or model.visual.* tensors)"
                        .into(),
                )
            })?;
        let r = Reader { ckpt, prefix };
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
        let merged = d * cfg.merge_unit();
        let blocks = (0..cfg.depth)
            .map(|b| {
                let m = |s: &str| format!("blocks.{b}.{s}");
                Ok(Block {
                    norm1: r.norm(&m("norm1"), d)?,
                    norm2: r.norm(&m("norm2"), d)?,
                    qkv: r.linear(&m("attn.qkv"), 3 * d, d)?,
                    proj: r.linear(&m("attn.proj"), d, d)?,
                    fc1: r.linear(&m("mlp.linear_fc1"), i, d)?,
                    fc2: r.linear(&m("mlp.linear_fc2"), d, i)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(VisionTower {
            patch_embed: Linear {
                weight: LinearWeight::Dense(crate::checkpoint::DenseMatrix {
                    rows: d,
                    cols: cfg.patch_values(),
                    data: patch_embed_weight(ckpt, &r.name("patch_embed.proj.weight"), &cfg)?,
                }),
                bias: ckpt.floats(&r.name("patch_embed.proj.bias"), &[d])?,
            },
            pos_embed: ckpt.floats(
                &r.name("pos_embed.weight"),
                &[cfg.num_position_embeddings, d],
            )?,
            blocks,
            merger_norm: r.norm("merger.norm", d)?,
            merger_fc1: r.linear("merger.linear_fc1", merged, merged)?,
            merger_fc2: r.linear("merger.linear_fc2", cfg.out_hidden_size, merged)?,
            cfg,
            cpu: CpuBackend::simd(),
        })
    }

    /// The tower's geometry.
    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// The tower's output for one image: `[patches.tokens, out_hidden_size]` row-major,
    /// the rows that replace the image's placeholder tokens.
    /// Errors: [`Error::InvalidInput`] when the patches are not of this tower's patch
    /// size or grid (a grid whose sides are not multiples of the merge size).
    pub fn forward(&self, patches: &Patches) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let g = patches.grid;
        let m = cfg.spatial_merge_size;
        let n = g.patches();
        if g.t != 1
            || n == 0
            || !g.h.is_multiple_of(m)
            || !g.w.is_multiple_of(m)
            || patches.values.len() != n * cfg.patch_values()
        {
            return Err(Error::InvalidInput(format!(
                "patches of a {}x{}x{} grid with {} values do not fit a tower of patch values {} and merge {m}",
                g.t,
                g.h,
                g.w,
                patches.values.len(),
                cfg.patch_values()
            )));
        }
        let d = cfg.hidden_size;
        let x = CpuTensor {
            rows: n,
            cols: cfg.patch_values(),
            data: patches.values.clone(),
        };
        let mut x = self.apply(&self.patch_embed, &x);
        // (row, column) of each patch, in the merge order the processor lays them out.
        let coords: Vec<(usize, usize)> = (0..n)
            .map(|i| {
                let (block, within) = (i / (m * m), i % (m * m));
                let (bh, bw) = (block / (g.w / m), block % (g.w / m));
                (bh * m + within / m, bw * m + within % m)
            })
            .collect();
        self.add_positions(&mut x.data, &coords, g.h, g.w);
        let angles = self.rotary_angles(&coords);
        for block in &self.blocks {
            let normed = layer_norm(&x, &block.norm1);
            let qkv = self.apply(&block.qkv, &normed);
            let attn = self.attention(&qkv, &angles);
            add_into(&mut x.data, &self.apply(&block.proj, &attn).data);
            let normed = layer_norm(&x, &block.norm2);
            let mut h = self.apply(&block.fc1, &normed);
            h.data.par_iter_mut().for_each(|v| *v = gelu_tanh(*v));
            add_into(&mut x.data, &self.apply(&block.fc2, &h).data);
        }
        let normed = layer_norm(&x, &self.merger_norm);
        let folded = CpuTensor {
            rows: n / cfg.merge_unit(),
            cols: d * cfg.merge_unit(),
            data: normed.data,
        };
        let mut h = self.apply(&self.merger_fc1, &folded);
        h.data.par_iter_mut().for_each(|v| *v = gelu(*v));
        Ok(self.apply(&self.merger_fc2, &h).data)
    }

    /// [`VisionTower::forward`] as the language model takes it: the rows with the merged
    /// grid they lie on (`[t, h / merge, w / merge]`), for [`super::Model::place_images`].
    /// Errors: as [`VisionTower::forward`].
    pub fn embed(&self, patches: &Patches) -> Result<ImageEmbedding> {
        let m = self.cfg.spatial_merge_size;
        let g = patches.grid;
        Ok(ImageEmbedding {
            rows: self.forward(patches)?.into(),
            grid: [g.t, g.h / m, g.w / m],
            key: patches.key(),
        })
    }

    /// `x W^T + b` on the CPU backend's kernels.
    fn apply(&self, l: &Linear, x: &CpuTensor) -> CpuTensor {
        let mut y = self.cpu.matmul(x, &l.weight);
        y.data
            .par_chunks_mut(y.cols)
            .for_each(|row| add_into(row, &l.bias));
        y
    }

    /// Adds the learned position table resampled to the `h x w` grid (transformers
    /// `get_vision_interpolation_indices_and_weights`, bilinear with `align_corners`:
    /// grid index `i` samples the table at `i (side - 1) / (size - 1)`).
    fn add_positions(&self, x: &mut [f32], coords: &[(usize, usize)], h: usize, w: usize) {
        let d = self.cfg.hidden_size;
        let side = self.cfg.position_grid_side();
        let taps = |i: usize, size: usize| -> [(usize, f32); 2] {
            let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
            let floor = src.floor();
            let lo = floor as usize;
            let frac = src - floor;
            [
                (lo.min(side - 1), 1.0 - frac),
                ((lo + 1).min(side - 1), frac),
            ]
        };
        let table = &self.pos_embed;
        x.par_chunks_mut(d)
            .zip(coords.par_iter())
            .for_each(|(row, &(r, c))| {
                for (tr, wr) in taps(r, h) {
                    for (tc, wc) in taps(c, w) {
                        let weight = wr * wc;
                        let t = &table[(tr * side + tc) * d..][..d];
                        for (o, &v) in row.iter_mut().zip(t) {
                            *o += weight * v;
                        }
                    }
                }
            });
    }

    /// `(cos, sin)` per patch and rotated pair (`head_dim / 2` of them): the first
    /// `head_dim / 4` at the patch's row times the frequencies, the rest at its column
    /// (transformers `Qwen3_5MoeVisionRotaryEmbedding`, axial; computed in f64).
    fn rotary_angles(&self, coords: &[(usize, usize)]) -> Vec<(f32, f32)> {
        let quarter = self.cfg.head_dim() / 4;
        let spatial = (self.cfg.head_dim() / 2) as f64;
        let inv_freq: Vec<f64> = (0..quarter)
            .map(|j| self.cfg.rope_theta.powf(-((2 * j) as f64) / spatial))
            .collect();
        coords
            .iter()
            .flat_map(|&(r, c)| {
                let axis = |p: usize| inv_freq.iter().map(move |f| (p as f64 * f).sin_cos());
                axis(r)
                    .chain(axis(c))
                    .map(|(sin, cos)| (cos as f32, sin as f32))
            })
            .collect()
    }

    /// Softmax attention of every patch over every patch, per head, with the 2-D rotary
    /// embedding on queries and keys: `qkv` `[n, 3 hidden]` (q, k, v each `[n, heads,
    /// head_dim]`) to `[n, hidden]`.
    fn attention(&self, qkv: &CpuTensor, angles: &[(f32, f32)]) -> CpuTensor {
        let (n, d) = (qkv.rows, self.cfg.hidden_size);
        let (heads, hd) = (self.cfg.num_heads, self.cfg.head_dim());
        let half = hd / 2;
        let scale = (hd as f32).powf(-0.5);
        // Each head's queries, keys and values, contiguous, q and k rotated.
        let per_head: Vec<[Vec<f32>; 3]> = (0..heads)
            .into_par_iter()
            .map(|h| {
                std::array::from_fn(|part| {
                    let mut out = Vec::with_capacity(n * hd);
                    for t in 0..n {
                        let start = t * 3 * d + part * d + h * hd;
                        out.extend_from_slice(&qkv.data[start..start + hd]);
                        if part < 2 {
                            let head = &mut out[t * hd..];
                            rotate_half(head, &angles[t * half..(t + 1) * half]);
                        }
                    }
                    out
                })
            })
            .collect();
        let mut out = vec![0.0f32; n * d];
        // Rows of queries a task takes: enough work per task, every core busy.
        let rows_per_task = n.div_ceil(4 * rayon::current_num_threads()).max(1);
        out.par_chunks_mut(rows_per_task * d)
            .enumerate()
            .for_each(|(task, chunk)| {
                let mut scores = vec![0.0f32; n];
                for (i, out_row) in chunk.chunks_mut(d).enumerate() {
                    let t = task * rows_per_task + i;
                    for (h, [q, k, v]) in per_head.iter().enumerate() {
                        let q = &q[t * hd..(t + 1) * hd];
                        let mut max = f32::NEG_INFINITY;
                        for (s, key) in scores.iter_mut().zip(k.chunks_exact(hd)) {
                            *s = crate::backend::cpu::dot(q, key) * scale;
                            max = max.max(*s);
                        }
                        let mut sum = 0.0f32;
                        for s in scores.iter_mut() {
                            *s = (*s - max).exp();
                            sum += *s;
                        }
                        let o = &mut out_row[h * hd..(h + 1) * hd];
                        for (&p, value) in scores.iter().zip(v.chunks_exact(hd)) {
                            let p = p / sum;
                            for (a, &b) in o.iter_mut().zip(value) {
                                *a += p * b;
                            }
                        }
                    }
                }
            });
        CpuTensor {
            rows: n,
            cols: d,
            data: out,
        }
    }
}

/// The patch embedding's Conv3d weight as `[out, patch_values]` in the processor's order
/// (channel, frame, row, column): as stored when channels-first (`[out, c, t, p, p]`,
/// Hugging Face), transposed when channels-last (`[out, t, p, p, c]`, mlx-vlm).
/// Errors: neither shape, or not a float tensor.
fn patch_embed_weight(ckpt: &Checkpoint, name: &str, cfg: &VisionConfig) -> Result<Vec<f32>> {
    let (o, c, t, p) = (
        cfg.hidden_size,
        cfg.in_channels,
        cfg.temporal_patch_size,
        cfg.patch_size,
    );
    let channels_first = [o, c, t, p, p];
    let channels_last = [o, t, p, p, c];
    let stored = ckpt.tensor(name)?.shape.clone();
    if stored == channels_first {
        return ckpt.floats(name, &channels_first);
    }
    if stored != channels_last {
        return Err(Error::bad_tensor(
            name,
            format!(
                "shape {stored:?}, expected {channels_last:?} (MLX, channels last) or {channels_first:?}"
            ),
        ));
    }
    let last = ckpt.floats(name, &channels_last)?;
    let mut out = vec![0.0f32; last.len()];
    for oi in 0..o {
        for ti in 0..t {
            for y in 0..p {
                for x in 0..p {
                    for ci in 0..c {
                        let from = (((oi * t + ti) * p + y) * p + x) * c + ci;
                        let to = (((oi * c + ci) * t + ti) * p + y) * p + x;
                        out[to] = last[from];
                    }
                }
            }
        }
    }
    Ok(out)
}

/// LayerNorm over each row: `(x - mean) / sqrt(var + eps) * w + b` (biased variance, in f32).
fn layer_norm(x: &CpuTensor, norm: &LayerNorm) -> CpuTensor {
    let mut data = x.data.clone();
    data.par_chunks_mut(x.cols).for_each(|row| {
        let n = row.len() as f32;
        let mean = row.iter().sum::<f32>() / n;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
        let inv = 1.0 / (var + LN_EPS).sqrt();
        for ((v, w), b) in row.iter_mut().zip(&norm.weight).zip(&norm.bias) {
            *v = (*v - mean) * inv * w + b;
        }
    });
    CpuTensor {
        rows: x.rows,
        cols: x.cols,
        data,
    }
}

/// `a += b` element-wise.
fn add_into(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`): `x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x³)))`.
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

/// GELU, exact (`nn.GELU()`): `x/2 (1 + erf(x / sqrt 2))`.
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}
