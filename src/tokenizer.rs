//! The model's `tokenizer.json`, through the Hugging Face `tokenizers` crate.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A loaded tokenizer, remembering its file for error messages.
pub struct Tokenizer {
    path: PathBuf,
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`. Errors: a missing or malformed file.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::io(&path, std::io::Error::new(std::io::ErrorKind::NotFound, "not found")));
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| Error::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Ok(Tokenizer { path, inner })
    }

    /// Token ids of `text`, without added special tokens (Qwen tokenizers add no BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        Ok(enc.get_ids().to_vec())
    }
}
