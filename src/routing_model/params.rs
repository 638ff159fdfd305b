//! The routing model's parameters and their file ([`ROUTING_FILE`]): the calibrated
//! defaults, loading with range checks, and writing.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::atomic_file::AtomicFile;
use crate::error::RoutingModelError;

/// The routing model's file in a model directory.
pub const ROUTING_FILE: &str = "synthetic_routing.json";

/// The format version this build reads and writes.
pub const VERSION: u32 = 1;

/// The parameters of a routing model, as stored in [`ROUTING_FILE`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingParams {
    /// Format version ([`VERSION`]).
    pub version: u32,
    /// Seeds every draw: active sets, ranks, noise.
    pub seed: u64,
    /// Share of each layer's experts that the layer routes to at all, in `(0, 1]`.
    pub active_fraction: f64,
    /// Zipf exponent of the static popularity over a layer's active experts, `>= 0`
    /// (0: no static preference).
    pub zipf_exponent: f64,
    /// Zipf's law holds over the first `head_fraction * num_experts` ranks; later active
    /// ranks all get the last head rank's static score (a flat tail). In `(0, 1]`.
    pub head_fraction: f64,
    /// Share of the score's noise variance that is the slowly varying context (the rest
    /// is fresh at every token), in `[0, 1]`.
    pub context_weight: f64,
    /// Token-to-token correlation of the context, in `[0, 1)`.
    pub context_correlation: f64,
    /// Probability that each id of a lookahead forecast is one the layer will route to,
    /// in `[0, 1]` (an assumption; see the module docs).
    pub forecast_accuracy: f64,
}

impl RoutingParams {
    /// The calibrated defaults (fitted with `slotstream routing-calibration`; see the
    /// `TARGETS` of `slotstream::tools::cachesim`). Every size is a fraction of a layer's
    /// experts, so the same values serve every preset: the 512-expert ones they were
    /// fitted on, and the demo's 64 experts a layer, which give the same shape at a
    /// smaller scale (its figures at pools scaled to its size are in BENCHMARKS.md).
    pub fn calibrated() -> RoutingParams {
        RoutingParams {
            version: VERSION,
            seed: DEFAULT_SEED,
            active_fraction: 0.42,
            zipf_exponent: 0.69,
            head_fraction: 0.11,
            context_weight: 0.44,
            context_correlation: 0.86,
            forecast_accuracy: DEFAULT_FORECAST_ACCURACY,
        }
    }

    /// Reads and checks `path`. Errors: the file is unreadable, not JSON of this shape
    /// (unknown fields are refused, so a misspelt one is not silently ignored), of another
    /// version, or a field is out of range.
    pub fn load(path: &Path) -> Result<RoutingParams, RoutingModelError> {
        let text = std::fs::read_to_string(path).map_err(|io| RoutingModelError::Io {
            path: path.to_path_buf(),
            io,
        })?;
        let params: RoutingParams =
            serde_json::from_str(&text).map_err(|e| RoutingModelError::Malformed {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        params.check(path)?;
        Ok(params)
    }

    /// Checks every field's range; `path` names the file in errors.
    pub fn check(&self, path: &Path) -> Result<(), RoutingModelError> {
        let bad = |field: &'static str, message: String| RoutingModelError::Field {
            path: path.to_path_buf(),
            field,
            message,
        };
        if self.version != VERSION {
            return Err(bad(
                "version",
                format!(
                    "{} is not supported (this build reads {VERSION})",
                    self.version
                ),
            ));
        }
        // (field, value, 0 excluded, upper bound, upper bound excluded)
        let ranges: [(&'static str, f64, bool, f64, bool); 6] = [
            ("active_fraction", self.active_fraction, true, 1.0, false),
            (
                "zipf_exponent",
                self.zipf_exponent,
                false,
                f64::INFINITY,
                true,
            ),
            ("head_fraction", self.head_fraction, true, 1.0, false),
            ("context_weight", self.context_weight, false, 1.0, false),
            (
                "context_correlation",
                self.context_correlation,
                false,
                1.0,
                true,
            ),
            (
                "forecast_accuracy",
                self.forecast_accuracy,
                false,
                1.0,
                false,
            ),
        ];
        for (field, v, low_open, high, high_open) in ranges {
            let above = if low_open { v > 0.0 } else { v >= 0.0 };
            let below = if high_open { v < high } else { v <= high };
            if !(v.is_finite() && above && below) {
                let low = if low_open { "(0" } else { "[0" };
                let high = match (high.is_finite(), high_open) {
                    (false, _) => "inf)".to_string(),
                    (true, true) => format!("{high})"),
                    (true, false) => format!("{high}]"),
                };
                return Err(bad(field, format!("{v} is outside {low}, {high}")));
            }
        }
        Ok(())
    }

    /// Writes the parameters to `dir`/[`ROUTING_FILE`] (atomically).
    pub fn write(&self, dir: &Path) -> crate::Result<()> {
        let path = dir.join(ROUTING_FILE);
        let out = AtomicFile::create(&path)?;
        serde_json::to_writer_pretty(out.file(), self).map_err(|e| crate::Error::Json {
            path: path.clone(),
            message: e.to_string(),
        })?;
        out.commit()
    }
}

/// Seed of the presets' routing models.
pub const DEFAULT_SEED: u64 = 0x5107_0001;

/// Assumed share of a lookahead forecast's ids that are right (see the module docs).
pub const DEFAULT_FORECAST_ACCURACY: f64 = 0.8;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_fields_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(ROUTING_FILE);
        let mut p = RoutingParams::calibrated();
        p.context_correlation = 1.0;
        std::fs::write(&path, serde_json::to_string(&p).unwrap()).unwrap();
        let e = RoutingParams::load(&path).unwrap_err().to_string();
        assert!(
            e.contains(ROUTING_FILE) && e.contains("context_correlation"),
            "{e}"
        );
        std::fs::write(&path, r#"{"version": 1, "seed": 1, "active_fraction": 0.5, "zipf_exponent": 0.5, "head_fraction": 0.1, "context_weight": 0.5, "context_correlation": 0.5, "forecast_accuracy": 0.8, "stickiness": 1}"#).unwrap();
        let e = RoutingParams::load(&path).unwrap_err().to_string();
        assert!(e.contains(ROUTING_FILE) && e.contains("stickiness"), "{e}");
        std::fs::write(&path, "{").unwrap();
        let e = RoutingParams::load(&path).unwrap_err().to_string();
        assert!(e.contains(ROUTING_FILE), "{e}");
    }
}
