//! Linear-layer weights as stored by MLX: quantized (`.weight` packed `u32`, `.scales`,
//! `.biases`) or dense (`.weight` in f32 / f16 / bf16).

use safetensors::Dtype;

use super::{expect_shape, Checkpoint};
use crate::config::QuantSpec;
use crate::error::{Error, Result};

/// Converts little-endian float bytes to f32. `None` for a non-float dtype.
pub fn floats_to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

/// An MLX affine-quantized matrix `[rows, cols]`, copied out of the checkpoint.
/// Element `c` of row `r` is `scales[r, c / g] * q + biases[r, c / g]` where
/// `q = (packed[r, c / per_word] >> (bits * (c % per_word))) & (2^bits - 1)`
/// (../shared/spec/models.md §3.2-3.3; mlx `affine_dequantize`).
#[derive(Clone, Debug)]
pub struct QuantizedMatrix {
    pub spec: QuantSpec,
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols / per_word]` packed words.
    pub packed: Vec<u32>,
    /// Dtype of `scales` and `biases` as stored (F32, F16 or BF16).
    pub scale_dtype: Dtype,
    /// `[rows, cols / group_size]` little-endian values of `scale_dtype`, as stored.
    pub scales: Vec<u8>,
    /// `[rows, cols / group_size]`, like `scales`.
    pub biases: Vec<u8>,
}

/// A dense matrix `[rows, cols]` widened to f32.
#[derive(Clone, Debug)]
pub struct DenseMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// A linear layer's weight `[out, in]`, applied as `y = x W^T`.
#[derive(Clone, Debug)]
pub enum LinearWeight {
    Quantized(QuantizedMatrix),
    Dense(DenseMatrix),
}

impl LinearWeight {
    /// `(out, in)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            LinearWeight::Quantized(q) => (q.rows, q.cols),
            LinearWeight::Dense(d) => (d.rows, d.cols),
        }
    }
}

impl Checkpoint {
    /// The weight of module `module` (e.g. `model.layers.0.mlp.gate`), expected to be
    /// `[out, in]` after dequantization.
    ///
    /// The module is quantized iff the config's `quantization` block has an entry for it
    /// or `<module>.scales` exists (mlx-lm `load_model`); bits and group size come from
    /// the per-module entry, else the global ones.
    /// Errors: missing tensors, wrong dtypes or shapes, scales/biases disagreeing.
    pub fn linear(&self, module: &str, out: usize, inp: usize) -> Result<LinearWeight> {
        let weight_name = format!("{module}.weight");
        let scales_name = format!("{module}.scales");
        let q = &self.config.quantization;
        let spec = match q.for_module(module) {
            Some(spec) => spec,
            None if self.contains(&scales_name) => q.default,
            None => None,
        };
        let Some(spec) = spec else {
            return Ok(LinearWeight::Dense(DenseMatrix {
                rows: out,
                cols: inp,
                data: self.floats(&weight_name, &[out, inp])?,
            }));
        };
        let (packed, scales, biases) = self.quantized_parts(module, spec, &[], out, inp)?;
        Ok(LinearWeight::Quantized(QuantizedMatrix {
            spec,
            rows: out,
            cols: inp,
            packed: packed
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            scale_dtype: scales.0,
            scales: scales.1.to_vec(),
            biases: biases.1.to_vec(),
        }))
    }

    /// Validates and returns the raw bytes of `<module>.{weight,scales,biases}` for a
    /// quantized tensor of logical shape `lead ++ [out, inp]`.
    #[allow(clippy::type_complexity)]
    pub(crate) fn quantized_parts(
        &self,
        module: &str,
        spec: QuantSpec,
        lead: &[usize],
        out: usize,
        inp: usize,
    ) -> Result<(&[u8], (Dtype, &[u8]), (Dtype, &[u8]))> {
        let w = self.tensor(&format!("{module}.weight"))?;
        let s = self.tensor(&format!("{module}.scales"))?;
        let b = self.tensor(&format!("{module}.biases"))?;
        if inp % spec.group_size != 0 {
            return Err(Error::bad_tensor(
                &w.name,
                format!(
                    "input size {inp} is not a multiple of the group size {}",
                    spec.group_size
                ),
            ));
        }
        if w.dtype != Dtype::U32 {
            return Err(Error::bad_tensor(
                &w.name,
                format!(
                    "dtype {:?}, expected U32 packed {}-bit values",
                    w.dtype, spec.bits
                ),
            ));
        }
        let mut wshape = lead.to_vec();
        wshape.extend([out, inp / spec.per_word()]);
        expect_shape(w, &wshape)?;
        let mut sshape = lead.to_vec();
        sshape.extend([out, inp / spec.group_size]);
        for t in [s, b] {
            if !matches!(t.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
                return Err(Error::bad_tensor(
                    &t.name,
                    format!("dtype {:?}, expected F32, F16 or BF16", t.dtype),
                ));
            }
            expect_shape(t, &sshape)?;
        }
        if s.dtype != b.dtype {
            return Err(Error::bad_tensor(
                &b.name,
                format!("dtype {:?} differs from the scales' {:?}", b.dtype, s.dtype),
            ));
        }
        Ok((
            self.bytes(w),
            (s.dtype, self.bytes(s)),
            (b.dtype, self.bytes(b)),
        ))
    }
}
