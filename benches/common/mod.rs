//! What the kernel benches share.

use rand::Rng;
use safetensors::Dtype;
use slotstream::checkpoint::QuantizedMatrix;
use slotstream::config::QuantSpec;

/// A `[rows, cols]` matrix of `bits`, group 64, bf16 scales and biases: random packed
/// integers (the kernels' speed does not depend on the values); every group has the same
/// scale (0.01) and bias (-0.05).
pub fn quantized(rows: usize, cols: usize, bits: u32) -> QuantizedMatrix {
    let mut rng = rand::rng();
    let spec = QuantSpec {
        bits,
        group_size: 64,
    };
    let groups = rows * cols / 64;
    let half = |v: f32| half::bf16::from_f32(v).to_le_bytes();
    QuantizedMatrix {
        spec,
        rows,
        cols,
        packed: (0..rows * cols * bits as usize / 32)
            .map(|_| rng.random())
            .collect(),
        scale_dtype: Dtype::BF16,
        scales: (0..groups).flat_map(|_| half(0.01)).collect(),
        biases: (0..groups).flat_map(|_| half(-0.05)).collect(),
    }
}

/// Bytes a matmul over `q` must read: packed weights, scales and biases.
pub fn bytes_of(q: &QuantizedMatrix) -> usize {
    q.packed.len() * 4 + q.scales.len() + q.biases.len()
}
