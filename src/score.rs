//! Teacher-forced scoring: log-likelihood and perplexity of a token sequence.

use std::path::Path;

use crate::atomic_file::AtomicFile;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::{Logits, Model};
use crate::records::ExpertSource;

/// Result of scoring `tokens` ids.
#[derive(Clone, Debug)]
pub struct Score {
    /// Number of ids scored (including the first, which has no prediction).
    pub tokens: usize,
    /// Mean negative log-likelihood in nats of ids `1..n` given their prefixes.
    pub mean_nll: f64,
    /// `exp(mean_nll)`.
    pub perplexity: f64,
    /// Row-major logits `[tokens, vocab]`.
    pub logits: Vec<f32>,
    pub vocab: usize,
}

/// Runs `ids` through a fresh sequence of `model` in one forward pass and scores each
/// next token: `nll_i = logsumexp(logits_i) - logits_i[ids_{i+1}]`, in f64.
/// Errors: fewer than two ids, or any forward-pass error.
pub fn score<B: Backend, E: ExpertSource>(
    model: &Model<B>,
    backend: &B,
    experts: &E,
    ids: &[u32],
) -> Result<Score> {
    if ids.len() < 2 {
        return Err(Error::InvalidInput(
            "scoring needs at least two tokens".into(),
        ));
    }
    let mut state = model.new_state(backend);
    let logits = model.forward(backend, &mut state, ids, experts, Logits::All);
    // A prefill with nothing after it: the source frees what it kept for it.
    experts.end_prefill(false);
    let logits = logits?;
    let vocab = model.config.vocab_size;
    let total: f64 = (0..ids.len() - 1)
        .map(|i| {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            lse - row[ids[i + 1] as usize] as f64
        })
        .sum();
    let mean_nll = total / (ids.len() - 1) as f64;
    Ok(Score {
        tokens: ids.len(),
        mean_nll,
        perplexity: mean_nll.exp(),
        logits,
        vocab,
    })
}

/// Writes `[rows, cols]` f32 values as a `.npy` file. The file appears complete or not at
/// all: it is written under a temporary name in the same directory and renamed.
pub fn write_npy(path: &Path, data: &[f32], rows: usize, cols: usize) -> Result<()> {
    use npyz::WriterBuilder;
    let out = AtomicFile::create(path)?;
    {
        let mut writer = npyz::WriteOptions::new()
            .default_dtype()
            .shape(&[rows as u64, cols as u64])
            .writer(std::io::BufWriter::new(out.file()))
            .begin_nd()
            .map_err(|e| Error::io(path, e))?;
        writer
            .extend(data.iter().copied())
            .map_err(|e| Error::io(path, e))?;
        writer.finish().map_err(|e| Error::io(path, e))?;
    }
    out.commit()
}
