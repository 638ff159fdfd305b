//! Constrained decoding through llguidance: a JSON schema, a Lark grammar or a regular
//! expression becomes a [`Constraint`], which gives the tokens allowed at each step (a
//! mask the sampler applies, [`crate::sampling::Sampler::sample_allowed`]) and follows the
//! tokens chosen.
//!
//! The vocabulary llguidance needs ([`Vocabulary`]) is built from the checkpoint's
//! `tokenizer.json` bytes with llguidance's own reader
//! ([`llguidance::token_bytes_from_tokenizer_json`]: each token's bytes, byte-level
//! decoded, special tokens marked), not through `toktrie_hf_tokenizers`, which pins an
//! older `tokenizers` than this crate's. Its text-to-token step is the trie's greedy one
//! (llguidance's `ApproximateTokEnv`): llguidance then computes masks alone, never forces
//! a run of tokens, which is what sampling needs.
//!
//! JSON schemas are compiled with llguidance's options set to the compact form `{"a": 1,
//! "b": [2, 3]}` (one space after `:` and `,`, no other whitespace: a model cannot pad a
//! reply with whitespace forever) and `oneOf` read as `anyOf`, unless the schema sets its
//! own `x-guidance` options.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use crate::error::{Error, Result};

/// What a reply must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// Any JSON object (OpenAI's `json_object`, Ollama's `"json"`).
    JsonObject,
    /// A JSON value valid under this JSON Schema (<https://json-schema.org>, as far as
    /// llguidance supports it).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark syntax (which may embed `%json{...}` schemas).
    Lark(String),
    /// A regular expression (Rust `regex` syntax) the whole reply matches.
    Regex(String),
}

impl Grammar {
    /// llguidance's grammar for this one.
    fn top_level(&self) -> std::result::Result<TopLevelGrammar, String> {
        Ok(match self {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(&json!({"type": "object"})))
            }
            Grammar::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err("a JSON schema is an object (or true/false)".into());
                }
                TopLevelGrammar::from_json_schema(compact(schema))
            }
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
        })
    }
}

/// `schema` with llguidance's compact JSON options, unless it sets its own.
fn compact(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
                "coerce_one_of": true,
            })
        });
    }
    schema
}

/// A model's vocabulary as llguidance reads it, with the compiled state grammars share;
/// built once per model ([`Vocabulary::from_tokenizer_json`]) and shared by requests.
pub struct Vocabulary {
    factory: ParserFactory,
    eos: Vec<u32>,
}

impl Vocabulary {
    /// The vocabulary of the `tokenizer.json` whose text is `json` (found at `path`, for
    /// errors), padded with empty (never allowed) tokens to the model's `vocab_size`
    /// logits; `eos`: the ids that end a reply, allowed where the grammar accepts.
    /// Errors ([`Error::Tokenizer`]): a tokenizer llguidance cannot read (neither
    /// byte-level nor byte-fallback), more tokens than `vocab_size`, no `eos`.
    pub fn from_tokenizer_json(
        json: &[u8],
        path: &std::path::Path,
        vocab_size: usize,
        eos: &[u32],
    ) -> Result<Self> {
        let bad = |message: String| Error::Tokenizer {
            path: path.to_path_buf(),
            message,
        };
        let value: Value = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&value)
            .map_err(|e| bad(format!("llguidance cannot read it: {e}")))?;
        if words.len() > vocab_size {
            return Err(bad(format!(
                "{} tokens, more than the model's {vocab_size} logits",
                words.len()
            )));
        }
        words.resize(vocab_size, Vec::new());
        let Some(&first) = eos.first() else {
            return Err(bad(
                "the model has no end-of-sequence token, which a constrained reply ends with"
                    .into(),
            ));
        };
        let info = TokRxInfo::new(vocab_size as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| bad(format!("llguidance: {e}")))?;
        // Compile errors come back in the result; nothing goes to stderr.
        factory.quiet();
        Ok(Vocabulary {
            factory,
            eos: eos.to_vec(),
        })
    }

    /// Token `id`'s bytes (a special token's text; empty for an id past the tokenizer's).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let trie = self.factory.tok_env().tok_trie();
        if id as usize >= trie.vocab_size() {
            return Vec::new();
        }
        let bytes = trie.token(id);
        bytes
            .strip_prefix(&[TokTrie::SPECIAL_TOKEN_MARKER])
            .unwrap_or(bytes)
            .to_vec()
    }

    /// A constraint to `grammar`, from the start of the reply, or (`after` an id: the
    /// `</think>` of a reply that opens with reasoning) from just after that token.
    /// Errors: [`Error::Grammar`] with llguidance's message for a grammar it refuses
    /// (`field`: where the request gave it).
    pub fn constrain(
        &self,
        grammar: &Grammar,
        after: Option<u32>,
        field: &str,
    ) -> Result<Constraint> {
        let refused = |message: String| Error::Grammar {
            field: field.to_string(),
            message,
        };
        let top = grammar.top_level().map_err(refused)?;
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| refused(e.to_string()))?;
        Ok(Constraint {
            matcher: Matcher::new(Ok(parser)),
            waiting_for: after,
            eos: self.eos.clone(),
        })
    }
}

/// One reply's constraint ([`Vocabulary::constrain`]): the mask of each step, and the
/// chosen tokens fed back. A clone starts from the same point and goes its own way.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    /// The token that starts the constrained part (`</think>`), until it is chosen.
    waiting_for: Option<u32>,
    eos: Vec<u32>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("waiting_for", &self.waiting_for)
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// The tokens allowed next (`None`: any, before the constrained part starts); the
    /// end-of-sequence ids only where the grammar accepts the reply so far, and alone once
    /// it can go no further. Errors: llguidance's, as [`Error::Internal`].
    pub fn mask(&mut self) -> Result<Option<SimpleVob>> {
        if self.waiting_for.is_some() {
            return Ok(None);
        }
        let mut mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| Error::Internal(format!("llguidance: {e}")))?;
        // llguidance allows its first end-of-sequence id; the model's others end a reply
        // as well.
        if mask.is_allowed(self.eos[0]) {
            for &id in &self.eos[1..] {
                mask.allow_token(id);
            }
        }
        Ok(Some(mask))
    }

    /// Follows the chosen `id` (an end-of-sequence id ends the reply and is not fed).
    /// Errors: an id the grammar does not allow (a mask not applied), as
    /// [`Error::Internal`].
    pub fn commit(&mut self, id: u32) -> Result<()> {
        if let Some(start) = self.waiting_for {
            if id == start {
                self.waiting_for = None;
            }
            return Ok(());
        }
        if self.eos.contains(&id) {
            return Ok(());
        }
        self.matcher
            .consume_token(id)
            .map_err(|e| Error::Internal(format!("llguidance refused token {id}: {e}")))
    }
}
