//! The OpenAI API's request and response bodies, as far as slotstream serves them
//! (<https://platform.openai.com/docs/api-reference/chat> and `/completions`), and the
//! checks that turn a request into an engine [`Request`].

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::conversation::{
    check_tools, image_url, require_tools, template_role, thinks_at, GrammarField, Params,
};
use super::error::ApiError;
use crate::chat_template::{
    set_enable_thinking, Chat, ChatImage, Message, ToolCall, ToolChoice, RESERVED_KWARGS,
};
use crate::constraint::Grammar;
use crate::engine::Input;
use crate::sampling::{SamplingInput, SamplingOptions};

/// The most `top_logprobs` the chat endpoint takes (OpenAI's bound).
pub const MAX_TOP_LOGPROBS: u64 = 20;
/// The most `logprobs` the completion endpoint takes (OpenAI's bound).
pub const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// Stop sequences OpenAI's API accepts.
pub const OPENAI_STOPS: usize = 4;
/// The longest stop sequence accepted (they are matched against the text after each token).
const MAX_STOP_BYTES: usize = 256;
/// The longest model name accepted: every response (each streamed chunk) repeats it.
const MAX_MODEL_BYTES: usize = 256;

/// Fields both endpoints take (and the fields the other dialects map their sampling and
/// limits into).
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    /// Any name: the server serves the one model it loaded (as llama.cpp's does), and
    /// echoes the name in the response.
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    /// The chat endpoint's newer name for `max_tokens`.
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Extensions that llama.cpp, vLLM and mlx-lm servers accept too.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// An integer from 0 to 2^64 - 1, or -1 for a random one (as `--seed`).
    pub seed: Option<serde_json::Number>,
    pub stop: Option<Stop>,
    /// `null` counts as absent (false), as OpenAI treats it.
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u64>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    /// The chat endpoint's `true`/`false`, or the completion endpoint's count of most
    /// probable tokens (0 to 5).
    pub logprobs: Option<Value>,
    /// The chat endpoint's count of most probable tokens (0 to 20; needs `logprobs`).
    pub top_logprobs: Option<Value>,
    /// Tool definitions: the chat endpoint renders them; a completion refuses them.
    pub tools: Option<Vec<Value>>,
    /// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
    /// "json_schema": {"name", "schema", "strict"}}`: the reply constrained to JSON
    /// ([`crate::constraint`]).
    pub response_format: Option<Value>,
    /// vLLM's names for a constraint: a JSON schema, a regular expression, a Lark grammar
    /// (at most one of these and `response_format`).
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_grammar: Option<String>,
    /// Refused unless empty: the engine does not bias logits, and ignoring it would answer
    /// something other than asked.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// slotstream's extra: add this request's statistics to the response.
    #[serde(default)]
    pub slotstream_stats: bool,
}

/// `stop`: one string or a list of up to 4.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Message roles the chat endpoint accepts.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// `POST /v1/chat/completions`.
#[derive(Debug)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    pub chat: ChatFields,
    pub common: Common,
}

/// The chat endpoint's own fields besides `messages`.
#[derive(Debug, Default, Deserialize)]
pub struct ChatFields {
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    /// `false`: a reply's first tool call is kept and the later ones dropped (with a
    /// warning in the log); absent or `true`: every call is returned.
    pub parallel_tool_calls: Option<bool>,
    /// Template variables, passed to the chat template as transformers passes them.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// The template's `enable_thinking` (also settable in `chat_template_kwargs`).
    pub enable_thinking: Option<bool>,
    /// `none` or `minimal`: thinking off; any other effort: on ([`thinks_at`]).
    pub reasoning_effort: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// Text, a list of content parts, or null (an assistant turn with tool calls).
    pub content: Option<Content>,
    pub reasoning_content: Option<String>,
    /// `arguments` as OpenAI sends them, a JSON string, become the mapping templates read.
    pub tool_calls: Option<Vec<ToolCall>>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
    /// An `image_url` part's `{"url": ...}` (or the URL alone).
    pub image_url: Option<Value>,
}

/// `POST /v1/completions`.
#[derive(Debug)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub completion: CompletionFields,
    pub common: Common,
}

/// The completion endpoint's own fields besides `prompt`: refused unless at their
/// defaults, since ignoring them would answer something other than asked.
#[derive(Debug, Default, Deserialize)]
pub struct CompletionFields {
    pub echo: Option<bool>,
    pub best_of: Option<u64>,
    pub suffix: Option<String>,
}

/// Parses a JSON object body; errors name the field at fault (`messages[2].content`).
pub(super) fn parse_object(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::malformed(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::malformed("the body must be a JSON object".into()));
    }
    Ok(value)
}

/// Deserializes `value` (found at `path`), naming the innermost field at fault.
pub(super) fn typed<'v, T: Deserialize<'v>>(value: &'v Value, path: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let inner = e.path().to_string();
        let at = match (path.is_empty(), inner.as_str()) {
            (true, inner) => inner.to_string(),
            (false, ".") => path.to_string(),
            (false, inner) if inner.starts_with('[') => format!("{path}{inner}"),
            (false, inner) => format!("{path}.{inner}"),
        };
        ApiError::invalid(&at, &e.into_inner().to_string())
    })
}

/// A required field of `object`.
pub(super) fn required<'v, T: Deserialize<'v>>(
    object: &'v Value,
    name: &str,
) -> Result<T, ApiError> {
    match object.get(name) {
        Some(v) => typed(v, name),
        None => Err(ApiError::invalid(name, "missing")),
    }
}

/// A request body of one endpoint.
pub trait ApiRequest: Sized {
    /// Parses a body. Errors: not JSON, not an object, a field of the wrong type.
    fn parse(body: &[u8]) -> Result<Self, ApiError>;
    /// What the model reads. Errors: a part of the input the engine cannot take.
    fn input(&self) -> Result<Input, ApiError>;
    fn common(&self) -> &Common;
}

/// A completion prompt: text, token ids, or a batch of one of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

/// What a chat request asks, checked: the conversation for the template.
fn chat_input(request: &ChatRequest) -> Result<Chat, ApiError> {
    let tools = request.common.tools.clone().unwrap_or_default();
    check_tools(&tools)?;
    let tool_choice = match &request.chat.tool_choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => ToolChoice::None,
        Some(Value::String(s)) if s == "required" => ToolChoice::Required,
        Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(name) if v.get("type").is_none_or(|t| t == "function") => {
                ToolChoice::Function(name.to_string())
            }
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
    };
    require_tools(&tool_choice, &tools)?;
    let mut kwargs = request
        .chat
        .chat_template_kwargs
        .clone()
        .unwrap_or_default();
    if let Some(k) = RESERVED_KWARGS.iter().find(|k| kwargs.contains_key(**k)) {
        return Err(ApiError::invalid(
            &format!("chat_template_kwargs.{k}"),
            "set by the request itself, not as a template variable",
        ));
    }
    if let Some(on) = request.chat.enable_thinking {
        set_enable_thinking(&mut kwargs, on)
            .map_err(|e| ApiError::invalid("enable_thinking", &e))?;
    }
    if let Some(effort) = &request.chat.reasoning_effort {
        set_enable_thinking(&mut kwargs, thinks_at(effort))
            .map_err(|e| ApiError::invalid("reasoning_effort", &e))?;
    }
    Ok(Chat {
        messages: Vec::new(),
        tools,
        tool_choice,
        single_tool_call: request.chat.parallel_tool_calls == Some(false),
        kwargs,
    })
}

/// Token counts of a response.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

impl Common {
    /// Checks the fields and turns them into [`Params`], starting from the server's
    /// `defaults`, with at most `max_stops` stop sequences (OpenAI allows 4:
    /// [`OPENAI_STOPS`]). Errors name the field.
    pub fn params(&self, defaults: &SamplingOptions, max_stops: usize) -> Result<Params, ApiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("n", "only n = 1 is supported"));
        }
        for (field, value) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if value.is_some_and(|v| v != 0.0) {
                return Err(ApiError::invalid(
                    field,
                    "not supported; use repetition_penalty",
                ));
            }
        }
        if self
            .model
            .as_ref()
            .is_some_and(|m| m.len() > MAX_MODEL_BYTES)
        {
            return Err(ApiError::invalid(
                "model",
                &format!("model names have at most {MAX_MODEL_BYTES} bytes"),
            ));
        }
        let logprobs = self.logprobs()?;
        let grammar = self.grammar()?;
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(ApiError::invalid("logit_bias", "not supported"));
        }
        let max_tokens = match (self.max_tokens, self.max_completion_tokens) {
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    "give max_tokens or max_completion_tokens, not both",
                ))
            }
            (Some(n), None) | (None, Some(n)) => {
                if n == 0 {
                    return Err(ApiError::invalid("max_tokens", "must be at least 1"));
                }
                Some(usize::try_from(n).unwrap_or(usize::MAX))
            }
            (None, None) => None,
        };
        // The values read as the command line reads its flags.
        let seed = match &self.seed {
            None => None,
            Some(n) => Some(
                n.as_u64()
                    .map(i128::from)
                    .or_else(|| n.as_i64().map(i128::from))
                    .ok_or_else(|| ApiError::invalid("seed", "must be an integer"))?,
            ),
        };
        let input = SamplingInput {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed,
        };
        let mut sampling = input.apply(defaults).map_err(|e| ApiError::engine(&e))?;
        // No seed: a fresh one per request, as OpenAI's API behaves.
        if self.seed.is_none() {
            sampling.seed = rand::random();
        }
        let stops = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stops.len() > max_stops {
            return Err(ApiError::invalid(
                "stop",
                &format!("at most {max_stops} stop sequences"),
            ));
        }
        if stops
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return Err(ApiError::invalid(
                "stop",
                &format!("stop sequences must have 1 to {MAX_STOP_BYTES} bytes"),
            ));
        }
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "only allowed with stream: true",
            ));
        }
        Ok(Params {
            model: self.model.clone(),
            max_tokens,
            sampling,
            stops,
            stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            stats: self.slotstream_stats,
            logprobs,
            grammar,
        })
    }

    /// How many of the most probable tokens each token's log-probability comes with
    /// (`None`: no log-probabilities): the chat endpoint's `logprobs: true` with
    /// `top_logprobs` (0 to 20), or the completion endpoint's integer `logprobs` (0 to 5).
    fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        let top = match &self.top_logprobs {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(n) if n <= MAX_TOP_LOGPROBS => Some(n as usize),
                _ => {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        &format!("must be an integer from 0 to {MAX_TOP_LOGPROBS}"),
                    ))
                }
            },
        };
        let asked = match &self.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => None,
            Some(Value::Bool(true)) => Some(top.unwrap_or(0)),
            Some(v) => match v.as_u64() {
                Some(n) if n <= MAX_COMPLETION_LOGPROBS && top.is_none() => Some(n as usize),
                _ => {
                    return Err(ApiError::invalid(
                        "logprobs",
                        &format!("must be true or false (chat), or an integer from 0 to {MAX_COMPLETION_LOGPROBS} (completions)"),
                    ))
                }
            },
        };
        if asked.is_none() && top.is_some_and(|n| n > 0) {
            return Err(ApiError::invalid("top_logprobs", "needs logprobs: true"));
        }
        Ok(asked)
    }

    /// The grammar `response_format` or one of the `guided_*` fields asks for (at most
    /// one of them). Errors: an unknown format type, a `json_schema` format without its
    /// schema, more than one constraint.
    fn grammar(&self) -> Result<Option<GrammarField>, ApiError> {
        let mut found = Vec::new();
        match &self.response_format {
            None | Some(Value::Null) => {}
            Some(f) => match f.get("type").and_then(Value::as_str) {
                Some("text") => {}
                Some("json_object") => found.push(GrammarField {
                    grammar: Grammar::JsonObject,
                    field: "response_format",
                }),
                Some("json_schema") => {
                    let Some(schema) = f.pointer("/json_schema/schema") else {
                        return Err(ApiError::invalid(
                            "response_format.json_schema.schema",
                            "missing",
                        ));
                    };
                    found.push(GrammarField {
                        grammar: Grammar::JsonSchema(schema.clone()),
                        field: "response_format",
                    });
                }
                _ => {
                    return Err(ApiError::invalid(
                        "response_format.type",
                        "must be \"text\", \"json_object\" or \"json_schema\"",
                    ))
                }
            },
        }
        if let Some(schema) = self.guided_json.as_ref().filter(|v| !v.is_null()) {
            // vLLM takes the schema as an object or as its JSON text.
            let schema = match schema {
                Value::String(text) => serde_json::from_str(text).map_err(|e| {
                    ApiError::invalid("guided_json", &format!("not a JSON schema: {e}"))
                })?,
                other => other.clone(),
            };
            found.push(GrammarField {
                grammar: Grammar::JsonSchema(schema),
                field: "guided_json",
            });
        }
        if let Some(rx) = &self.guided_regex {
            found.push(GrammarField {
                grammar: Grammar::Regex(rx.clone()),
                field: "guided_regex",
            });
        }
        if let Some(lark) = &self.guided_grammar {
            found.push(GrammarField {
                grammar: Grammar::Lark(lark.clone()),
                field: "guided_grammar",
            });
        }
        if found.len() > 1 {
            return Err(ApiError::invalid(
                found[1].field,
                &format!("give one constraint; {} is given too", found[0].field),
            ));
        }
        Ok(found.pop())
    }
}

impl ApiRequest for ChatRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let value = parse_object(body)?;
        Ok(ChatRequest {
            messages: required(&value, "messages")?,
            chat: typed(&value, "")?,
            common: typed(&value, "")?,
        })
    }

    fn common(&self) -> &Common {
        &self.common
    }

    /// The conversation as the chat template takes it. Errors: no messages, a part that
    /// is not text, malformed tools or tool choice, reserved template variables.
    fn input(&self) -> Result<Input, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages", "must not be empty"));
        }
        let mut chat = chat_input(self)?;
        let messages = &mut chat.messages;
        for (i, m) in self.messages.iter().enumerate() {
            // The role is spliced into the template's text: only the known ones.
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    &format!("`{}` is not one of {}", m.role, ROLES.join(", ")),
                ));
            }
            let mut images = Vec::new();
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            ("image_url", _) => {
                                let at = format!("messages[{i}].content[{j}].image_url");
                                let url = match &p.image_url {
                                    Some(Value::String(url)) => url.as_str(),
                                    Some(v) => {
                                        v.get("url").and_then(Value::as_str).ok_or_else(|| {
                                            ApiError::invalid(&format!("{at}.url"), "missing")
                                        })?
                                    }
                                    None => return Err(ApiError::invalid(&at, "missing")),
                                };
                                images.push(ChatImage {
                                    at: text.len(),
                                    bytes: image_url(&at, url)?,
                                });
                            }
                            ("text", None) => {
                                return Err(ApiError::invalid(
                                    &format!("messages[{i}].content[{j}].text"),
                                    "missing",
                                ))
                            }
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    &format!("messages[{i}].content[{j}].type"),
                                    &format!(
                                        "`{kind}` parts are not supported (text and image_url)"
                                    ),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            messages.push(Message {
                role: template_role(&m.role).to_string(),
                content,
                reasoning_content: m.reasoning_content.clone(),
                tool_calls: m.tool_calls.clone().unwrap_or_default(),
                tool_call_id: m.tool_call_id.clone(),
                name: m.name.clone(),
                images,
            });
        }
        Ok(Input::Chat(chat))
    }
}

impl ApiRequest for CompletionRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let value = parse_object(body)?;
        Ok(CompletionRequest {
            prompt: required(&value, "prompt")?,
            completion: typed(&value, "")?,
            common: typed(&value, "")?,
        })
    }

    fn common(&self) -> &Common {
        &self.common
    }

    /// The prompt as text (tokenized as is, special-token texts included: the text is the
    /// whole prompt, as llama.cpp reads it) or ids. Errors: a batch of more than one,
    /// tools (a completion has no template to render them), `echo`, `best_of` above 1 or
    /// a `suffix`.
    fn input(&self) -> Result<Input, ApiError> {
        if self.common.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(ApiError::invalid(
                "tools",
                "a text completion cannot call tools (use /v1/chat/completions)",
            ));
        }
        let c = &self.completion;
        if c.echo == Some(true) {
            return Err(ApiError::invalid(
                "echo",
                "echoing the prompt is not supported",
            ));
        }
        if c.best_of.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(
                "best_of",
                "only best_of = 1 is supported",
            ));
        }
        if c.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix", "insertion is not supported"));
        }
        let batch = |n: usize| {
            ApiError::invalid(
                "prompt",
                &format!("batches of {n} prompts are not supported (give one)"),
            )
        };
        Ok(match &self.prompt {
            Prompt::Text(t) => Input::Text(t.clone()),
            Prompt::Ids(ids) => Input::Ids(ids.clone()),
            Prompt::Texts(v) if v.len() == 1 => Input::Text(v[0].clone()),
            Prompt::Texts(v) => return Err(batch(v.len())),
            Prompt::IdLists(v) if v.len() == 1 => Input::Ids(v[0].clone()),
            Prompt::IdLists(v) => return Err(batch(v.len())),
        })
    }
}
