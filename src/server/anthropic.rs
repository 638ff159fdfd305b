//! Anthropic's Messages API (<https://docs.anthropic.com/en/api/messages>, the dialect of
//! Claude Code) on the conversation core: `POST /v1/messages`, streamed as Anthropic's
//! server-sent events or answered whole, and `POST /v1/messages/count_tokens`.
//!
//! A request maps onto the core as follows: `system` (a string or text blocks; Claude
//! Code's `x-anthropic-billing-header:` line is dropped, so its requests share a prefix
//! and the prompt cache stays warm) becomes the system message; `text` blocks are the
//! messages' text (concatenated, as the OpenAI dialect joins text parts); `tool_use`
//! blocks are the assistant's tool calls; `tool_result` blocks (text or text blocks;
//! `is_error` prefixes `Error: `) become `tool` messages, in their order; `thinking`
//! blocks are the assistant's reasoning, and their `signature` (a hash of the thinking
//! text that this server wrote) must match (a block signed elsewhere is dropped). A final
//! assistant message (a prefill) is refused. `tools` with `input_schema` render with the
//! chat template (server tools such as `web_search_*`, which have none, are dropped);
//! `tool_choice` auto, any, tool and none map to OpenAI's auto, required, a named function
//! and none (`disable_parallel_tool_use` keeps the reply's first call); `thinking` enabled or adaptive turns the template's thinking switch on,
//! disabled off (absent: the template's default). `max_tokens` is required; temperature,
//! top_p, top_k and `stop_sequences` apply; unknown fields are ignored. Images and
//! documents are refused with a 400.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::conversation::{self, Conversation, Finish, Outcome, Turn, TurnEvent};
use super::conversation::{check_tools, require_tools, MAX_STOPS};
use super::error::ApiError;
use super::openai::{parse_object, required, typed, Common, Stop};
use super::{generated_response, named_events, request_body, turn_frames, App, Named};
use crate::chat_template::{set_enable_thinking, Chat, ChatImage, Message, ToolCall, ToolChoice};
use crate::engine::Input;
use crate::reply::{FunctionCall, ReplyPart};
use crate::sampling::SamplingOptions;

const ROUTE: &str = "/v1/messages";

/// The line Claude Code puts first in its system prompt, different in every request.
const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// Anthropic's status and error type for `error`: a full queue (or a loading model) is
/// 529 `overloaded_error`.
fn status_and_kind(error: &ApiError) -> (StatusCode, &'static str) {
    match error.status.as_u16() {
        400 | 405 | 408 | 411 | 501 => (error.status, "invalid_request_error"),
        401 => (error.status, "authentication_error"),
        403 => (error.status, "permission_error"),
        404 => (error.status, "not_found_error"),
        413 => (error.status, "request_too_large"),
        429 => (error.status, "rate_limit_error"),
        503 | 529 => (
            StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error",
        ),
        _ => (error.status, "api_error"),
    }
}

/// `error` in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
pub fn error_response(error: ApiError) -> Response {
    let (status, kind) = status_and_kind(&error);
    error.respond(status, error_body(kind, &error.message))
}

fn error_body(kind: &str, message: &str) -> Value {
    json!({ "type": "error", "error": { "type": kind, "message": message } })
}

/// The error event a stream ends with when generation fails after its headers.
fn error_event(error: &ApiError) -> Named {
    let (_, kind) = status_and_kind(error);
    ("error".to_string(), error_body(kind, &error.message))
}

/// The fields a Messages request (and a token count) is read from.
#[derive(Debug, Deserialize)]
struct MessagesBody {
    model: Option<String>,
    max_tokens: Option<u64>,
    system: Option<Value>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    thinking: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct AnthropicMessage {
    role: String,
    content: Content,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Value>),
}

/// The signature of a thinking block: a hash of its text, so a block sent back is known to
/// be one this server wrote, unchanged (it survives a restart: no secret is involved).
fn signature(thinking: &str) -> String {
    let digest = Sha256::digest(format!("slotstream thinking\n{thinking}").as_bytes());
    format!("{SIGNATURE_PREFIX}{digest:x}")
}

/// What this server's thinking signatures start with.
const SIGNATURE_PREFIX: &str = "ss1.";

/// A text field of `block` (found at `path`).
fn block_text<'b>(block: &'b Value, field: &str, path: &str) -> Result<&'b str, ApiError> {
    block
        .get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid(&format!("{path}.{field}"), "missing or not a string"))
}

/// The conversation of a Messages body; `count` reads a token-count body (no
/// `max_tokens`). Errors name the field at fault.
pub fn conversation(
    body: &[u8],
    defaults: &SamplingOptions,
    count: bool,
) -> Result<Conversation, ApiError> {
    let value = parse_object(body)?;
    let b: MessagesBody = typed(&value, "")?;
    let messages: Vec<AnthropicMessage> = required(&value, "messages")?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "must not be empty"));
    }
    if !count && b.max_tokens.is_none() {
        return Err(ApiError::invalid("max_tokens", "missing"));
    }
    let mut chat = Chat::default();
    if let Some(system) = system_text(b.system.as_ref())? {
        chat.messages.push(Message::new("system", &system));
    }
    if messages.last().is_some_and(|m| m.role == "assistant") {
        return Err(ApiError::invalid(
            &format!("messages[{}]", messages.len() - 1),
            "a final assistant message (a prefill to continue) is not supported: end with a user message",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        let path = format!("messages[{i}]");
        match m.role.as_str() {
            "user" => user_messages(&m.content, &path, &mut chat.messages)?,
            "assistant" => chat.messages.push(assistant_message(&m.content, &path)?),
            other => {
                return Err(ApiError::invalid(
                    &format!("{path}.role"),
                    &format!("`{other}` is not one of user, assistant"),
                ))
            }
        }
    }
    chat.tools = tools(b.tools.as_deref().unwrap_or_default())?;
    chat.tool_choice = tool_choice(b.tool_choice.as_ref(), &chat.tools)?;
    chat.single_tool_call = b
        .tool_choice
        .as_ref()
        .and_then(|c| c.get("disable_parallel_tool_use"))
        == Some(&Value::Bool(true));
    match b
        .thinking
        .as_ref()
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
    {
        None => {}
        Some("enabled" | "adaptive") => set_enable_thinking(&mut chat.kwargs, true)
            .map_err(|e| ApiError::invalid("thinking", &e))?,
        Some("disabled") => set_enable_thinking(&mut chat.kwargs, false)
            .map_err(|e| ApiError::invalid("thinking", &e))?,
        Some(other) => {
            return Err(ApiError::invalid(
                "thinking.type",
                &format!("`{other}` is not one of enabled, adaptive, disabled"),
            ))
        }
    }
    let common = Common {
        model: b.model,
        max_tokens: b.max_tokens,
        temperature: b.temperature,
        top_p: b.top_p,
        top_k: b.top_k,
        stop: b.stop_sequences.map(Stop::Many),
        stream: b.stream,
        ..Default::default()
    };
    let params = common
        .params(defaults, MAX_STOPS)
        .map_err(|e| e.renamed("stop", "stop_sequences"))?;
    Ok(Conversation {
        input: Input::Chat(chat),
        params,
        route: ROUTE,
    })
}

/// `system`: a string or text blocks, without Claude Code's billing line.
fn system_text(system: Option<&Value>) -> Result<Option<String>, ApiError> {
    let text = match system {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => {
            let mut parts = Vec::new();
            for (i, block) in blocks.iter().enumerate() {
                parts.push(block_text(block, "text", &format!("system[{i}]"))?);
            }
            parts.join("\n")
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "system",
                "must be a string or a list of text blocks",
            ))
        }
    };
    let kept: Vec<&str> = text
        .split_inclusive('\n')
        .filter(|line| !line.starts_with(BILLING_HEADER))
        .collect();
    let kept = kept.concat();
    Ok((!kept.trim().is_empty()).then_some(kept))
}

/// A user turn: its `tool_result` blocks as `tool` messages and its text as a user
/// message, in the order they come.
fn user_messages(content: &Content, path: &str, out: &mut Vec<Message>) -> Result<(), ApiError> {
    let blocks = match content {
        Content::Text(t) => {
            out.push(Message::new("user", t));
            return Ok(());
        }
        Content::Blocks(b) => b,
    };
    let mut text = String::new();
    let mut images = Vec::new();
    let user = |text: &mut String, images: &mut Vec<ChatImage>| Message {
        images: std::mem::take(images),
        ..Message::new("user", &std::mem::take(text))
    };
    for (j, block) in blocks.iter().enumerate() {
        let at = format!("{path}.content[{j}]");
        match block.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(block_text(block, "text", &at)?),
            Some("image") => images.push(ChatImage {
                at: text.len(),
                bytes: image_block(block, &at)?,
            }),
            Some("tool_result") => {
                if !text.is_empty() || !images.is_empty() {
                    out.push(user(&mut text, &mut images));
                }
                let id = block_text(block, "tool_use_id", &at)?;
                let mut result = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => {
                        let mut s = String::new();
                        for (k, part) in parts.iter().enumerate() {
                            let at = format!("{at}.content[{k}]");
                            match part.get("type").and_then(Value::as_str) {
                                Some("text") => s.push_str(block_text(part, "text", &at)?),
                                other => return Err(unsupported_block(&at, other)),
                            }
                        }
                        s
                    }
                    Some(_) => {
                        return Err(ApiError::invalid(
                            &format!("{at}.content"),
                            "must be a string or a list of text blocks",
                        ))
                    }
                };
                if block.get("is_error") == Some(&Value::Bool(true)) {
                    result = format!("Error: {result}");
                }
                out.push(Message {
                    role: "tool".into(),
                    content: result,
                    tool_call_id: Some(id.to_string()),
                    ..Default::default()
                });
            }
            other => return Err(unsupported_block(&at, other)),
        }
    }
    if !text.is_empty() || !images.is_empty() || blocks.is_empty() {
        out.push(user(&mut text, &mut images));
    }
    Ok(())
}

/// An image block's bytes: its `source` must be `{"type": "base64", "data": ...}` (the
/// server fetches no URL). Errors: 400 naming the field.
fn image_block(block: &Value, at: &str) -> Result<Arc<[u8]>, ApiError> {
    let source = block.get("source");
    match source.and_then(|s| s.get("type")).and_then(Value::as_str) {
        Some("base64") => {
            let data = source.and_then(|s| s.get("data")).and_then(Value::as_str);
            let data =
                data.ok_or_else(|| ApiError::invalid(&format!("{at}.source.data"), "missing"))?;
            conversation::image_base64(&format!("{at}.source.data"), data)
        }
        Some("url") => Err(ApiError::invalid(
            &format!("{at}.source"),
            "image URLs are not fetched: send the image as base64",
        )),
        Some(other) => Err(ApiError::invalid(
            &format!("{at}.source.type"),
            &format!("`{other}` image sources are not supported (base64)"),
        )),
        None => Err(ApiError::invalid(&format!("{at}.source.type"), "missing")),
    }
}

/// An assistant turn: text, reasoning from `thinking` blocks (checked against their
/// signatures), tool calls from `tool_use` blocks.
fn assistant_message(content: &Content, path: &str) -> Result<Message, ApiError> {
    let mut message = Message::new("assistant", "");
    let blocks = match content {
        Content::Text(t) => {
            message.content = t.clone();
            return Ok(message);
        }
        Content::Blocks(b) => b,
    };
    let mut reasoning = String::new();
    for (j, block) in blocks.iter().enumerate() {
        let at = format!("{path}.content[{j}]");
        match block.get("type").and_then(Value::as_str) {
            Some("text") => message.content.push_str(block_text(block, "text", &at)?),
            Some("thinking") => {
                let thinking = block_text(block, "thinking", &at)?;
                match block.get("signature").and_then(Value::as_str) {
                    // Another server's block (a conversation begun elsewhere): its text
                    // may be a summary this model never wrote, so it is not rendered.
                    Some(sig) if !sig.starts_with(SIGNATURE_PREFIX) => {
                        tracing::debug!("a thinking block signed elsewhere is dropped");
                    }
                    Some(sig) if sig != signature(thinking) => {
                        return Err(ApiError::invalid(
                            &format!("{at}.signature"),
                            "does not match the thinking text: the block was edited",
                        ));
                    }
                    _ => reasoning.push_str(thinking),
                }
            }
            // Nothing to render: this server never redacts.
            Some("redacted_thinking") => {}
            Some("tool_use") => {
                let name = block_text(block, "name", &at)?;
                let input = match block.get("input") {
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(v @ Value::Object(_)) => v.clone(),
                    Some(_) => {
                        return Err(ApiError::invalid(
                            &format!("{at}.input"),
                            "must be an object",
                        ))
                    }
                };
                message.tool_calls.push(ToolCall {
                    id: block.get("id").and_then(Value::as_str).map(String::from),
                    name: name.to_string(),
                    arguments: input,
                });
            }
            other => return Err(unsupported_block(&at, other)),
        }
    }
    message.reasoning_content = (!reasoning.is_empty()).then_some(reasoning);
    Ok(message)
}

fn unsupported_block(at: &str, kind: Option<&str>) -> ApiError {
    match kind {
        Some("image") => ApiError::invalid(at, "images go in user messages"),
        Some(kind) => ApiError::invalid(
            &format!("{at}.type"),
            &format!("`{kind}` blocks are not supported here"),
        ),
        None => ApiError::invalid(&format!("{at}.type"), "missing"),
    }
}

/// Anthropic tools (`name`, `description`, `input_schema`) in the OpenAI shape the
/// template renders; server tools (no `input_schema`) are dropped.
fn tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let Some(schema) = tool.get("input_schema") else {
            let kind = tool.get("type").cloned().unwrap_or_default();
            tracing::debug!(tool = %kind, "a server tool is dropped");
            continue;
        };
        let name = block_text(tool, "name", &format!("tools[{i}]"))?;
        // In the order OpenAI's clients send a function's keys, which the template prints.
        let mut function = json!({ "name": name });
        if let Some(d) = tool.get("description") {
            function["description"] = d.clone();
        }
        function["parameters"] = schema.clone();
        out.push(json!({ "type": "function", "function": function }));
    }
    check_tools(&out)?;
    Ok(out)
}

/// `tool_choice` as the core's.
fn tool_choice(choice: Option<&Value>, tools: &[Value]) -> Result<ToolChoice, ApiError> {
    let choice = match choice.and_then(|c| c.get("type")).and_then(Value::as_str) {
        None | Some("auto") => ToolChoice::Auto,
        Some("none") => ToolChoice::None,
        Some("any") => ToolChoice::Required,
        Some("tool") => match choice.and_then(|c| c.get("name")).and_then(Value::as_str) {
            Some(name) => ToolChoice::Function(name.to_string()),
            None => return Err(ApiError::invalid("tool_choice.name", "missing")),
        },
        Some(other) => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                &format!("`{other}` is not one of auto, any, tool, none"),
            ))
        }
    };
    require_tools(&choice, tools)?;
    Ok(choice)
}

/// `POST /v1/messages`.
pub async fn messages(State(app): State<Arc<App>>, body: Body) -> Response {
    let parsed = request_body::read_body(body)
        .await
        .and_then(|b| conversation(&b, &app.options.sampling, false));
    let conversation = match parsed {
        Ok(c) => c,
        Err(e) => return error_response(e),
    };
    let stream = conversation.params.stream;
    let turn = match conversation::start(&app, conversation).await {
        Ok(t) => t,
        Err(e) => return error_response(e),
    };
    let id = format!("msg_{:024x}", rand::random::<u128>() >> 32);
    if stream {
        return stream_response(id, turn);
    }
    let (model, prompt_tokens) = (turn.model.clone(), turn.prompt_tokens);
    match turn.collect().await {
        Ok((reply, outcome)) => {
            let mut content = Vec::new();
            if !reply.reasoning.is_empty() {
                content.push(thinking_block(&reply.reasoning));
            }
            if !reply.content.is_empty() {
                content.push(json!({ "type": "text", "text": reply.content }));
            }
            content.extend(reply.tool_calls.iter().map(tool_use_block));
            let (stop_reason, stop_sequence) = stop_reason(&outcome.finish);
            generated_response(json!({
                "id": id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": content,
                "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": usage(prompt_tokens, &outcome),
            }))
        }
        Err(e) => error_response(e),
    }
}

/// `{"input_tokens": N}`: the rendered prompt's tokens.
pub async fn count_tokens(State(app): State<Arc<App>>, body: Body) -> Response {
    let parsed = request_body::read_body(body)
        .await
        .and_then(|b| conversation(&b, &app.options.sampling, true));
    let counted = match parsed {
        Ok(c) => conversation::count_tokens(&app, c.input).await,
        Err(e) => Err(e),
    };
    match counted {
        Ok(n) => Json(json!({ "input_tokens": n })).into_response(),
        Err(e) => error_response(e),
    }
}

fn stop_reason(finish: &Finish) -> (&'static str, Value) {
    match finish {
        Finish::EndOfTurn => ("end_turn", Value::Null),
        Finish::StopSequence(s) => ("stop_sequence", json!(s)),
        Finish::Length => ("max_tokens", Value::Null),
        Finish::ToolCalls => ("tool_use", Value::Null),
    }
}

/// Token counts: prompt tokens continued from a kept state are `cache_read_input_tokens`,
/// the rest `input_tokens`, as Anthropic counts cached prefixes.
fn usage(prompt_tokens: usize, outcome: &Outcome) -> Value {
    let reused = outcome.stats.reused_prompt_tokens.min(prompt_tokens);
    json!({
        "input_tokens": prompt_tokens - reused,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": reused,
        "output_tokens": outcome.completion_tokens,
    })
}

fn thinking_block(text: &str) -> Value {
    json!({ "type": "thinking", "thinking": text, "signature": signature(text) })
}

fn tool_use_block(call: &FunctionCall) -> Value {
    let input: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
    json!({
        "type": "tool_use",
        "id": format!("toolu_{:024x}", rand::random::<u128>() >> 32),
        "name": call.name,
        "input": input,
    })
}

/// The kind of content block a stream has open.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
}

/// Turns a turn's events into Anthropic's stream: `message_start`, `ping`, then for each
/// content block `content_block_start`, its deltas and `content_block_stop` (a thinking
/// block's `signature_delta` before its stop; a tool call as one `input_json_delta`), then
/// `message_delta` with the stop reason and usage, and `message_stop`.
struct Blocks {
    index: usize,
    open: Option<Open>,
    thinking: String,
    prompt_tokens: usize,
}

fn event(name: &str, data: Value) -> Named {
    (name.to_string(), data)
}

impl Blocks {
    fn close(&mut self, out: &mut Vec<Named>) {
        let Some(open) = self.open.take() else {
            return;
        };
        if open == Open::Thinking {
            let signature = signature(&std::mem::take(&mut self.thinking));
            out.push(event(
                "content_block_delta",
                json!({ "type": "content_block_delta", "index": self.index,
                        "delta": { "type": "signature_delta", "signature": signature } }),
            ));
        }
        out.push(event(
            "content_block_stop",
            json!({ "type": "content_block_stop", "index": self.index }),
        ));
        self.index += 1;
    }

    /// Opens a block of `kind` unless one is open, closing another kind first.
    fn open(&mut self, kind: Open, out: &mut Vec<Named>) {
        if self.open == Some(kind) {
            return;
        }
        self.close(out);
        let block = match kind {
            Open::Thinking => json!({ "type": "thinking", "thinking": "", "signature": "" }),
            Open::Text => json!({ "type": "text", "text": "" }),
        };
        out.push(event(
            "content_block_start",
            json!({ "type": "content_block_start", "index": self.index, "content_block": block }),
        ));
        self.open = Some(kind);
    }

    fn frames(&mut self, event_: TurnEvent) -> Vec<Named> {
        let mut out = Vec::new();
        match event_ {
            // Anthropic's API has no log-probabilities (a request cannot ask for them).
            TurnEvent::Logprobs(_) => {}
            TurnEvent::Part(ReplyPart::Reasoning(t)) => {
                self.open(Open::Thinking, &mut out);
                self.thinking.push_str(&t);
                out.push(event(
                    "content_block_delta",
                    json!({ "type": "content_block_delta", "index": self.index,
                            "delta": { "type": "thinking_delta", "thinking": t } }),
                ));
            }
            TurnEvent::Part(ReplyPart::Content(t)) => {
                self.open(Open::Text, &mut out);
                out.push(event(
                    "content_block_delta",
                    json!({ "type": "content_block_delta", "index": self.index,
                            "delta": { "type": "text_delta", "text": t } }),
                ));
            }
            TurnEvent::Part(ReplyPart::ToolCall(call)) => {
                self.close(&mut out);
                let mut block = tool_use_block(&call);
                let input = std::mem::replace(&mut block["input"], json!({}));
                out.push(event(
                    "content_block_start",
                    json!({ "type": "content_block_start", "index": self.index, "content_block": block }),
                ));
                out.push(event(
                    "content_block_delta",
                    json!({ "type": "content_block_delta", "index": self.index,
                            "delta": { "type": "input_json_delta", "partial_json": input.to_string() } }),
                ));
                out.push(event(
                    "content_block_stop",
                    json!({ "type": "content_block_stop", "index": self.index }),
                ));
                self.index += 1;
            }
            TurnEvent::Done(outcome) => {
                self.close(&mut out);
                let (stop_reason, stop_sequence) = stop_reason(&outcome.finish);
                out.push(event(
                    "message_delta",
                    json!({ "type": "message_delta",
                            "delta": { "stop_reason": stop_reason, "stop_sequence": stop_sequence },
                            "usage": usage(self.prompt_tokens, &outcome) }),
                ));
                out.push(event("message_stop", json!({ "type": "message_stop" })));
            }
            TurnEvent::Failed(e) => out.push(error_event(&e)),
        }
        out
    }
}

fn stream_response(id: String, turn: Turn) -> Response {
    let start = json!({
        "type": "message_start",
        "message": {
            "id": id, "type": "message", "role": "assistant", "model": turn.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": { "input_tokens": turn.prompt_tokens, "output_tokens": 0 },
        },
    });
    let first = vec![
        event("message_start", start),
        event("ping", json!({ "type": "ping" })),
    ];
    let mut blocks = Blocks {
        index: 0,
        open: None,
        thinking: String::new(),
        prompt_tokens: turn.prompt_tokens,
    };
    named_events(turn_frames(turn, first, move |e| blocks.frames(e)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::conversation::RequestStats;

    fn outcome(finish: Finish) -> Outcome {
        Outcome {
            completion_tokens: 7,
            finish,
            stats: RequestStats {
                reused_prompt_tokens: 3,
                ..Default::default()
            },
            logprobs: Vec::new(),
        }
    }

    /// Thinking, text and a call stream as three blocks in order: a thinking block closed
    /// by the signature of all its text, a text block, and a tool_use block whose input
    /// comes as one JSON delta; then the stop reason and usage.
    #[test]
    fn a_reply_streams_as_anthropic_blocks() {
        let mut blocks = Blocks {
            index: 0,
            open: None,
            thinking: String::new(),
            prompt_tokens: 10,
        };
        let call = FunctionCall {
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        };
        let mut events = Vec::new();
        for e in [
            TurnEvent::Part(ReplyPart::Reasoning("the user ".into())),
            TurnEvent::Part(ReplyPart::Reasoning("asks".into())),
            TurnEvent::Part(ReplyPart::Content("Checking.".into())),
            TurnEvent::Part(ReplyPart::ToolCall(call)),
            TurnEvent::Done(outcome(Finish::ToolCalls)),
        ] {
            events.extend(blocks.frames(e));
        }
        let kinds: Vec<String> = events
            .iter()
            .map(|(name, data)| {
                assert_eq!(data["type"], name.as_str());
                match data["delta"]["type"]
                    .as_str()
                    .or(data["content_block"]["type"].as_str())
                {
                    Some(t) => format!("{name}:{t}"),
                    None => name.clone(),
                }
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "content_block_start:thinking",
                "content_block_delta:thinking_delta",
                "content_block_delta:thinking_delta",
                "content_block_delta:signature_delta",
                "content_block_stop",
                "content_block_start:text",
                "content_block_delta:text_delta",
                "content_block_stop",
                "content_block_start:tool_use",
                "content_block_delta:input_json_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        assert_eq!(
            events[3].1["delta"]["signature"],
            signature("the user asks")
        );
        let indices: Vec<u64> = events
            .iter()
            .filter_map(|(_, d)| d["index"].as_u64())
            .collect();
        assert_eq!(indices, [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2]);
        let input: Value =
            serde_json::from_str(events[9].1["delta"]["partial_json"].as_str().unwrap()).unwrap();
        assert_eq!(input, json!({ "city": "Paris" }));
        assert_eq!(events[8].1["content_block"]["input"], json!({}));
        let delta = &events[11].1;
        assert_eq!(delta["delta"]["stop_reason"], "tool_use");
        assert_eq!(
            delta["usage"],
            json!({ "input_tokens": 7, "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 3, "output_tokens": 7 })
        );
    }

    #[test]
    fn stop_reasons_and_error_shapes() {
        assert_eq!(stop_reason(&Finish::EndOfTurn).0, "end_turn");
        assert_eq!(stop_reason(&Finish::Length).0, "max_tokens");
        assert_eq!(
            stop_reason(&Finish::StopSequence("END".into())),
            ("stop_sequence", json!("END"))
        );
        let (name, data) = error_event(&ApiError::busy(4));
        assert_eq!(name, "error");
        assert_eq!(data["error"]["type"], "overloaded_error");
        let r = error_response(ApiError::busy(4));
        assert_eq!(r.status().as_u16(), 529);
        assert_eq!(
            error_response(ApiError::unauthorized()).status().as_u16(),
            401
        );
    }

    #[test]
    fn the_billing_line_is_dropped_and_blocks_joined() {
        let system = json!([
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=abc;"},
            {"type": "text", "text": "You are a helpful assistant.", "cache_control": {"type": "ephemeral"}},
        ]);
        assert_eq!(
            system_text(Some(&system)).unwrap().as_deref(),
            Some("You are a helpful assistant.")
        );
        assert_eq!(system_text(Some(&json!(BILLING_HEADER))).unwrap(), None);
    }

    #[test]
    fn signatures_round_trip_and_edits_are_refused() {
        let thinking = "the user wants the weather";
        let block = |sig: &str| {
            Content::Blocks(vec![
                json!({"type": "thinking", "thinking": thinking, "signature": sig}),
                json!({"type": "text", "text": "Checking."}),
            ])
        };
        let m = assistant_message(&block(&signature(thinking)), "messages[1]").unwrap();
        assert_eq!(m.reasoning_content.as_deref(), Some(thinking));
        assert_eq!(m.content, "Checking.");
        let edited = signature("something else");
        let e = assistant_message(&block(&edited), "messages[1]").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].content[0].signature"));
        // A block signed by another server (a conversation begun elsewhere) is dropped.
        let m = assistant_message(&block("EqQBCgIYAhIM1gbcDa9GJwZA2b3h"), "messages[1]").unwrap();
        assert_eq!(
            (m.reasoning_content, m.content.as_str()),
            (None, "Checking.")
        );
    }

    #[test]
    fn a_final_assistant_prefill_is_refused() {
        let body = json!({ "max_tokens": 4, "messages": [
            { "role": "user", "content": "Give JSON" },
            { "role": "assistant", "content": "{\"a\":" },
        ] });
        let e = conversation(
            body.to_string().as_bytes(),
            &SamplingOptions::default(),
            false,
        )
        .err()
        .unwrap();
        assert_eq!(e.param.as_deref(), Some("messages[1]"));
        let many = json!({ "max_tokens": 4, "stop_sequences": vec!["a"; 17],
                           "messages": [{ "role": "user", "content": "x" }] });
        let e = conversation(
            many.to_string().as_bytes(),
            &SamplingOptions::default(),
            false,
        )
        .err()
        .unwrap();
        assert_eq!(e.param.as_deref(), Some("stop_sequences"));
        assert!(
            e.message.starts_with("stop_sequences: at most 16"),
            "{}",
            e.message
        );
    }

    #[test]
    fn tool_results_become_tool_messages_in_order() {
        let content = Content::Blocks(vec![
            json!({"type": "tool_result", "tool_use_id": "toolu_1", "content": "14 C"}),
            json!({"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
                   "content": [{"type": "text", "text": "no such city"}]}),
            json!({"type": "text", "text": "And tomorrow?"}),
        ]);
        let mut out = Vec::new();
        user_messages(&content, "messages[2]", &mut out).unwrap();
        let got: Vec<(&str, &str, Option<&str>)> = out
            .iter()
            .map(|m| {
                (
                    m.role.as_str(),
                    m.content.as_str(),
                    m.tool_call_id.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("tool", "14 C", Some("toolu_1")),
                ("tool", "Error: no such city", Some("toolu_2")),
                ("user", "And tomorrow?", None),
            ]
        );
    }
}
