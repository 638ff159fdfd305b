//! The config's MLX quantization block: the global spec and per-module overrides.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

use super::fields::Fields;

/// MLX affine quantization parameters of one module: `w = scale * q + bias` per group
/// of `group_size` consecutive input elements (mlx `affine_dequantize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    /// Bits per weight: 4 or 8.
    pub bits: u32,
    /// Input elements sharing one scale and bias: 32, 64 or 128.
    pub group_size: usize,
}

impl QuantSpec {
    /// Builds a spec, rejecting bit widths and group sizes the kernels do not implement.
    pub fn new(bits: usize, group_size: usize, path: &Path, field: &str) -> Result<Self> {
        if !matches!(bits, 4 | 8) {
            return Err(Error::Config {
                path: path.to_path_buf(),
                field: field.to_string(),
                message: format!("{bits}-bit quantization is not supported (supported: 4, 8)"),
            });
        }
        if !matches!(group_size, 32 | 64 | 128) {
            return Err(Error::Config {
                path: path.to_path_buf(),
                field: field.to_string(),
                message: format!(
                    "group size {group_size} is not supported (supported: 32, 64, 128)"
                ),
            });
        }
        Ok(QuantSpec {
            bits: bits as u32,
            group_size,
        })
    }

    /// Quantized values per packed `u32` word.
    pub fn per_word(&self) -> usize {
        32 / self.bits as usize
    }

    /// The supported spec that explains a quantized weight's stored widths for an input
    /// of `inp` elements: `packed` words per row (`.weight` is `[out, inp * bits / 32]`
    /// u32) and `groups` per row (`.scales` is `[out, inp / group_size]`). `preferred`
    /// (the config's global spec) wins when it fits; otherwise the one supported pair
    /// that does. `None` when none fits.
    ///
    /// With `inp` known the pair is unique (`bits = 32 * packed / inp`, `group_size =
    /// inp / groups`); from the two widths alone it is not: 4-bit group 64 and 8-bit
    /// group 32 (or 4-bit group 128 and 8-bit group 64) store the same widths.
    pub fn explaining(
        inp: usize,
        packed: usize,
        groups: usize,
        preferred: Option<QuantSpec>,
    ) -> Option<QuantSpec> {
        let fits =
            |s: &QuantSpec| inp > 0 && inp == packed * s.per_word() && inp == groups * s.group_size;
        if let Some(p) = preferred.filter(fits) {
            return Some(p);
        }
        let mut fitting = [4, 8]
            .into_iter()
            .flat_map(|bits| [32, 64, 128].map(|group_size| QuantSpec { bits, group_size }))
            .filter(fits);
        match (fitting.next(), fitting.next()) {
            (Some(s), None) => Some(s),
            _ => None,
        }
    }
}

/// How a module is stored, according to the config's `quantization` block.
#[derive(Clone, Debug, Default)]
pub struct Quantization {
    /// Global parameters (`group_size`, `bits`); `None` for an unquantized checkpoint.
    pub default: Option<QuantSpec>,
    /// Per-module overrides keyed by module path (`model.layers.0.mlp.gate`);
    /// `None` means the module is explicitly left unquantized.
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl Quantization {
    /// The config entry of module `path` exactly as keyed: `Some(Some(spec))` quantized,
    /// `Some(None)` left unquantized, `None` no entry (see
    /// [`ModelConfig::quant_override`](super::ModelConfig::quant_override), which also
    /// tries the name without the prefix).
    pub fn for_module(&self, path: &str) -> Option<Option<QuantSpec>> {
        self.overrides.get(path).copied()
    }
}

/// Reads the `quantization` block of `f` (none: an unquantized checkpoint). Errors: a
/// mode other than affine, missing or unsupported bits or group sizes.
pub(super) fn parse_quantization(f: &Fields<'_>) -> Result<Quantization> {
    let Some(q) = f.get("quantization") else {
        return Ok(Quantization::default());
    };
    let Some(obj) = q.as_object() else {
        return Err(f.err("quantization", format!("expected an object, found {q}")));
    };
    let qf = Fields { obj, path: f.path };
    if let Some(mode) = qf.get("mode") {
        if mode.as_str() != Some("affine") {
            return Err(f.err(
                "quantization.mode",
                format!("{mode} is not supported (supported: \"affine\")"),
            ));
        }
    }
    let bits = qf
        .usize("bits")
        .map_err(|_| f.err("quantization.bits", "missing or not an integer"))?;
    let group = qf
        .usize("group_size")
        .map_err(|_| f.err("quantization.group_size", "missing or not an integer"))?;
    let default = QuantSpec::new(bits, group, f.path, "quantization")?;
    let mut overrides = BTreeMap::new();
    for (key, value) in obj {
        let field = format!("quantization.{key}");
        match value {
            Value::Object(m) => {
                let mf = Fields {
                    obj: m,
                    path: f.path,
                };
                let bits = mf
                    .usize_or("bits", Some(default.bits as usize))
                    .map_err(|_| f.err(&field, "bad bits"))?;
                let group = mf
                    .usize_or("group_size", Some(default.group_size))
                    .map_err(|_| f.err(&field, "bad group_size"))?;
                overrides.insert(
                    key.clone(),
                    Some(QuantSpec::new(bits, group, f.path, &field)?),
                );
            }
            Value::Bool(false) => {
                overrides.insert(key.clone(), None);
            }
            _ => {}
        }
    }
    Ok(Quantization {
        default: Some(default),
        overrides,
    })
}
