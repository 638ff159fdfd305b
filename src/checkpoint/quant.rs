//! MLX affine dequantization on the CPU (mlx `affine_dequantize`, ../shared/spec/models.md §3).

use safetensors::Dtype;

use crate::config::QuantSpec;

/// Little-endian floats of one dtype, read in place from bytes of any alignment
/// (record pieces in a slot, or widened f32 copies).
#[derive(Clone, Copy, Debug)]
pub struct Floats<'a> {
    pub dtype: Dtype,
    pub bytes: &'a [u8],
}

impl<'a> Floats<'a> {
    /// Wraps f32 values.
    pub fn f32(values: &'a [f32]) -> Self {
        Floats {
            dtype: Dtype::F32,
            bytes: bytemuck::cast_slice(values),
        }
    }

    /// Element `i` widened to f32 (F32, F16 or BF16; other dtypes read as 0 and are
    /// rejected when a checkpoint is opened).
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self.dtype {
            Dtype::F32 => {
                let b = &self.bytes[4 * i..4 * i + 4];
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
            Dtype::BF16 => {
                half::bf16::from_le_bytes([self.bytes[2 * i], self.bytes[2 * i + 1]]).to_f32()
            }
            Dtype::F16 => {
                half::f16::from_le_bytes([self.bytes[2 * i], self.bytes[2 * i + 1]]).to_f32()
            }
            _ => 0.0,
        }
    }

    /// Elements `start .. start + out.len()` widened to f32 into `out`, as [`Floats::get`]
    /// reads them one at a time (the dtype is matched once, not per element).
    pub fn read_into(&self, start: usize, out: &mut [f32]) {
        let width = match self.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            _ => return out.fill(0.0),
        };
        let bytes = &self.bytes[width * start..width * (start + out.len())];
        match self.dtype {
            Dtype::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            // bf16 is the top half of an f32.
            Dtype::BF16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                }
            }
            _ => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }
}

/// A borrowed quantized matrix `[rows, cols]`: packed words as bytes, scales and biases
/// `[rows, cols / group_size]`.
#[derive(Clone, Copy, Debug)]
pub struct QuantView<'a> {
    pub spec: QuantSpec,
    pub rows: usize,
    pub cols: usize,
    pub packed: &'a [u8],
    pub scales: Floats<'a>,
    pub biases: Floats<'a>,
}

/// Dequantizes row `r` of `m` into `out` (`out.len() == m.cols`):
/// `out[c] = scale[r, c/g] * q[r, c] + bias[r, c/g]`, values packed LSB first.
pub fn dequantize_row(m: &QuantView<'_>, r: usize, out: &mut [f32]) {
    let bits = m.spec.bits as usize;
    let per_word = m.spec.per_word();
    let gs = m.spec.group_size;
    let groups = m.cols / gs;
    let row_bytes = m.cols / per_word * 4;
    let row = &m.packed[r * row_bytes..(r + 1) * row_bytes];
    let mask = (1u32 << bits) - 1;
    let words_per_group = gs / per_word;
    for g in 0..groups {
        let s = m.scales.get(r * groups + g);
        let b = m.biases.get(r * groups + g);
        let out_g = &mut out[g * gs..(g + 1) * gs];
        let words = &row[g * words_per_group * 4..(g + 1) * words_per_group * 4];
        for (w, out_w) in words.chunks_exact(4).zip(out_g.chunks_exact_mut(per_word)) {
            let word = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            for (j, o) in out_w.iter_mut().enumerate() {
                let q = (word >> (bits * j)) & mask;
                *o = s * q as f32 + b;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dequantizes_lsb_first_4_and_8_bit() {
        // Row of 64 values, one group: q[c] = c % 16 (4-bit) / c (8-bit).
        for bits in [4u32, 8] {
            let spec = QuantSpec {
                bits,
                group_size: 64,
            };
            let per_word = spec.per_word();
            let q: Vec<u32> = (0..64u32).map(|c| c % (1 << bits)).collect();
            let words: Vec<u32> = q
                .chunks(per_word)
                .map(|ch| {
                    ch.iter()
                        .enumerate()
                        .fold(0u32, |w, (j, &v)| w | (v << (bits as usize * j)))
                })
                .collect();
            let scales = [0.5f32];
            let biases = [-1.0f32];
            let m = QuantView {
                spec,
                rows: 1,
                cols: 64,
                packed: bytemuck::cast_slice(&words),
                scales: Floats::f32(&scales),
                biases: Floats::f32(&biases),
            };
            let mut out = vec![0.0; 64];
            dequantize_row(&m, 0, &mut out);
            for c in 0..64 {
                assert_eq!(out[c], 0.5 * q[c] as f32 - 1.0, "bits {bits} col {c}");
            }
        }
    }
}
