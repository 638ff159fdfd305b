//! Reading a config's JSON fields with errors that name the file and the field.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// One JSON object of a config (the top level, `text_config`, a `rope_parameters` or a
/// quantization entry) with the file it came from; its readers treat `null` as absent.
pub(super) struct Fields<'a> {
    pub(super) obj: &'a Map<String, Value>,
    pub(super) path: &'a Path,
}

impl Fields<'_> {
    pub(super) fn err(&self, field: &str, message: impl Into<String>) -> Error {
        Error::Config {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            message: message.into(),
        }
    }

    pub(super) fn get(&self, field: &str) -> Option<&Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    pub(super) fn usize(&self, field: &str) -> Result<usize> {
        self.usize_or(field, None)
    }

    pub(super) fn usize_or(&self, field: &str, default: Option<usize>) -> Result<usize> {
        match self.get(field) {
            Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| {
                self.err(field, format!("expected a non-negative integer, found {v}"))
            }),
            None => default.ok_or_else(|| self.err(field, "missing")),
        }
    }

    pub(super) fn f64_or(&self, field: &str, default: Option<f64>) -> Result<f64> {
        match self.get(field) {
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(field, format!("expected a number, found {v}"))),
            None => default.ok_or_else(|| self.err(field, "missing")),
        }
    }

    pub(super) fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.get(field) {
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(field, format!("expected true or false, found {v}"))),
            None => Ok(default),
        }
    }

    pub(super) fn usize_list(&self, field: &str) -> Result<Vec<usize>> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| self.err(field, format!("expected integers, found {v}")))
                })
                .collect(),
            Some(Value::Number(n)) if n.is_u64() => {
                Ok(vec![n.as_u64().unwrap_or_default() as usize])
            }
            Some(v) => Err(self.err(field, format!("expected an integer or a list, found {v}"))),
        }
    }
}
