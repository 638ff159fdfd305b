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
            return Err(Error::io(
                &path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "not found"),
            ));
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| Error::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Ok(Tokenizer { path, inner })
    }

    /// Token ids of `text`, without added special tokens (Qwen tokenizers add no BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }
}

impl Tokenizer {
    /// Text of `ids`, special tokens (those tokenizer.json marks `special`, such as
    /// `<|im_start|>`) left out, as llama.cpp prints output without `--special` and vLLM
    /// returns it by default: a control token the model emits is not shown as text.
    /// Tokens such as Qwen3's `<think>` are not marked special and stay.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| Error::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        })
    }
}

/// Incremental detokenization: text is released only once it is complete, so a
/// character whose UTF-8 bytes are split across tokens prints whole (as mlx-lm's
/// `NaiveStreamingDetokenizer` does: decode a window of recent tokens and hold back a
/// trailing U+FFFD).
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the window that is re-decoded, and the text of the window already emitted.
    start: usize,
    emitted: String,
}

impl Default for StreamDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamDecoder {
    pub fn new() -> Self {
        StreamDecoder {
            ids: Vec::new(),
            start: 0,
            emitted: String::new(),
        }
    }

    /// Adds a token; returns the newly complete text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tok.decode(&self.ids[self.start..])?;
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = text
            .get(self.emitted.len()..)
            .unwrap_or_default()
            .to_string();
        self.emitted = text;
        // Keep the window short: once a complete piece ends the text, start afresh.
        if self.ids.len() - self.start > 16 {
            self.start = self.ids.len();
            self.emitted.clear();
        }
        Ok(delta)
    }

    /// Text still held back (an incomplete character at the end), released as is.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        let text = tok.decode(&self.ids[self.start..])?;
        let delta = text
            .get(self.emitted.len()..)
            .unwrap_or_default()
            .to_string();
        self.start = self.ids.len();
        self.emitted.clear();
        Ok(delta)
    }
}

/// The model's chat template (`chat_template` in tokenizer_config.json, or
/// chat_template.jinja), rendered with minijinja and Python string methods.
pub struct ChatTemplate {
    source: String,
    path: PathBuf,
    bos_token: String,
    eos_token: String,
}

/// One chat message.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl ChatTemplate {
    /// Reads the template of the model in `dir`. `Ok(None)` if the model has none.
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let cfg_path = dir.join("tokenizer_config.json");
        let mut source = None;
        let (mut bos_token, mut eos_token) = (String::new(), String::new());
        if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
            let cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
                path: cfg_path.clone(),
                message: e.to_string(),
            })?;
            source = match cfg.get("chat_template") {
                Some(serde_json::Value::String(t)) => Some(t.clone()),
                // Named templates: [{"name": "default", "template": ...}, ...].
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str())
                    .map(str::to_string),
                _ => None,
            };
            let token = |k: &str| {
                cfg.get(k)
                    .and_then(|v| {
                        v.as_str()
                            .or_else(|| v.get("content").and_then(|c| c.as_str()))
                    })
                    .unwrap_or_default()
                    .to_string()
            };
            bos_token = token("bos_token");
            eos_token = token("eos_token");
        }
        // chat_template.jinja takes precedence, as in transformers.
        let jinja = dir.join("chat_template.jinja");
        let (source, path) = match source {
            _ if jinja.exists() => (
                std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?,
                jinja,
            ),
            Some(s) => (s, cfg_path),
            None => return Ok(None),
        };
        Ok(Some(ChatTemplate {
            source,
            path,
            bos_token,
            eos_token,
        }))
    }

    /// The prompt text for `messages`, ending with the assistant's turn opened.
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        // As transformers renders chat templates: blocks trimmed, Python string methods,
        // and `raise_exception` for templates that validate their input.
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        let err = |e: minijinja::Error| Error::Tokenizer {
            path: self.path.clone(),
            message: format!("chat template: {e}"),
        };
        env.add_template("chat", &self.source).map_err(err)?;
        env.get_template("chat")
            .map_err(err)?
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(err)
    }
}

/// End-of-sequence ids as mlx-lm 0.32.2 decides them (`utils.load`, `TokenizerWrapper`):
/// generation_config.json's `eos_token_id` when present and non-empty, else config.json's,
/// plus the tokenizer's own `eos_token` from tokenizer_config.json.
/// Errors: malformed generation_config.json, or an id outside `vocab`.
pub fn eos_ids(
    dir: &Path,
    config_eos: &[u32],
    tokenizer: &Tokenizer,
    vocab: usize,
) -> Result<Vec<u32>> {
    let mut ids = config_eos.to_vec();
    let path = dir.join("generation_config.json");
    if path.exists() {
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let listed: Vec<u64> = match v.get("eos_token_id") {
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).collect(),
            Some(x) => x.as_u64().into_iter().collect(),
            None => Vec::new(),
        };
        if !listed.is_empty() {
            ids = listed
                .into_iter()
                .map(|x| {
                    u32::try_from(x)
                        .ok()
                        .filter(|&id| (id as usize) < vocab)
                        .ok_or_else(|| Error::Json {
                            path: path.clone(),
                            message: format!(
                                "eos_token_id {x} is outside the vocabulary of {vocab}"
                            ),
                        })
                })
                .collect::<Result<_>>()?;
        }
    }
    let cfg_path = dir.join("tokenizer_config.json");
    if let Ok(text) = std::fs::read_to_string(&cfg_path) {
        let token = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|cfg| {
                let t = cfg.get("eos_token")?;
                t.as_str()
                    .or_else(|| t.get("content")?.as_str())
                    .map(str::to_string)
            });
        if let Some(id) = token.and_then(|t| tokenizer.inner.token_to_id(&t)) {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-next-bf16")
    }

    #[test]
    fn streaming_decode_round_trips_emoji_and_cjk() {
        let tok = Tokenizer::load(&fixture()).unwrap();
        for text in [
            "héllo wörld 🙂🚀 日本語のテキスト and 中文 ok",
            "🧪🧪 ümlaut ✓",
        ] {
            let ids = tok.encode(text).unwrap();
            let mut dec = StreamDecoder::new();
            let mut out = String::new();
            for &id in &ids {
                let piece = dec.push(&tok, id).unwrap();
                assert!(
                    !piece.contains('\u{FFFD}'),
                    "partial character released: {piece:?}"
                );
                out.push_str(&piece);
            }
            assert_eq!(out, text);
        }
    }

    #[test]
    fn chat_template_renders_chatml() {
        let t = ChatTemplate::load(&fixture()).unwrap().expect("template");
        let p = t
            .render(&[Message {
                role: "user".into(),
                content: "hi".into(),
            }])
            .unwrap();
        assert_eq!(p, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        let tok = Tokenizer::load(&fixture()).unwrap();
        // generation_config.json lists [511, 509]; tokenizer_config's eos_token is <|im_end|> (511).
        let eos = eos_ids(&fixture(), &[7], &tok, 512).unwrap();
        assert_eq!(eos, vec![509, 511]);
    }
}
