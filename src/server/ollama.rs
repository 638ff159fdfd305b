//! Ollama's API (<https://github.com/ollama/ollama/blob/main/docs/api.md>) on the
//! conversation core: `POST /api/chat` and `/api/generate` (a stream of JSON lines by
//! default, one object with `stream: false`), `POST /api/show`, `GET /api/tags`, `/api/ps`
//! and `/api/version`. Errors are `{"error": "..."}` with the status.
//!
//! Requests map onto the core as Ollama's server maps them: `options` (temperature,
//! top_p, top_k, min_p, num_predict, seed, stop, repeat_penalty) become the sampling and
//! limits; `think` sets the template's thinking switch and the reasoning comes back as
//! `thinking`; `tools` and an assistant's `tool_calls` (arguments as objects) render with
//! the chat template, and a `tool` message's `tool_name` is its name. Left out, with a
//! clear 400: `format`, `logprobs`, and `/api/generate`'s `suffix`, `template` and
//! `context`. `images` (base64) go before their message's text. `keep_alive` and `num_ctx` are accepted and change nothing (the model
//! stays loaded; the context is the server's). An empty `messages` or `prompt` answers
//! the load acknowledgement (`done_reason: "load"`).

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::conversation::{self, Conversation, Outcome, Turn, TurnEvent};
use super::conversation::{check_tools, GrammarField, Params, MAX_STOPS};
use super::error::ApiError;
use super::openai::{parse_object, typed, Common, Stop};
use super::{generated_response, request_body, turn_frames, App, Logged};
use crate::chat_template::{set_enable_thinking, Chat, ChatImage, Message, ToolCall, ToolChoice};
use crate::constraint::Grammar;
use crate::engine::Input;
use crate::reply::{FunctionCall, Reply};
use crate::sampling::SamplingOptions;

/// The Ollama release whose API this follows, reported by `/api/version` (clients check it
/// before using tools and thinking).
const OLLAMA_VERSION: &str = "0.14.0";

/// Message roles `/api/chat` accepts.
const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// `options`: the sampling and limit fields slotstream reads (others are accepted and
/// ignored, as Ollama ignores the options its runner does not use).
#[derive(Debug, Default, Deserialize)]
struct Options {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    /// New tokens; -1 (no limit) or -2 (fill the context): up to the context.
    num_predict: Option<i64>,
    seed: Option<serde_json::Number>,
    stop: Option<Vec<String>>,
    repeat_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
}

/// What `/api/chat` and `/api/generate` share.
#[derive(Debug, Default, Deserialize)]
struct Shared {
    model: Option<String>,
    /// `true`, `false`, or a level (`"high"`, `"medium"`, `"low"`: thinking on).
    think: Option<Value>,
    /// `"json"` (any JSON object) or a JSON schema the reply must match.
    format: Option<Value>,
    options: Option<Options>,
    /// `null` counts as absent (streaming, Ollama's default).
    stream: Option<bool>,
    /// Each token's log-probability, with `top_logprobs` (0 to 20) of the most probable.
    logprobs: Option<bool>,
    top_logprobs: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct ChatBody {
    #[serde(default)]
    messages: Vec<OllamaMessage>,
    tools: Option<Vec<Value>>,
}

#[derive(Debug, Deserialize)]
struct OllamaMessage {
    role: String,
    content: Option<String>,
    thinking: Option<String>,
    images: Option<Vec<Value>>,
    tool_calls: Option<Vec<OllamaToolCall>>,
    /// The tool a `tool` message answers.
    tool_name: Option<String>,
}

#[derive(Debug, Deserialize)]
struct OllamaToolCall {
    function: OllamaFunction,
}

#[derive(Debug, Deserialize)]
struct OllamaFunction {
    name: String,
    #[serde(default)]
    arguments: Value,
}

#[derive(Debug, Deserialize)]
struct GenerateBody {
    #[serde(default)]
    prompt: String,
    system: Option<String>,
    #[serde(default)]
    raw: bool,
    suffix: Option<String>,
    template: Option<String>,
    context: Option<Vec<u32>>,
    images: Option<Vec<Value>>,
}

/// Which endpoint a reply goes to: `/api/chat` puts text in `message`, `/api/generate`
/// in `response`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Generate,
}

impl Endpoint {
    fn route(self) -> &'static str {
        match self {
            Endpoint::Chat => "/api/chat",
            Endpoint::Generate => "/api/generate",
        }
    }
}

/// `error` as Ollama answers one: `{"error": message}` with its status.
pub fn error_response(error: ApiError) -> Response {
    error.respond(error.status, json!({ "error": error.message }))
}

/// 501 for an endpoint of Ollama's that slotstream does not have.
pub fn unsupported(what: &str) -> Response {
    error_response(ApiError::unsupported(format!(
        "{what} is not supported by slotstream, which serves one MLX checkpoint (`slotstream serve --model DIR`)"
    )))
}

/// The conversation of a `/api/chat` body, and whether it is empty (a load request).
/// Errors name the field at fault.
pub fn chat_conversation(
    body: &[u8],
    defaults: &SamplingOptions,
) -> Result<Option<Conversation>, ApiError> {
    let value = parse_object(body)?;
    let shared: Shared = typed(&value, "")?;
    let chat: ChatBody = typed(&value, "")?;
    if chat.messages.is_empty() {
        return Ok(None);
    }
    let tools = chat.tools.unwrap_or_default();
    check_tools(&tools)?;
    let mut messages = Vec::with_capacity(chat.messages.len());
    for (i, m) in chat.messages.into_iter().enumerate() {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::invalid(
                &format!("messages[{i}].role"),
                &format!("`{}` is not one of {}", m.role, ROLES.join(", ")),
            ));
        }
        let images = images_before_text(m.images.as_deref(), &format!("messages[{i}].images"))?;
        let tool_calls = m
            .tool_calls
            .unwrap_or_default()
            .into_iter()
            .map(|c| ToolCall {
                id: None,
                name: c.function.name,
                arguments: match c.function.arguments {
                    Value::Null => Value::Object(Map::new()),
                    Value::String(s) => ToolCall::arguments_from_text(&s),
                    v => v,
                },
            })
            .collect();
        messages.push(Message {
            role: m.role,
            content: m.content.unwrap_or_default(),
            reasoning_content: m.thinking.filter(|t| !t.is_empty()),
            tool_calls,
            tool_call_id: None,
            name: m.tool_name,
            images,
        });
    }
    let (params, kwargs) = shared.params(defaults)?;
    Ok(Some(Conversation {
        input: Input::Chat(Chat {
            messages,
            tools,
            tool_choice: ToolChoice::Auto,
            kwargs,
            ..Default::default()
        }),
        params,
        route: Endpoint::Chat.route(),
    }))
}

/// The conversation of a `/api/generate` body (`None` for an empty prompt: a load
/// request): the prompt as a user message after `system` through the chat template, or
/// with `raw` the text as it is.
pub fn generate_conversation(
    body: &[u8],
    defaults: &SamplingOptions,
) -> Result<Option<Conversation>, ApiError> {
    let value = parse_object(body)?;
    let shared: Shared = typed(&value, "")?;
    let g: GenerateBody = typed(&value, "")?;
    let images = images_before_text(g.images.as_deref(), "images")?;
    if g.raw && !images.is_empty() {
        return Err(ApiError::invalid(
            "images",
            "need the chat template: not with `raw`",
        ));
    }
    for (field, given) in [
        ("suffix", g.suffix.as_ref().is_some_and(|s| !s.is_empty())),
        (
            "template",
            g.template.as_ref().is_some_and(|s| !s.is_empty()),
        ),
        ("context", g.context.as_ref().is_some_and(|c| !c.is_empty())),
    ] {
        if given {
            return Err(ApiError::invalid(
                field,
                "not supported (send the whole conversation to /api/chat instead)",
            ));
        }
    }
    if g.prompt.is_empty() {
        return Ok(None);
    }
    let (params, kwargs) = shared.params(defaults)?;
    let input = if g.raw {
        Input::Text(g.prompt)
    } else {
        let mut messages = Vec::new();
        if let Some(system) = g.system.filter(|s| !s.is_empty()) {
            messages.push(Message::new("system", &system));
        }
        messages.push(Message {
            images,
            ..Message::new("user", &g.prompt)
        });
        Input::Chat(Chat {
            messages,
            kwargs,
            ..Default::default()
        })
    };
    Ok(Some(Conversation {
        input,
        params,
        route: Endpoint::Generate.route(),
    }))
}

/// A message's `images` (base64 each), placed before its text as Ollama places them.
/// Errors: 400 naming the image.
fn images_before_text(images: Option<&[Value]>, field: &str) -> Result<Vec<ChatImage>, ApiError> {
    (images.into_iter().flatten().enumerate())
        .map(|(k, v)| {
            let at = format!("{field}[{k}]");
            let data = v
                .as_str()
                .ok_or_else(|| ApiError::invalid(&at, "must be base64 text"))?;
            Ok(ChatImage {
                at: 0,
                bytes: conversation::image_base64(&at, data)?,
            })
        })
        .collect()
}

impl Shared {
    /// The core's parameters and the template variables (`think`), from the server's
    /// `defaults` (whose sampling a request without options keeps). Errors name the field.
    fn params(&self, defaults: &SamplingOptions) -> Result<(Params, Map<String, Value>), ApiError> {
        let grammar = match &self.format {
            None | Some(Value::Null) => None,
            Some(Value::String(f)) if f.is_empty() => None,
            Some(Value::String(f)) if f == "json" => Some(Grammar::JsonObject),
            Some(schema @ Value::Object(_)) => Some(Grammar::JsonSchema(schema.clone())),
            Some(_) => {
                return Err(ApiError::invalid(
                    "format",
                    "must be \"json\" or a JSON schema (an object)",
                ))
            }
        };
        let o = self.options.as_ref();
        let get = |f: fn(&Options) -> Option<f32>| o.and_then(f);
        let max_tokens = match o.and_then(|o| o.num_predict) {
            None => None,
            Some(0) => {
                return Err(ApiError::invalid(
                    "options.num_predict",
                    "must be at least 1 (or -1 for no limit but the context)",
                ))
            }
            Some(n) if n < 0 => Some(u64::MAX),
            Some(n) => Some(n as u64),
        };
        let common = Common {
            model: self.model.clone(),
            max_tokens,
            temperature: get(|o| o.temperature),
            top_p: get(|o| o.top_p),
            top_k: o.and_then(|o| o.top_k),
            min_p: get(|o| o.min_p),
            repetition_penalty: get(|o| o.repeat_penalty),
            presence_penalty: get(|o| o.presence_penalty),
            frequency_penalty: get(|o| o.frequency_penalty),
            seed: o.and_then(|o| o.seed.clone()),
            stop: o.and_then(|o| o.stop.clone()).map(Stop::Many),
            stream: Some(self.stream.unwrap_or(true)),
            // OpenAI's chat fields are Ollama's.
            logprobs: self.logprobs.map(Value::Bool),
            top_logprobs: self.top_logprobs.clone(),
            ..Default::default()
        };
        let mut params = common.params(defaults, MAX_STOPS).map_err(|e| {
            if matches!(e.param.as_deref(), Some("logprobs" | "top_logprobs")) {
                e
            } else {
                e.under("options")
            }
        })?;
        params.grammar = grammar.map(|grammar| GrammarField {
            grammar,
            field: "format",
        });
        let mut kwargs = Map::new();
        match &self.think {
            None | Some(Value::Null) => {}
            Some(Value::Bool(on)) => {
                set_enable_thinking(&mut kwargs, *on).map_err(|e| ApiError::invalid("think", &e))?
            }
            Some(Value::String(level)) if ["high", "medium", "low"].contains(&level.as_str()) => {
                set_enable_thinking(&mut kwargs, true)
                    .map_err(|e| ApiError::invalid("think", &e))?
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    "think",
                    "must be true, false, \"high\", \"medium\" or \"low\"",
                ))
            }
        }
        Ok((params, kwargs))
    }
}

/// `POST /api/chat`.
pub async fn chat(State(app): State<Arc<App>>, body: Body) -> Response {
    answer(app, Endpoint::Chat, body).await
}

/// `POST /api/generate`.
pub async fn generate(State(app): State<Arc<App>>, body: Body) -> Response {
    answer(app, Endpoint::Generate, body).await
}

async fn answer(app: Arc<App>, endpoint: Endpoint, body: Body) -> Response {
    let start = Instant::now();
    let defaults = app.options.sampling.clone();
    let parsed = request_body::read_body(body)
        .await
        .and_then(|b| match endpoint {
            Endpoint::Chat => chat_conversation(&b, &defaults),
            Endpoint::Generate => generate_conversation(&b, &defaults),
        });
    let conversation = match parsed {
        Ok(Some(c)) => c,
        Ok(None) => return load_acknowledgement(&app, endpoint),
        Err(e) => return error_response(e),
    };
    let stream = conversation.params.stream;
    let logprobs = conversation.params.logprobs.is_some();
    let turn = match conversation::start(&app, conversation).await {
        Ok(t) => t,
        Err(e) => return error_response(e),
    };
    let writer = Writer {
        endpoint,
        model: turn.model.clone(),
        start,
    };
    if stream {
        return ndjson_response(writer, turn, logprobs);
    }
    match turn.collect().await {
        Ok((reply, outcome)) => {
            let mut body = writer.reply(&reply);
            writer.finish(&mut body, &outcome);
            if logprobs {
                body["logprobs"] = json!(outcome.logprobs);
            }
            generated_response(body)
        }
        Err(e) => error_response(e),
    }
}

/// What an empty `messages` or `prompt` gets once the model is loaded: Ollama's answer
/// to a request that only loads the model.
fn load_acknowledgement(app: &App, endpoint: Endpoint) -> Response {
    if let Err(e) = app.engine() {
        return error_response(e);
    }
    let writer = Writer {
        endpoint,
        model: app.options.model_id.clone(),
        start: Instant::now(),
    };
    let mut body = writer.reply(&Reply::default());
    body["done"] = json!(true);
    body["done_reason"] = json!("load");
    Json(body).into_response()
}

/// Writes one request's lines.
struct Writer {
    endpoint: Endpoint,
    model: String,
    start: Instant,
}

impl Writer {
    /// A line (or the whole response) carrying `reply`'s parts, not yet done.
    fn reply(&self, reply: &Reply) -> Value {
        let mut line = json!({
            "model": self.model,
            "created_at": now_rfc3339(),
        });
        match self.endpoint {
            Endpoint::Chat => {
                let mut message = json!({ "role": "assistant", "content": reply.content });
                if !reply.reasoning.is_empty() {
                    message["thinking"] = json!(reply.reasoning);
                }
                if !reply.tool_calls.is_empty() {
                    message["tool_calls"] = reply.tool_calls.iter().map(tool_call).collect();
                }
                line["message"] = message;
            }
            Endpoint::Generate => {
                line["response"] = json!(reply.content);
                if !reply.reasoning.is_empty() {
                    line["thinking"] = json!(reply.reasoning);
                }
            }
        }
        line["done"] = json!(false);
        line
    }

    /// Marks `line` as the last, with the reason and the timings (nanoseconds).
    fn finish(&self, line: &mut Value, outcome: &Outcome) {
        let ns = |s: f64| (s * 1e9).round() as u64;
        let s = &outcome.stats;
        line["done"] = json!(true);
        line["done_reason"] = json!(match outcome.finish.openai() {
            "length" => "length",
            _ => "stop",
        });
        line["total_duration"] = json!(self.start.elapsed().as_nanos() as u64);
        line["load_duration"] = json!(0);
        // The tokens evaluated, as Ollama counts them: a prefix continued from a kept
        // state is not (and its duration covers only these).
        line["prompt_eval_count"] = json!(s.prefill_tokens);
        line["prompt_eval_duration"] = json!(ns(s.prefill_seconds));
        line["eval_count"] = json!(outcome.completion_tokens);
        line["eval_duration"] = json!(ns(s.decode_seconds));
    }
}

/// A parsed call as Ollama's `tool_calls` entry (arguments as an object).
fn tool_call(call: &FunctionCall) -> Value {
    let arguments: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
    json!({ "function": { "name": call.name, "arguments": arguments } })
}

/// JSON lines, one per part, then the last with `done: true`; an error after the first
/// line is a last line `{"error": ...}`, as Ollama's stream ends on one. With `logprobs`,
/// each line carries the log-probabilities of the tokens since the last line.
fn ndjson_response(writer: Writer, turn: Turn, logprobs: bool) -> Response {
    let mut pending = Vec::new();
    let frames = move |event: TurnEvent| -> Vec<Value> {
        let mut with_logprobs = |mut line: Value| {
            if logprobs {
                line["logprobs"] = json!(std::mem::take(&mut pending));
            }
            line
        };
        match event {
            TurnEvent::Logprobs(l) => {
                pending.extend(l);
                Vec::new()
            }
            TurnEvent::Part(part) => {
                let mut reply = Reply::default();
                reply.extend([part]);
                vec![with_logprobs(writer.reply(&reply))]
            }
            TurnEvent::Done(outcome) => {
                let mut last = writer.reply(&Reply::default());
                writer.finish(&mut last, &outcome);
                vec![with_logprobs(last)]
            }
            TurnEvent::Failed(e) => vec![json!({ "error": e.message })],
        }
    };
    let lines = turn_frames(turn, Vec::new(), frames)
        .map(|line| Ok::<_, std::convert::Infallible>(format!("{line}\n")));
    let mut response = (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response();
    response.extensions_mut().insert(Logged);
    response
}

/// `now` as RFC 3339 with nanoseconds, as Ollama writes `created_at`.
fn now_rfc3339() -> String {
    humantime::format_rfc3339_nanos(SystemTime::now()).to_string()
}

/// What `/api/tags`, `/api/show` and `/api/ps` say of the model in `app`.
struct ModelFacts {
    config: crate::config::ModelConfig,
    /// Bytes of the checkpoint's files.
    size: u64,
    modified: SystemTime,
    digest: String,
}

impl ModelFacts {
    /// Errors: 503 while loading; the config no longer reads (500).
    fn of(app: &App) -> Result<Self, ApiError> {
        let dir = app.engine()?.dir().to_path_buf();
        let config = crate::config::ModelConfig::load(&dir).map_err(|e| ApiError::engine(&e))?;
        let (mut size, mut modified) = (0, SystemTime::UNIX_EPOCH);
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if let Some(meta) = entry.metadata().ok().filter(|m| m.is_file()) {
                size += meta.len();
                modified = modified.max(meta.modified().unwrap_or(SystemTime::UNIX_EPOCH));
            }
        }
        let config_bytes = std::fs::read(dir.join("config.json")).unwrap_or_default();
        let digest = format!(
            "{:x}",
            <sha2::Sha256 as sha2::Digest>::digest(&config_bytes)
        );
        Ok(ModelFacts {
            config,
            size,
            modified,
            digest,
        })
    }

    /// Ollama's `details`.
    fn details(&self) -> Value {
        let c = &self.config;
        let level = match &c.quantization.default {
            Some(q) => format!("Q{}", q.bits),
            None => "BF16".into(),
        };
        json!({
            "parent_model": "",
            "format": "safetensors",
            "family": c.model_type,
            "families": [c.model_type],
            "parameter_size": "",
            "quantization_level": level,
        })
    }

    /// One model entry of `/api/tags` or `/api/ps` named `name`.
    fn entry(&self, name: &str) -> Value {
        json!({
            "name": name,
            "model": name,
            "modified_at": humantime::format_rfc3339_seconds(self.modified).to_string(),
            "size": self.size,
            "digest": self.digest,
            "details": self.details(),
        })
    }
}

/// The served names: the model's, then its aliases.
fn names(app: &App) -> impl Iterator<Item = &String> {
    std::iter::once(&app.options.model_id).chain(&app.options.aliases)
}

/// `GET /api/tags`: the served names.
pub async fn tags(State(app): State<Arc<App>>) -> Response {
    match ModelFacts::of(&app) {
        Ok(facts) => {
            let models: Vec<Value> = names(&app).map(|n| facts.entry(n)).collect();
            Json(json!({ "models": models })).into_response()
        }
        Err(e) => error_response(e),
    }
}

/// The loaded model, with what it holds in memory (`size`: the memory plan's budget
/// when a plan sized the pool, else the checkpoint's bytes, mapped) and its context.
pub async fn ps(State(app): State<Arc<App>>) -> Response {
    let facts = match ModelFacts::of(&app) {
        Ok(f) => f,
        Err(e) => return error_response(e),
    };
    let Ok(engine) = app.engine() else {
        return error_response(ApiError::loading());
    };
    let size = engine.plan().map_or(facts.size, |p| p.budget);
    let mut entry = facts.entry(&app.options.model_id);
    entry["size"] = json!(size);
    entry["size_vram"] = json!(0);
    entry["context_length"] = json!(engine.context());
    // Loaded until the server stops.
    entry["expires_at"] = json!("2318-01-01T00:00:00Z");
    Json(json!({ "models": [entry] })).into_response()
}

#[derive(Deserialize)]
struct ShowBody {
    model: Option<String>,
    /// The older clients' name for `model`.
    name: Option<String>,
}

/// The model's details, its geometry as `model_info`, its chat template, capabilities
/// and slotstream's memory plan and context. 404 for a name this server does not serve.
pub async fn show(State(app): State<Arc<App>>, body: Body) -> Response {
    let parsed = request_body::read_body(body)
        .await
        .and_then(|b| typed::<ShowBody>(&parse_object(&b)?, ""));
    let name = match parsed {
        Ok(ShowBody { model: Some(m), .. } | ShowBody { name: Some(m), .. }) => m,
        Ok(_) => return error_response(ApiError::invalid("model", "missing")),
        Err(e) => return error_response(e),
    };
    if !names(&app).any(|n| *n == name || format!("{n}:latest") == name) {
        return error_response(ApiError::not_found(format!("model '{name}' not found")));
    }
    let (facts, engine) = match ModelFacts::of(&app).and_then(|f| Ok((f, app.engine()?))) {
        Ok(f) => f,
        Err(e) => return error_response(e),
    };
    let c = &facts.config;
    let arch = c.model_type.as_str();
    let mut info = Map::new();
    for (key, value) in [
        ("general.architecture".to_string(), json!(arch)),
        (format!("{arch}.context_length"), json!(engine.context())),
        (format!("{arch}.embedding_length"), json!(c.hidden_size)),
        (format!("{arch}.block_count"), json!(c.num_hidden_layers)),
        (format!("{arch}.expert_count"), json!(c.num_experts)),
        (
            format!("{arch}.expert_used_count"),
            json!(c.num_experts_per_tok),
        ),
        (
            format!("{arch}.attention.head_count"),
            json!(c.num_attention_heads),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            json!(c.num_key_value_heads),
        ),
        (format!("{arch}.vocab_size"), json!(c.vocab_size)),
    ] {
        info.insert(key, value);
    }
    let template = engine.template().ok().flatten();
    let mut capabilities = vec!["completion"];
    if template.is_some_and(|t| t.tool_call_format().is_some()) {
        capabilities.push("tools");
    }
    if template.is_some_and(|t| t.has_thinking_switch()) {
        capabilities.push("thinking");
    }
    Json(json!({
        "modelfile": "",
        "parameters": "",
        "template": template.map_or("", |t| t.source()),
        "details": facts.details(),
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": humantime::format_rfc3339_seconds(facts.modified).to_string(),
        "context_length": engine.context(),
        "memory_plan": engine.plan(),
    }))
    .into_response()
}

/// `GET /api/version`: the Ollama API version this follows, and slotstream's.
pub async fn version() -> Json<Value> {
    Json(json!({ "version": OLLAMA_VERSION, "slotstream": env!("CARGO_PKG_VERSION") }))
}
