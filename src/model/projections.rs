//! Projections of one input that share a matmul when they can (every block's input
//! projections use it).

use crate::backend::Backend;
use crate::checkpoint::LinearWeight;
use crate::error::Result;

/// Projections of one input, stacked into one weight at load when they are quantized
/// alike ([`LinearWeight::stack_losslessly`]), so that a step runs one matmul whose output
/// the backend splits ([`Backend::matmul_parts`]); otherwise (dense, or quantized
/// differently) kept apart as stored.
pub(super) struct Projections<B: Backend, const N: usize> {
    /// The stacked weight, or one weight per projection.
    weights: Vec<B::Weight>,
    /// Each projection's output width.
    widths: [usize; N],
}

impl<B: Backend, const N: usize> Projections<B, N> {
    /// `parts` as (module name, weight); `upload` puts a weight on the backend, naming
    /// the module in its errors (the first part's for the stacked weight).
    pub(super) fn new(
        parts: [(String, LinearWeight); N],
        upload: impl Fn(&str, LinearWeight) -> Result<B::Weight>,
    ) -> Result<Self> {
        let widths = parts.each_ref().map(|(_, w)| w.shape().0);
        let refs: Vec<&LinearWeight> = parts.iter().map(|(_, w)| w).collect();
        // Dense parts stay apart: only quantized weights have the one-dispatch path.
        let quantized = refs.iter().all(|w| matches!(w, LinearWeight::Quantized(_)));
        let weights = if N > 1 && quantized && LinearWeight::stack_losslessly(&refs) {
            let name = parts[0].0.clone();
            let stacked = LinearWeight::stack_rows(&name, parts.map(|(_, w)| w).into())?;
            vec![upload(&name, stacked)?]
        } else {
            parts
                .into_iter()
                .map(|(name, w)| upload(&name, w))
                .collect::<Result<_>>()?
        };
        Ok(Projections { weights, widths })
    }

    /// The first projection of `x` alone (with the others, which cost nothing more, when
    /// they are stacked).
    pub(super) fn first(&self, backend: &B, x: &B::Tensor) -> B::Tensor {
        match self.weights.as_slice() {
            [w] if N > 1 => backend.matmul_parts(x, w, &self.widths).swap_remove(0),
            ws => backend.matmul(x, &ws[0]),
        }
    }

    /// Each projection of `x`, in order.
    pub(super) fn apply(&self, backend: &B, x: &B::Tensor) -> [B::Tensor; N] {
        let out = match self.weights.as_slice() {
            [w] if N > 1 => backend.matmul_parts(x, w, &self.widths),
            ws => ws.iter().map(|w| backend.matmul(x, w)).collect(),
        };
        out.try_into()
            .unwrap_or_else(|v: Vec<_>| panic!("{} outputs for {N} projections", v.len()))
    }
}
