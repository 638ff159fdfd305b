//! The one way tests compare an output (`got`, from the backend under test) with a
//! reference (`want`, from the CPU backend or a fixture): a norm-wise error against a
//! bound, measured either relative to `want` itself ([`assert_rel`]) or relative to an
//! element-wise scale of the rounding error ([`assert_scaled`]), because a sum that
//! cancels to near zero has a rounding error far larger than itself; or each element
//! against its own bound ([`assert_elementwise`]) where every element's rounding is known.
//! The norms are summed in f64 so the comparison adds no rounding of its own at these
//! sizes.
//!
//! Every asserting function first requires equal lengths and every `got` element finite:
//! GPU outputs start NaN-filled, so an element a kernel forgets to write fails here, named
//! by its index, whatever the bound.

/// The denominator's floor: an all-zero reference then gives an error of 0 for an exact
/// match (rather than NaN) and a huge one for anything else.
const FLOOR: f64 = 1e-30;

/// `||got - want|| / ||want||` (Euclidean norms, `||want||` floored at 1e-30): the
/// norm-wise relative error, for tests that track or threshold it themselves.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    scaled_err(got, want, want)
}

/// `||got - want|| / ||scale||`, `||scale||` floored at 1e-30.
fn scaled_err(got: &[f32], want: &[f32], scale: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "test bug: lengths of got and want");
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
        .sum();
    let norm: f64 = scale.iter().map(|&s| (s as f64).powi(2)).sum();
    diff.sqrt() / norm.sqrt().max(FLOOR)
}

/// Panics, naming `what` and the first offending element, unless `got` and `want` have
/// the same length and every `got` element is finite.
fn assert_finite(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!(
            "{what}: element {i} of {} is {} (an output element left unwritten?)",
            got.len(),
            got[i]
        );
    }
}

/// Asserts `||got - want|| / ||want|| <= bound` ([`rel_err`]) after the length and
/// finiteness checks, and returns the error. A failure prints `what`, the error and the
/// bound.
pub fn assert_rel(what: &str, got: &[f32], want: &[f32], bound: f64) -> f64 {
    assert_finite(what, got, want);
    let e = rel_err(got, want);
    assert!(e <= bound, "{what}: relative error {e:.3e} above {bound:e}");
    e
}

/// Asserts `||got - want|| / ||scale|| <= bound` after the length and finiteness checks,
/// and returns the error. `scale[i]` is the size of the rounding error `got[i]` may carry
/// (for a dot product `sum_j |W[i, j]| |x[j]|`, which [`abs_products`] gives; `of` names
/// it in the message), so the bound holds when an output cancels to near zero. An exact
/// match passes whatever the scale (a SwiGLU whose outputs all sit at SiLU's flat end has
/// a zero one). A failure prints `what`, the error, `of` and the bound, and the worst
/// element by `|got[i] - want[i]| / scale[i]` with its values, to show where it lies.
pub fn assert_scaled(
    what: &str,
    got: &[f32],
    want: &[f32],
    scale: &[f32],
    of: &str,
    bound: f64,
) -> f64 {
    assert_finite(what, got, want);
    assert_eq!(scale.len(), want.len(), "{what}: length of {of}");
    let e = scaled_err(got, want, scale);
    if e > bound {
        let ratio = |i: usize| (got[i] as f64 - want[i] as f64).abs() / scale[i] as f64;
        let worst = (0..got.len())
            .max_by(|&i, &j| ratio(i).total_cmp(&ratio(j)))
            .expect("a nonzero error has an element");
        panic!(
            "{what}: error {e:.3e} of {of} above {bound:e}; worst element {worst}: {} \
             against {} ({of} {})",
            got[worst], want[worst], scale[worst]
        );
    }
    e
}

/// Asserts `|got[i] - want[i]| <= bound * scale[i]` for every element, after the length
/// and finiteness checks: the element-wise form of [`assert_scaled`], for outputs each of
/// whose rounding is known (`scale[i]`, named by `of`). Computed in f32, as the values
/// are. A failure prints `what`, the worst element by `|got[i] - want[i]| / scale[i]`,
/// its values and its scale, and how many elements are over.
pub fn assert_elementwise(
    what: &str,
    got: &[f32],
    want: &[f32],
    scale: &[f32],
    of: &str,
    bound: f32,
) {
    assert_finite(what, got, want);
    assert_eq!(scale.len(), want.len(), "{what}: length of {of}");
    // Not `>`: a NaN in `want` or `scale` (unordered) fails too.
    let over = |i: &usize| {
        !matches!(
            (got[*i] - want[*i]).abs().partial_cmp(&(bound * scale[*i])),
            Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
        )
    };
    let count = (0..got.len()).filter(over).count();
    if count > 0 {
        let ratio = |i: usize| (got[i] - want[i]).abs() / scale[i];
        let worst = (0..got.len())
            .filter(over)
            .max_by(|&i, &j| ratio(i).total_cmp(&ratio(j)))
            .expect("count > 0");
        panic!(
            "{what}: {count} of {} elements off by more than {bound:e} of {of}; worst \
             element {worst}: {} against {} ({of} {})",
            got.len(),
            got[worst],
            want[worst],
            scale[worst]
        );
    }
}

/// `sum_c |W[r, c]| |x[t, c]|` for every output of `x W^T` with `x: [t, cols]`, W
/// dequantized by `cpu` through its embedding rows: the scale of a dot product's rounding
/// error, for [`assert_scaled`]. One row of 128 random terms can sum to near zero, and
/// then `||got - want|| / ||want||` measures the cancellation, not the kernel (CI saw 1e-3
/// on a 1x128 output).
pub fn abs_products(
    cpu: &slotstream::backend::cpu::CpuBackend,
    w: &slotstream::checkpoint::LinearWeight,
    x: &[f32],
    t: usize,
) -> Vec<f32> {
    use slotstream::backend::Backend;
    let (rows, cols) = w.shape();
    let ids: Vec<u32> = (0..rows as u32).collect();
    let dense = cpu.embed(w, &ids).unwrap().data;
    assert_eq!(x.len(), t * cols, "test bug: x is not [t, cols]");
    let mut out = Vec::with_capacity(t * rows);
    for xt in x.chunks_exact(cols) {
        for row in dense.chunks_exact(cols) {
            out.push(row.iter().zip(xt).map(|(w, x)| (w * x).abs()).sum());
        }
    }
    out
}

/// The worst per-position relative error ([`rel_err`]) of `logits` (`[positions, vocab]`,
/// teacher forced on `r.scored_ids`) against the reference's; panics, naming `what` and
/// the position, where one is above 1e-3.
pub fn worst_logit_error(what: &str, logits: &[f32], r: &super::Reference) -> f64 {
    let mut worst = 0.0f64;
    for t in 0..r.scored_ids.len() {
        let row = t * r.vocab..(t + 1) * r.vocab;
        let e = assert_rel(
            &format!("{what}: position {t}: logits"),
            &logits[row.clone()],
            &r.logits[row],
            1e-3,
        );
        worst = worst.max(e);
    }
    worst
}
