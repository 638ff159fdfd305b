//! The library's typed errors. Every variant names the file, tensor or field at fault.

use std::path::PathBuf;

/// Errors returned by the slotstream library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be opened, mapped or read.
    #[error("{path}: {io}")]
    Io { path: PathBuf, io: std::io::Error },

    /// A JSON file (config, index, tokenizer config) is malformed or lacks a field.
    #[error("{path}: {message}")]
    Json { path: PathBuf, message: String },

    /// The config names a `model_type` this build does not implement.
    #[error("{path}: unsupported model_type `{model_type}` (supported: {supported})")]
    UnsupportedModel {
        path: PathBuf,
        model_type: String,
        supported: String,
    },

    /// A config field has a value the engine cannot run (e.g. 3-bit quantization).
    #[error("{path}: field `{field}`: {message}")]
    Config {
        path: PathBuf,
        field: String,
        message: String,
    },

    /// A safetensors file is malformed or inconsistent with itself.
    #[error("{path}: {message}")]
    Safetensors { path: PathBuf, message: String },

    /// A tensor the model needs is absent from every shard.
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor { name: String },

    /// A tensor is present but has the wrong dtype or shape.
    #[error("tensor `{name}`: {message}")]
    BadTensor { name: String, message: String },

    /// The tokenizer could not be loaded or failed on input.
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },

    /// The chat template does not compile, or refuses a conversation (its
    /// `raise_exception`, tools it cannot render, a reserved variable).
    #[error("chat template {path}: {message}")]
    Template { path: PathBuf, message: String },

    /// The slot pool cannot be built or cannot serve a request with the slots it has.
    #[error("slot pool: {0}")]
    Pool(String),

    /// No usable GPU adapter, or the device failed.
    #[error("GPU: {0}")]
    Gpu(String),

    /// A prompt that leaves no room for new tokens in the context.
    #[error(
        "the prompt has {prompt} tokens, which leaves no room in the context of {context} tokens"
    )]
    ContextFull { prompt: usize, context: usize },

    /// A sampling parameter out of range; `field` is its name in a request (`top_p`).
    #[error("{field} {message}")]
    Sampling {
        field: &'static str,
        message: String,
    },

    /// No logit of a step was finite (all NaN or infinite): the model's output carries no
    /// distribution to sample from (bad weights, such as a NaN in the final norm, or a
    /// backend fault). The request fails rather than emitting an arbitrary token.
    #[error("none of the {vocab} logits of a step is finite (NaN or infinite): the model's output is broken (check its weights)")]
    NoFiniteLogits { vocab: usize },

    /// A grammar's mask left none of a step's finite logits (the grammar allows only
    /// tokens the model gives no probability to).
    #[error("the grammar allows none of the tokens the model gives a probability to")]
    NothingAllowed,

    /// A JSON schema, Lark grammar or regular expression that llguidance refuses (the
    /// message is its own), or a constraint the model cannot take (no end-of-sequence
    /// token); `field` is where the request gave it (`response_format`, `--json-schema`).
    #[error("{field}: {message}")]
    Grammar { field: String, message: String },

    /// A state restored from a prompt-cache snapshot of `tokens` tokens gave logits that
    /// are not all finite on its first step: the snapshot is broken. The prompt cache drops
    /// it and runs the prompt from the start, so a request never fails with it.
    #[error("a snapshot of {tokens} tokens gave logits that are not finite")]
    BrokenSnapshot { tokens: usize },

    /// A bug or a crashed task inside the engine (not the caller's fault).
    #[error("internal error: {0}")]
    Internal(String),

    /// A request is invalid for this model (token id out of range, empty input, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// An image that cannot be used: not a supported format, truncated or corrupt, too
    /// large, or of a shape the image processor refuses.
    #[error("image: {0}")]
    Image(String),

    /// A synthetic checkpoint's routing model file is unreadable or malformed.
    #[error(transparent)]
    Routing(#[from] RoutingModelError),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, io: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            io,
        }
    }

    pub(crate) fn bad_tensor(name: &str, message: impl Into<String>) -> Self {
        Error::BadTensor {
            name: name.to_string(),
            message: message.into(),
        }
    }
}

/// Shorthand for `Result<T, slotstream::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors reading a synthetic checkpoint's routing model file (routing_model/params.rs). Every
/// variant names the file. Defined here, below every module that reports it.
#[derive(Debug, thiserror::Error)]
pub enum RoutingModelError {
    /// The file could not be read.
    #[error("{path}: {io}")]
    Io { path: PathBuf, io: std::io::Error },

    /// The file is not JSON, lacks a field, has an unknown one, or a field has the wrong
    /// type (serde's message names the field, line and column).
    #[error("{path}: malformed routing model: {message}")]
    Malformed { path: PathBuf, message: String },

    /// A field's value is outside its range.
    #[error("{path}: field `{field}`: {message}")]
    Field {
        path: PathBuf,
        field: &'static str,
        message: String,
    },
}
