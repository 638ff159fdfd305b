//! Tensor writers: a safetensors file streamed tensor by tensor, and the deterministic
//! filler its weights are made of.

use std::io::Write;

use serde_json::json;

/// A safetensors file written tensor by tensor: the header (names, dtypes, shapes and
/// offsets) first, then each tensor's bytes in the declared order.
pub struct SafetensorsWriter<W: Write> {
    out: W,
}

impl<W: Write> SafetensorsWriter<W> {
    /// Writes the header for `tensors` (name, safetensors dtype string, shape, byte length),
    /// with `{"format": "mlx"}` metadata as mlx-lm writes it.
    pub fn new(mut out: W, tensors: &[(String, &str, Vec<usize>, u64)]) -> std::io::Result<Self> {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "mlx"}));
        let mut at = 0u64;
        for (name, dtype, shape, len) in tensors {
            header.insert(
                name.clone(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + len]}),
            );
            at += len;
        }
        let mut text = serde_json::to_vec(&header)?;
        // Pad with spaces so tensor data starts 8-byte aligned, as the format recommends.
        while (8 + text.len()) % 8 != 0 {
            text.push(b' ');
        }
        out.write_all(&(text.len() as u64).to_le_bytes())?;
        out.write_all(&text)?;
        Ok(SafetensorsWriter { out })
    }

    /// Streams `len` bytes of the next tensor from `fill`, called with chunks to fill.
    pub fn tensor(&mut self, len: u64, mut fill: impl FnMut(&mut [u8])) -> std::io::Result<()> {
        let mut buf = vec![0u8; 1 << 20];
        let mut left = len;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            fill(&mut buf[..n]);
            self.out.write_all(&buf[..n])?;
            left -= n as u64;
        }
        Ok(())
    }

    /// Flushes and returns the writer.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

/// A fast deterministic byte stream (xorshift64*), for filler weights.
pub struct Filler(u64);

impl Filler {
    pub fn new(seed: u64) -> Self {
        Filler(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    /// Uniform in `[-1, 1)`.
    pub(super) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Fills `buf` with little-endian bf16 values drawn from `value`.
pub(super) fn fill_bf16(buf: &mut [u8], mut value: impl FnMut() -> f32) {
    for ch in buf.chunks_mut(2) {
        let b = half::bf16::from_f32(value()).to_le_bytes();
        ch.copy_from_slice(&b[..ch.len()]);
    }
}
