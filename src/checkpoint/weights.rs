//! Linear-layer weights as stored by MLX: quantized (`.weight` packed `u32`, `.scales`,
//! `.biases`) or dense (`.weight` in f32 / f16 / bf16).

use safetensors::Dtype;

use super::quant::{dequantize_row, Floats, QuantView};
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

impl QuantizedMatrix {
    /// The matrix as the CPU dequantizer reads it.
    pub fn view(&self) -> QuantView<'_> {
        QuantView {
            spec: self.spec,
            rows: self.rows,
            cols: self.cols,
            packed: bytemuck::cast_slice(&self.packed),
            scales: Floats {
                dtype: self.scale_dtype,
                bytes: &self.scales,
            },
            biases: Floats {
                dtype: self.scale_dtype,
                bytes: &self.biases,
            },
        }
    }
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

    /// The weight whose output `i` is this one's output `rows[i]`: how a fused
    /// projection's interleaved outputs are regrouped once at load, instead of gathering
    /// columns of its output at every step. Quantization groups run along a row, so a
    /// quantized row moves with its packed words, scales and biases.
    /// Panics if a row is out of range (callers index rows they have validated).
    pub fn select_rows(&self, rows: &[usize]) -> LinearWeight {
        fn pick<T: Copy>(data: &[T], width: usize, rows: &[usize]) -> Vec<T> {
            rows.iter()
                .flat_map(|&r| &data[r * width..(r + 1) * width])
                .copied()
                .collect()
        }
        match self {
            LinearWeight::Quantized(q) => {
                let scale_row = q.scales.len() / q.rows.max(1);
                LinearWeight::Quantized(QuantizedMatrix {
                    spec: q.spec,
                    rows: rows.len(),
                    cols: q.cols,
                    packed: pick(&q.packed, q.cols / q.spec.per_word(), rows),
                    scale_dtype: q.scale_dtype,
                    scales: pick(&q.scales, scale_row, rows),
                    biases: pick(&q.biases, scale_row, rows),
                })
            }
            LinearWeight::Dense(d) => LinearWeight::Dense(DenseMatrix {
                rows: rows.len(),
                cols: d.cols,
                data: pick(&d.data, d.cols, rows),
            }),
        }
    }

    /// The weight split by input columns at `at`: `(W[:, ..at], W[:, at..])`, so that
    /// `concat(a, b) W^T = a W1^T + b W2^T` runs without joining `a` and `b` (the MTP
    /// head's `fc` over an embedding and a hidden state). A quantized weight splits on a
    /// quantization group, its packed words, scales and biases moving with their columns.
    /// Errors: `at` outside the row, or not on a group (or packed word) boundary.
    pub fn split_columns(&self, name: &str, at: usize) -> Result<(LinearWeight, LinearWeight)> {
        fn cut<T: Copy>(data: &[T], width: usize, at: usize) -> (Vec<T>, Vec<T>) {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for row in data.chunks(width.max(1)) {
                a.extend_from_slice(&row[..at]);
                b.extend_from_slice(&row[at..]);
            }
            (a, b)
        }
        let (_, cols) = self.shape();
        if at == 0 || at >= cols {
            return Err(Error::bad_tensor(
                name,
                format!("cannot split its {cols} columns at {at}"),
            ));
        }
        Ok(match self {
            LinearWeight::Quantized(q) => {
                let (g, per_word) = (q.spec.group_size, q.spec.per_word());
                if !at.is_multiple_of(g) || !at.is_multiple_of(per_word) {
                    return Err(Error::bad_tensor(
                        name,
                        format!("column {at} is not on a quantization group of {g}"),
                    ));
                }
                let size = q.scales.len() / (q.rows * cols / g).max(1);
                let (pa, pb) = cut(&q.packed, cols / per_word, at / per_word);
                let (sa, sb) = cut(&q.scales, cols / g * size, at / g * size);
                let (ba, bb) = cut(&q.biases, cols / g * size, at / g * size);
                let part = |cols, packed, scales, biases| {
                    LinearWeight::Quantized(QuantizedMatrix {
                        spec: q.spec,
                        rows: q.rows,
                        cols,
                        packed,
                        scale_dtype: q.scale_dtype,
                        scales,
                        biases,
                    })
                };
                (part(at, pa, sa, ba), part(cols - at, pb, sb, bb))
            }
            LinearWeight::Dense(d) => {
                let (a, b) = cut(&d.data, cols, at);
                let part = |cols, data| {
                    LinearWeight::Dense(DenseMatrix {
                        rows: d.rows,
                        cols,
                        data,
                    })
                };
                (part(at, a), part(cols - at, b))
            }
        })
    }

    /// Whether [`LinearWeight::stack_rows`] keeps `parts` as they are: all dense, or all
    /// quantized with the same bits, group size and scale dtype.
    pub fn stack_losslessly(parts: &[&LinearWeight]) -> bool {
        match parts {
            [] => true,
            [LinearWeight::Dense(_), rest @ ..] => {
                rest.iter().all(|p| matches!(p, LinearWeight::Dense(_)))
            }
            [LinearWeight::Quantized(first), rest @ ..] => rest.iter().all(|p| {
                matches!(p, LinearWeight::Quantized(q)
                    if q.spec == first.spec && q.scale_dtype == first.scale_dtype)
            }),
        }
    }

    /// `[parts[0]; parts[1]; ...]`: one weight whose output is the parts' outputs side by
    /// side, so one matmul replaces several. Parts quantized alike stay quantized;
    /// otherwise every part is dequantized to f32 (see [`LinearWeight::stack_losslessly`]).
    /// Errors: parts with different input widths, named by `name`.
    pub fn stack_rows(name: &str, parts: Vec<LinearWeight>) -> Result<LinearWeight> {
        let cols = parts.first().map_or(0, |p| p.shape().1);
        if let Some(p) = parts.iter().find(|p| p.shape().1 != cols) {
            return Err(Error::bad_tensor(
                name,
                format!("input width {} differs from {cols}", p.shape().1),
            ));
        }
        let rows = parts.iter().map(|p| p.shape().0).sum();
        let refs: Vec<&LinearWeight> = parts.iter().collect();
        let quantized = Self::stack_losslessly(&refs)
            && matches!(parts.first(), Some(LinearWeight::Quantized(_)));
        let mut parts = parts.into_iter();
        if !quantized {
            let mut data = Vec::with_capacity(rows * cols);
            for p in parts {
                match p {
                    LinearWeight::Dense(d) => data.extend(d.data),
                    q => data.extend(q.to_dense().data),
                }
            }
            return Ok(LinearWeight::Dense(DenseMatrix { rows, cols, data }));
        }
        let Some(LinearWeight::Quantized(mut stacked)) = parts.next() else {
            unreachable!("checked: the first part is quantized")
        };
        for p in parts {
            let LinearWeight::Quantized(q) = p else {
                unreachable!("checked: every part is quantized alike")
            };
            stacked.rows += q.rows;
            stacked.packed.extend(q.packed);
            stacked.scales.extend(q.scales);
            stacked.biases.extend(q.biases);
        }
        Ok(LinearWeight::Quantized(stacked))
    }

    /// The weight dequantized to f32 (a copy for a dense one).
    pub fn to_dense(&self) -> DenseMatrix {
        match self {
            LinearWeight::Dense(d) => d.clone(),
            LinearWeight::Quantized(q) => {
                let view = q.view();
                let mut data = vec![0.0; q.rows * q.cols];
                for (r, row) in data.chunks_exact_mut(q.cols.max(1)).enumerate() {
                    dequantize_row(&view, r, row);
                }
                DenseMatrix {
                    rows: q.rows,
                    cols: q.cols,
                    data,
                }
            }
        }
    }
}

impl Checkpoint {
    /// How module `module` (its full name, e.g. `language_model.model.layers.0.mlp.gate`)
    /// of logical shape `lead ++ [out, inp]` is stored: `None` unquantized.
    ///
    /// The config's override for the module decides when there is one (found with or
    /// without the family's prefix, [`crate::config::ModelConfig::quant_override`]).
    /// Without one the module is quantized iff `<module>.scales` exists (mlx-lm
    /// `load_model`), and bits and group size are those that explain the stored shapes
    /// (`.weight` `lead ++ [out, inp * bits / 32]`, `.scales` `lead ++ [out, inp /
    /// group_size]`): the config's global pair when it does, else the one supported pair
    /// that does ([`QuantSpec::explaining`]).
    /// Errors: a missing `.weight`; shapes that no supported pair explains, naming the
    /// tensor that differs from what the global pair expects (the weight, else the
    /// scales), both stored shapes and the expected one.
    pub fn quant_spec(
        &self,
        module: &str,
        lead: &[usize],
        out: usize,
        inp: usize,
    ) -> Result<Option<QuantSpec>> {
        if let Some(spec) = self.config.quant_override(module) {
            return Ok(spec);
        }
        let Ok(scales) = self.tensor(&format!("{module}.scales")) else {
            return Ok(None);
        };
        let weight = self.tensor(&format!("{module}.weight"))?;
        let rows = [lead, &[out]].concat();
        let widths = |t: &super::TensorEntry| match t.shape.split_last() {
            Some((&last, rest)) if rest == rows => Some(last),
            _ => None,
        };
        let global = self.config.quantization.default;
        let spec = match (widths(weight), widths(scales)) {
            (Some(packed), Some(groups)) => QuantSpec::explaining(inp, packed, groups, global),
            _ => None,
        };
        if let Some(spec) = spec {
            if Some(spec) != global {
                tracing::debug!(
                    module,
                    ?spec,
                    "quantization inferred from the stored shapes"
                );
            }
            return Ok(Some(spec));
        }
        let shape = |width: usize| [&rows[..], &[width]].concat();
        let (culprit, want) = match global {
            Some(g) if weight.shape != shape(inp / g.per_word()) => (
                weight,
                format!(
                    ", expected {:?} ({}-bit)",
                    shape(inp / g.per_word()),
                    g.bits
                ),
            ),
            Some(g) => (
                scales,
                format!(
                    ", expected {:?} (group size {})",
                    shape(inp / g.group_size),
                    g.group_size
                ),
            ),
            None => (weight, String::new()),
        };
        Err(Error::bad_tensor(
            &culprit.name,
            format!(
                "shape {:?}{want}: no override in config.json, and no supported quantization \
                 (4 or 8 bits, group size 32, 64 or 128) explains `{}` {:?} with `{}` {:?} for \
                 an input of {inp}",
                culprit.shape, weight.name, weight.shape, scales.name, scales.shape
            ),
        ))
    }

    /// The weight of module `module` (e.g. `model.layers.0.mlp.gate`), expected to be
    /// `[out, in]` after dequantization, quantized as [`Checkpoint::quant_spec`] finds.
    /// Errors: missing tensors, wrong dtypes or shapes, scales/biases disagreeing.
    pub fn linear(&self, module: &str, out: usize, inp: usize) -> Result<LinearWeight> {
        let weight_name = format!("{module}.weight");
        let Some(spec) = self.quant_spec(module, &[], out, inp)? else {
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
        if !inp.is_multiple_of(spec.group_size) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    fn quantized(rows: usize, cols: usize, bits: u32, dtype: Dtype) -> LinearWeight {
        let mut rng = rand::rng();
        let spec = QuantSpec {
            bits,
            group_size: 32,
        };
        let groups = rows * cols / 32;
        let floats = |rng: &mut rand::rngs::ThreadRng, lo: f32, hi: f32| -> Vec<u8> {
            (0..groups)
                .flat_map(|_| {
                    let v = rng.random_range(lo..hi);
                    match dtype {
                        Dtype::F32 => v.to_le_bytes().to_vec(),
                        _ => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                    }
                })
                .collect()
        };
        LinearWeight::Quantized(QuantizedMatrix {
            spec,
            rows,
            cols,
            packed: (0..rows * cols / spec.per_word())
                .map(|_| rng.random())
                .collect(),
            scale_dtype: dtype,
            scales: floats(&mut rng, 0.01, 0.1),
            biases: floats(&mut rng, -0.5, 0.5),
        })
    }

    fn rows_of(d: &DenseMatrix, rows: &[usize]) -> Vec<f32> {
        rows.iter()
            .flat_map(|&r| d.data[r * d.cols..(r + 1) * d.cols].to_vec())
            .collect()
    }

    #[test]
    fn selected_rows_dequantize_to_the_same_rows() {
        let mut rng = rand::rng();
        for w in [
            quantized(40, 64, 4, Dtype::BF16),
            quantized(40, 64, 8, Dtype::F32),
        ] {
            let rows: Vec<usize> = (0..25).map(|_| rng.random_range(0..40)).collect();
            let picked = w.select_rows(&rows);
            assert!(matches!(picked, LinearWeight::Quantized(_)));
            assert_eq!(picked.shape(), (25, 64));
            assert_eq!(picked.to_dense().data, rows_of(&w.to_dense(), &rows));
        }
    }

    #[test]
    fn stacked_rows_are_the_parts_in_order() {
        let (a, b) = (
            quantized(6, 64, 4, Dtype::BF16),
            quantized(10, 64, 4, Dtype::BF16),
        );
        let want: Vec<f32> = [a.to_dense().data, b.to_dense().data].concat();
        assert!(LinearWeight::stack_losslessly(&[&a, &b]));
        let same = LinearWeight::stack_rows("ab", vec![a.clone(), b.clone()]).unwrap();
        assert!(matches!(same, LinearWeight::Quantized(_)));
        assert_eq!(same.shape(), (16, 64));
        assert_eq!(same.to_dense().data, want);
        // Mixed quantization, or a dense part: dequantized.
        let c = quantized(3, 64, 8, Dtype::F32);
        let d = LinearWeight::Dense(c.to_dense());
        assert!(!LinearWeight::stack_losslessly(&[&a, &b, &c, &d]));
        let parts = vec![a.clone(), b, c.clone(), d];
        let mixed = LinearWeight::stack_rows("abcd", parts).unwrap();
        assert!(matches!(mixed, LinearWeight::Dense(_)));
        let c = c.to_dense().data;
        assert_eq!(mixed.to_dense().data, [want, c.clone(), c].concat());
        // Different input widths: an error naming the weight.
        let narrow = quantized(2, 32, 4, Dtype::BF16);
        let err = LinearWeight::stack_rows("in_proj_a", vec![a, narrow]).unwrap_err();
        assert!(err.to_string().contains("in_proj_a"), "{err}");
    }

    /// Each half of a split dequantizes to its columns of the whole (4 and 8 bits, bf16
    /// and f32 scales, and dense); a split off a group boundary is refused by name.
    #[test]
    fn split_columns_are_the_columns_of_the_whole() {
        for w in [
            quantized(5, 128, 4, Dtype::BF16),
            quantized(7, 96, 8, Dtype::F32),
        ] {
            let at = 64;
            let cols = w.shape().1;
            let dense = LinearWeight::Dense(w.to_dense());
            for whole in [&w, &dense] {
                let (a, b) = whole.split_columns("fc", at).unwrap();
                let (rows, full) = (w.shape().0, w.to_dense().data);
                let want_a: Vec<f32> = (0..rows)
                    .flat_map(|r| full[r * cols..r * cols + at].to_vec())
                    .collect();
                let want_b: Vec<f32> = (0..rows)
                    .flat_map(|r| full[r * cols + at..(r + 1) * cols].to_vec())
                    .collect();
                assert_eq!(a.to_dense().data, want_a);
                assert_eq!(b.to_dense().data, want_b);
                assert_eq!((a.shape(), b.shape()), ((rows, at), (rows, cols - at)));
            }
        }
        let err = quantized(2, 128, 4, Dtype::BF16)
            .split_columns("mtp.fc", 48)
            .unwrap_err();
        assert!(err.to_string().contains("mtp.fc"), "{err}");
    }
}
