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

use crate::chat_template::{ToolCallFormat, ToolChoice};
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

/// The Lark grammar of a reply's tool calls in the model's own `format`, for `tools` (in
/// OpenAI's chat shape) and `choice`; `None` when nothing is constrained (`auto` without
/// a `strict: true` tool, or `none`).
///
/// - `required` or a named function: the reply continues the call's opening, which the
///   prompt ends with (`<tool_call>\n{"name": "`, with the name and `"arguments": ` for a
///   named one; `<tool_call>\n<function=` for the XML format:
///   [`crate::chat_template::ChatTemplate::tool_call_format`]), and is one whole call of
///   one of the tools, its arguments valid under the tool's `parameters` schema, then the
///   end;
/// - `auto` with a tool that has `strict: true`: text without `<tool_call>`, and calls
///   between text; a strict tool's arguments follow its schema, another's are any object.
///
/// In the XML format a parameter's value is JSON under its schema, except strings, which
/// are written raw: one of an `enum` or `const` of strings, or (type `string`, its
/// pattern and bounds not applied) any text up to the first `\n</parameter>\n`; required
/// parameters come first, in the schema's order, then the optional ones.
pub fn tool_call_grammar(
    format: ToolCallFormat,
    tools: &[Value],
    choice: &ToolChoice,
) -> Option<Grammar> {
    let function = |t: &Value| t.get("function").unwrap_or(t).clone();
    let strict = |t: &Value| function(t).get("strict") == Some(&Value::Bool(true));
    let (calls, opened): (Vec<Value>, bool) = match choice {
        ToolChoice::None => return None,
        ToolChoice::Auto if !tools.iter().any(strict) => return None,
        ToolChoice::Auto => (tools.to_vec(), false),
        ToolChoice::Required => (tools.to_vec(), true),
        ToolChoice::Function(name) => (
            tools
                .iter()
                .filter(|t| crate::chat_template::tool_name(t) == Some(name))
                .cloned()
                .collect(),
            true,
        ),
    };
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    for (i, tool) in calls.iter().enumerate() {
        let f = function(tool);
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        let constrained = !matches!(choice, ToolChoice::Auto) || strict(tool);
        let parameters = match f.get("parameters") {
            Some(p) if constrained && p.is_object() => p.clone(),
            _ => json!({"type": "object"}),
        };
        let named = matches!(choice, ToolChoice::Function(_));
        let body = match format {
            ToolCallFormat::Json => {
                let head = if named {
                    String::new()
                } else {
                    lit(&format!("{name}\", \"arguments\": "))
                };
                format!(
                    "{head} {} {}",
                    json_rule(&parameters),
                    lit("}\n</tool_call>")
                )
            }
            ToolCallFormat::Xml => {
                let head = if named {
                    String::new()
                } else {
                    lit(&format!("{name}>\n"))
                };
                format!(
                    "{head} {} {}",
                    xml_parameters(&parameters),
                    lit("</function>\n</tool_call>")
                )
            }
        };
        rules.push(format!("call_{i}: {body}"));
        alternatives.push(format!("call_{i}"));
    }
    let calls = alternatives.join(" | ");
    let start = if opened {
        format!("start: {calls}")
    } else {
        let opening = match format {
            ToolCallFormat::Json => "\n{\"name\": \"",
            ToolCallFormat::Xml => "\n<function=",
        };
        // Text up to the first `<tool_call>` (a lazy lexeme), a call, and so on; the last
        // text has none.
        format!(
            "start: (pre {} ({calls}))* TEXT\npre[lazy]: /(?s:.*)<tool_call>/\nTEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/",
            lit(opening)
        )
    };
    if format == ToolCallFormat::Xml {
        // A text value with its closing: text up to the first `\n</parameter>\n`.
        rules.push(r"xml_text[lazy]: /(?s:.*)\n<\/parameter>\n/".to_string());
    }
    Some(Grammar::Lark(format!("{start}\n{}\n", rules.join("\n"))))
}

/// `text` as a Lark string literal.
fn lit(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

/// A JSON value under `schema`, inline in a Lark grammar (compact, as [`Grammar`]'s).
fn json_rule(schema: &Value) -> String {
    format!("%json {}", compact(schema))
}

/// Qwen3-Coder's `<parameter=P>\nvalue\n</parameter>\n` items for an object `schema`.
fn xml_parameters(schema: &Value) -> String {
    let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
        // Any parameters: names and text values.
        return format!(
            "({} /[A-Za-z0-9_.-]+/ {} xml_text)*",
            lit("<parameter="),
            lit(">\n")
        );
    };
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let item = |name: &str, property: &Value| {
        let close = lit("\n</parameter>\n");
        // Strings are written raw (the parser types values by the schema).
        let strings: Option<Vec<&str>> = match (property.get("enum"), property.get("const")) {
            (Some(Value::Array(values)), _) => values.iter().map(Value::as_str).collect(),
            (_, Some(Value::String(value))) => Some(vec![value.as_str()]),
            _ => None,
        };
        let value = match strings {
            Some(values) => {
                let values: Vec<String> = values.into_iter().map(lit).collect();
                format!("({}) {close}", values.join(" | "))
            }
            None if property.get("type") == Some(&json!("string")) => "xml_text".to_string(),
            None => format!("{} {close}", json_rule(property)),
        };
        format!("{} {value}", lit(&format!("<parameter={name}>\n")))
    };
    let mut items: Vec<String> = required
        .iter()
        .filter_map(|&n| properties.get(n).map(|p| item(n, p)))
        .collect();
    items.extend(
        properties
            .iter()
            .filter(|(n, _)| !required.contains(&n.as_str()))
            .map(|(n, p)| format!("({})?", item(n, p))),
    );
    if items.is_empty() {
        return String::new();
    }
    items.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The random-weight fixture's vocabulary (byte-level BPE, 509 tokens of 512 logits).
    fn vocabulary() -> Vocabulary {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/qwen3-next-bf16/tokenizer.json");
        let json = std::fs::read(&path).unwrap();
        Vocabulary::from_tokenizer_json(&json, &path, 512, &[509, 511]).unwrap()
    }

    /// Whether `grammar` takes `text` (tokenized greedily, each token checked against the
    /// step's mask) and then allows the end of sequence.
    fn takes(v: &Vocabulary, grammar: &Grammar, text: &str) -> bool {
        let mut c = v.constrain(grammar, None, "test").unwrap();
        let ids = v
            .factory
            .tok_env()
            .tok_trie()
            .greedy_tokenize(text.as_bytes());
        for id in ids {
            let mask = c.mask().unwrap().unwrap();
            if !mask.is_allowed(id) {
                return false;
            }
            c.commit(id).unwrap();
        }
        let end = c.mask().unwrap().unwrap();
        end.is_allowed(509) && end.is_allowed(511)
    }

    fn tools() -> Vec<Value> {
        let weather = json!({"type": "function", "function": {"name": "get_weather", "strict": true,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"], "additionalProperties": false}}});
        let time = json!({"type": "function", "function": {"name": "get_time"}});
        vec![weather, time]
    }

    /// A required call continues the opening the prompt ends with, in either format, with
    /// arguments under the tool's schema; a named call takes that tool alone; `auto` with
    /// a strict tool takes text, or text and valid calls; `none`, or `auto` without a
    /// strict tool, constrains nothing.
    #[test]
    fn tool_call_grammars_take_valid_calls_only() {
        let v = vocabulary();
        let tools = tools();
        let json = |choice| tool_call_grammar(ToolCallFormat::Json, &tools, &choice).unwrap();
        let required = json(ToolChoice::Required);
        let call = "get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 3}}\n</tool_call>";
        assert!(takes(&v, &required, call));
        assert!(takes(
            &v,
            &required,
            "get_time\", \"arguments\": {\"any\": [1]}}\n</tool_call>"
        ));
        assert!(!takes(
            &v,
            &required,
            "get_weather\", \"arguments\": {\"days\": 3}}\n</tool_call>"
        ));
        assert!(!takes(
            &v,
            &required,
            "get_news\", \"arguments\": {}}\n</tool_call>"
        ));
        let named = json(ToolChoice::Function("get_weather".into()));
        assert!(takes(&v, &named, "{\"city\": \"Oslo\"}}\n</tool_call>"));
        assert!(!takes(&v, &named, "{\"city\": 7}}\n</tool_call>"));

        let auto = json(ToolChoice::Auto);
        assert!(takes(&v, &auto, "No call needed."));
        let called = format!("Checking.\n<tool_call>\n{{\"name\": \"{call}");
        assert!(takes(&v, &auto, &called));
        assert!(!takes(&v, &auto, "x<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\": \"Oslo\"}}\n</tool_call>"));
        assert!(tool_call_grammar(ToolCallFormat::Json, &tools[1..], &ToolChoice::Auto).is_none());
        assert!(tool_call_grammar(ToolCallFormat::Json, &tools, &ToolChoice::None).is_none());

        let xml = tool_call_grammar(ToolCallFormat::Xml, &tools, &ToolChoice::Required).unwrap();
        let call = "get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        assert!(takes(&v, &xml, call));
        assert!(!takes(
            &v,
            &xml,
            "get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
        ));
        assert!(!takes(&v, &xml, "get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\nmany\n</parameter>\n</function>\n</tool_call>"));
    }

    /// A schema llguidance refuses names the field with its message.
    #[test]
    fn refused_grammars_name_their_field() {
        let v = vocabulary();
        let e = v
            .constrain(
                &Grammar::Lark("start: nowhere".into()),
                None,
                "guided_grammar",
            )
            .unwrap_err();
        assert!(
            matches!(&e, Error::Grammar { field, .. } if field == "guided_grammar"),
            "{e}"
        );
    }
}
