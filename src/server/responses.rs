//! OpenAI's Responses API (<https://platform.openai.com/docs/api-reference/responses>, the
//! dialect of Codex) on the conversation core: `POST /v1/responses`, answered whole or
//! streamed as its semantic events, and `GET /v1/responses/{id}` for a stored response.
//!
//! `input` is a string (one user message) or items: messages (`input_text` and
//! `output_text` parts; the `developer` role is a system message), `function_call`,
//! `function_call_output` (a `tool` message) and `reasoning` (its `reasoning_text` or
//! summary becomes the assistant's reasoning); the items of one assistant turn
//! (reasoning, message, function calls) make one assistant message. `instructions` is the
//! system message; function `tools` render with the chat template (other tool types are
//! dropped); `tool_choice`, `parallel_tool_calls` (false keeps the first call), `max_output_tokens`, temperature and top_p apply;
//! `reasoning.effort` `none` or `minimal` turns the template's thinking switch off, any
//! other effort on. Output items are `reasoning` (`reasoning_text` content), `message`
//! (`output_text`) and `function_call`. A response is stored unless `store: false`, in a
//! bounded store of recent ones ([`Store`]), and `previous_response_id` continues its
//! conversation (404 once it has left the store). `text.format` `json_object` or
//! `json_schema` constrains the reply ([`crate::constraint`]). `include:
//! ["message.output_text.logprobs"]` with `top_logprobs` (0 to 20) adds the message text's
//! log-probabilities to its `output_text` part and its delta and done events, in OpenAI's
//! shape (as vLLM, `top_logprobs` alone asks for nothing). Images are refused with a 400.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::conversation::{self, Conversation, Finish, Outcome, TokenLogprob, Turn, TurnEvent};
use super::conversation::{
    check_tools, ended_early, image_url, require_tools, template_role, thinks_at, GrammarField,
    MAX_STOPS,
};
use super::error::ApiError;
use super::openai::{parse_object, required, typed, Common};
use super::{generated_response, named_events, request_body, turn_frames, unix_now, App, Named};
use crate::chat_template::{set_enable_thinking, Chat, ChatImage, Message, ToolCall, ToolChoice};
use crate::constraint::Grammar;
use crate::engine::Input;
use crate::reply::{FunctionCall, ReplyPart};
use crate::sampling::SamplingOptions;

const ROUTE: &str = "/v1/responses";

/// Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
const STORE_RESPONSES: usize = 256;
/// Bytes of conversation text the store keeps at most (older responses leave first).
const STORE_BYTES: usize = 64 << 20;

/// Recent responses, oldest first out, bounded by count and bytes.
#[derive(Default)]
pub struct Store(Mutex<StoreInner>);

#[derive(Default)]
struct StoreInner {
    order: VecDeque<String>,
    entries: HashMap<String, Stored>,
    bytes: usize,
}

#[derive(Clone)]
struct Stored {
    /// The conversation up to and including this response's output, without its
    /// instructions (a follow-up gives its own).
    messages: Vec<Message>,
    response: Value,
    bytes: usize,
}

impl Store {
    fn get(&self, id: &str) -> Option<Stored> {
        let inner = self.0.lock().unwrap_or_else(|e| e.into_inner());
        inner.entries.get(id).cloned()
    }

    fn put(&self, id: String, messages: Vec<Message>, response: Value) {
        // Everything kept, tool calls included, as it would be written out.
        let bytes =
            serde_json::to_string(&messages).map_or(0, |s| s.len()) + response.to_string().len();
        let mut inner = self.0.lock().unwrap_or_else(|e| e.into_inner());
        inner.bytes += bytes;
        inner.order.push_back(id.clone());
        inner.entries.insert(
            id,
            Stored {
                messages,
                response,
                bytes,
            },
        );
        while inner.order.len() > STORE_RESPONSES || inner.bytes > STORE_BYTES {
            let Some(old) = inner.order.pop_front() else {
                break;
            };
            if let Some(e) = inner.entries.remove(&old) {
                inner.bytes -= e.bytes;
            }
        }
    }
}

#[derive(Debug, Deserialize)]
struct ResponsesBody {
    model: Option<String>,
    instructions: Option<String>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    max_output_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    reasoning: Option<Value>,
    stream: Option<bool>,
    store: Option<bool>,
    previous_response_id: Option<String>,
    text: Option<Value>,
    include: Option<Vec<String>>,
    top_logprobs: Option<Value>,
}

/// The `include` entry that asks for the message text's log-probabilities.
const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

/// A request, translated: the conversation, and what its response echoes and stores.
pub struct Translated {
    /// What the core runs.
    pub conversation: Conversation,
    /// The messages to store (the conversation without the instructions).
    history: Vec<Message>,
    echo: Value,
    store: bool,
}

/// Where the next assistant-side item goes: the items of one assistant turn come in this
/// order (reasoning, then the message, then calls) and share one message.
fn rank(kind: &str) -> u8 {
    match kind {
        "reasoning" => 0,
        "message" => 1,
        _ => 2,
    }
}

/// The text of a message item's `content`: a string, or `input_text` / `output_text` /
/// `text` parts (concatenated, as the chat endpoint joins text parts).
fn content_text(
    content: Option<&Value>,
    at: &str,
    mut images: Option<&mut Vec<ChatImage>>,
) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (k, part) in parts.iter().enumerate() {
                let at = format!("{at}.content[{k}]");
                match part.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => text.push_str(
                        part.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| ApiError::invalid(&format!("{at}.text"), "missing"))?,
                    ),
                    Some("input_image") => {
                        let Some(images) = images.as_deref_mut() else {
                            return Err(ApiError::invalid(&at, "images go in user messages"));
                        };
                        let url =
                            (part.get("image_url").and_then(Value::as_str)).ok_or_else(|| {
                                ApiError::invalid(
                                    &format!("{at}.image_url"),
                                    "missing (file ids are not supported)",
                                )
                            })?;
                        images.push(ChatImage {
                            at: text.len(),
                            bytes: image_url(&format!("{at}.image_url"), url)?,
                        });
                    }
                    Some("input_file") => {
                        return Err(ApiError::invalid(
                            &at,
                            "files are not supported (text and images)",
                        ))
                    }
                    Some(other) => {
                        return Err(ApiError::invalid(
                            &format!("{at}.type"),
                            &format!("`{other}` parts are not supported"),
                        ))
                    }
                    None => return Err(ApiError::invalid(&format!("{at}.type"), "missing")),
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::invalid(
            &format!("{at}.content"),
            "must be a string or a list of parts",
        )),
    }
}

/// Appends the input `items` to `messages`.
fn push_items(items: &[Value], messages: &mut Vec<Message>) -> Result<(), ApiError> {
    // The rank of the last item merged into the last (assistant) message.
    let mut last_rank: Option<u8> = None;
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let field = |name: &str| -> Result<&str, ApiError> {
            item.get(name).and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(&format!("{at}.{name}"), "missing or not a string")
            })
        };
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        let role = item.get("role").and_then(Value::as_str);
        let assistant_side = match kind {
            "message" => role == Some("assistant"),
            "function_call" | "reasoning" => true,
            _ => false,
        };
        if !assistant_side {
            last_rank = None;
            match kind {
                "message" => {
                    let role = match role {
                        Some(r @ ("user" | "system" | "developer")) => template_role(r),
                        Some(other) => {
                            return Err(ApiError::invalid(
                                &format!("{at}.role"),
                                &format!(
                                    "`{other}` is not one of user, assistant, system, developer"
                                ),
                            ))
                        }
                        None => return Err(ApiError::invalid(&format!("{at}.role"), "missing")),
                    };
                    let mut images = Vec::new();
                    let text = content_text(item.get("content"), &at, Some(&mut images))?;
                    messages.push(Message {
                        images,
                        ..Message::new(role, &text)
                    });
                }
                "function_call_output" => {
                    let output = match item.get("output") {
                        Some(Value::String(s)) => s.clone(),
                        other => content_text(other, &format!("{at}.output"), None)?,
                    };
                    messages.push(Message {
                        role: "tool".into(),
                        content: output,
                        tool_call_id: Some(field("call_id")?.to_string()),
                        ..Default::default()
                    });
                }
                other => {
                    return Err(ApiError::invalid(
                        &format!("{at}.type"),
                        &format!("`{other}` items are not supported"),
                    ))
                }
            }
            continue;
        }
        let r = rank(kind);
        let continues = last_rank.is_some_and(|l| r >= l && !(r == 1 && l == 1))
            && messages.last().is_some_and(|m| m.role == "assistant");
        if !continues {
            messages.push(Message::new("assistant", ""));
        }
        last_rank = Some(r);
        let message = messages
            .last_mut()
            .expect("an assistant message was pushed");
        match kind {
            "message" => message.content = content_text(item.get("content"), &at, None)?,
            "reasoning" => {
                let mut text = String::new();
                for key in ["content", "summary"] {
                    for part in item
                        .get(key)
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                    {
                        if let Some(t) = part.get("text").and_then(Value::as_str) {
                            text.push_str(t);
                        }
                    }
                    if !text.is_empty() {
                        break;
                    }
                }
                if !text.is_empty() {
                    message.reasoning_content = Some(text);
                }
            }
            _ => {
                let arguments = field("arguments")?;
                message.tool_calls.push(ToolCall {
                    id: Some(field("call_id")?.to_string()),
                    name: field("name")?.to_string(),
                    arguments: ToolCall::arguments_from_text(arguments),
                });
            }
        }
    }
    Ok(())
}

/// Function tools (`{"type": "function", "name", "description", "parameters"}`) in the
/// chat shape the template renders; other tool types are dropped.
fn tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    for tool in tools {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            let kind = tool.get("type").cloned().unwrap_or_default();
            tracing::debug!(tool = %kind, "a non-function tool is dropped");
            continue;
        }
        let mut function = Map::new();
        for key in ["name", "description", "parameters", "strict"] {
            if let Some(v) = tool.get(key) {
                function.insert(key.into(), v.clone());
            }
        }
        out.push(json!({ "type": "function", "function": function }));
    }
    check_tools(&out)?;
    Ok(out)
}

fn tool_choice(choice: Option<&Value>, tools: &[Value]) -> Result<ToolChoice, ApiError> {
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => ToolChoice::None,
        Some(Value::String(s)) if s == "required" => ToolChoice::Required,
        Some(v) => match (v.get("type").and_then(Value::as_str), v.get("name").and_then(Value::as_str)) {
            (Some("function"), Some(name)) => ToolChoice::Function(name.to_string()),
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}",
                ))
            }
        },
    };
    require_tools(&choice, tools)?;
    Ok(choice)
}

/// The conversation of a Responses body, continuing a stored response when it names one.
/// Errors name the field at fault; 404 for a `previous_response_id` not in `store`.
pub fn translate(
    body: &[u8],
    defaults: &SamplingOptions,
    store: &Store,
) -> Result<Translated, ApiError> {
    let value = parse_object(body)?;
    let b: ResponsesBody = typed(&value, "")?;
    let input: Value = required(&value, "input")?;
    let format = b
        .text
        .as_ref()
        .and_then(|t| t.get("format"))
        .filter(|f| !f.is_null());
    let grammar = match format.map(|f| (f, f.get("type").and_then(Value::as_str))) {
        None | Some((_, Some("text"))) => None,
        Some((_, Some("json_object"))) => Some(Grammar::JsonObject),
        Some((f, Some("json_schema"))) => match f.get("schema") {
            Some(schema) => Some(Grammar::JsonSchema(schema.clone())),
            None => return Err(ApiError::invalid("text.format.schema", "missing")),
        },
        Some(_) => {
            return Err(ApiError::invalid(
                "text.format.type",
                "must be \"text\", \"json_object\" or \"json_schema\"",
            ))
        }
    };
    let mut history = match &b.previous_response_id {
        Some(id) => {
            store
                .get(id)
                .ok_or_else(|| ApiError::not_found(format!("no stored response `{id}` (responses are kept in memory, the last {STORE_RESPONSES} at most)")))?
                .messages
        }
        None => Vec::new(),
    };
    match &input {
        Value::String(s) => history.push(Message::new("user", s)),
        Value::Array(items) => push_items(items, &mut history)?,
        _ => {
            return Err(ApiError::invalid(
                "input",
                "must be a string or a list of items",
            ))
        }
    }
    if history.is_empty() {
        return Err(ApiError::invalid("input", "must not be empty"));
    }
    let mut chat = Chat::default();
    if let Some(instructions) = b.instructions.as_ref().filter(|s| !s.is_empty()) {
        chat.messages.push(Message::new("system", instructions));
    }
    chat.messages.extend(history.iter().cloned());
    chat.tools = tools(b.tools.as_deref().unwrap_or_default())?;
    chat.tool_choice = tool_choice(b.tool_choice.as_ref(), &chat.tools)?;
    chat.single_tool_call = b.parallel_tool_calls == Some(false);
    if let Some(effort) = b
        .reasoning
        .as_ref()
        .and_then(|r| r.get("effort"))
        .and_then(Value::as_str)
    {
        set_enable_thinking(&mut chat.kwargs, thinks_at(effort))
            .map_err(|e| ApiError::invalid("reasoning.effort", &e))?;
    }
    // As vLLM reads it: `top_logprobs` counts alternatives of the log-probabilities that
    // `include` asks for, and is ignored without them.
    let logprobs = b.include.iter().flatten().any(|i| i == INCLUDE_LOGPROBS);
    let common = Common {
        model: b.model.clone(),
        max_tokens: b.max_output_tokens,
        temperature: b.temperature,
        top_p: b.top_p,
        stream: b.stream,
        logprobs: logprobs.then_some(Value::Bool(true)),
        top_logprobs: b.top_logprobs.clone().filter(|_| logprobs),
        ..Default::default()
    };
    let mut params = common
        .params(defaults, MAX_STOPS)
        .map_err(|e| match e.param.as_deref() {
            Some("max_tokens") => ApiError::invalid("max_output_tokens", "must be at least 1"),
            _ => e,
        })?;
    params.grammar = grammar.map(|grammar| GrammarField {
        grammar,
        field: "text.format",
    });
    let echo = json!({
        "instructions": b.instructions,
        "max_output_tokens": b.max_output_tokens,
        "parallel_tool_calls": b.parallel_tool_calls.unwrap_or(true),
        "previous_response_id": b.previous_response_id,
        "reasoning": b.reasoning.unwrap_or(json!({ "effort": null, "summary": null })),
        "store": b.store.unwrap_or(true),
        "temperature": b.temperature.unwrap_or(params.sampling.temperature),
        "top_p": b.top_p.unwrap_or(params.sampling.top_p),
        "text": { "format": format.cloned().unwrap_or(json!({ "type": "text" })) },
        "top_logprobs": b.top_logprobs.as_ref().and_then(Value::as_u64).unwrap_or(0),
        "tool_choice": b.tool_choice.unwrap_or(json!("auto")),
        "tools": b.tools.unwrap_or_default(),
        "truncation": "disabled",
        "metadata": {},
    });
    Ok(Translated {
        conversation: Conversation {
            input: Input::Chat(chat),
            params,
            route: ROUTE,
        },
        history,
        echo,
        store: b.store.unwrap_or(true),
    })
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", rand::random::<u128>())
}

/// The output items of one response as its parts arrive, and the stream events that say
/// so: each item is added, filled by deltas and done before the next starts.
struct Items {
    /// Items done.
    done: Vec<Value>,
    /// The item being filled, and its text so far (message text or reasoning).
    open: Option<(Value, String)>,
    /// Log-probabilities of tokens whose text has not arrived as a part yet.
    pending: Vec<TokenLogprob>,
    /// The open message's log-probabilities so far (its `output_text` part's).
    logprobs: Vec<TokenLogprob>,
    sequence: u64,
    /// The response's fields besides its output and status.
    base: Value,
    prompt_tokens: usize,
}

impl Items {
    /// No item yet; events numbered from `sequence`.
    fn new(base: Value, prompt_tokens: usize, sequence: u64) -> Self {
        Items {
            done: Vec::new(),
            open: None,
            pending: Vec::new(),
            logprobs: Vec::new(),
            sequence,
            base,
            prompt_tokens,
        }
    }

    fn event(&mut self, kind: &str, mut data: Value) -> Named {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        (kind.to_string(), data)
    }

    /// The response object with `status`, the items done, and `usage` when known.
    fn response(&self, status: &str, outcome: Option<&Outcome>) -> Value {
        let mut r = self.base.clone();
        r["status"] = json!(status);
        r["output"] = json!(self.done);
        if let Some(o) = outcome {
            let reused = o.stats.reused_prompt_tokens.min(self.prompt_tokens);
            r["usage"] = json!({
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": { "cached_tokens": reused },
                "output_tokens": o.completion_tokens,
                "output_tokens_details": { "reasoning_tokens": 0 },
                "total_tokens": self.prompt_tokens + o.completion_tokens,
            });
            if o.finish == Finish::Length {
                r["incomplete_details"] = json!({ "reason": "max_output_tokens" });
            }
        }
        r
    }

    /// Closes the open item; `truncated`: the token limit cut it (a message is then
    /// `incomplete`).
    fn close(&mut self, out: &mut Vec<Named>, truncated: bool) {
        let Some((mut item, text)) = self.open.take() else {
            return;
        };
        let index = self.done.len();
        let id = item["id"].clone();
        let logprobs = std::mem::take(&mut self.logprobs);
        let mut done =
            json!({ "item_id": id, "output_index": index, "content_index": 0, "text": text });
        let (delta_done, part) = match item["type"].as_str() {
            Some("reasoning") => (
                "response.reasoning_text.done",
                json!({ "type": "reasoning_text", "text": text }),
            ),
            _ => {
                done["logprobs"] = json!(logprobs);
                (
                    "response.output_text.done",
                    json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": logprobs }),
                )
            }
        };
        out.push(self.event(delta_done, done));
        out.push(self.event(
            "response.content_part.done",
            json!({ "item_id": id, "output_index": index, "content_index": 0, "part": part }),
        ));
        item["content"] = json!([part]);
        if item["type"] == "message" {
            item["status"] = json!(if truncated { "incomplete" } else { "completed" });
        }
        out.push(self.event(
            "response.output_item.done",
            json!({ "output_index": index, "item": item }),
        ));
        self.done.push(item);
    }

    /// Adds text to an item of `kind` (`reasoning` or `message`), opening one if needed.
    fn text(&mut self, kind: &str, text: &str, out: &mut Vec<Named>) {
        if self
            .open
            .as_ref()
            .is_none_or(|(item, _)| item["type"] != kind)
        {
            self.close(out, false);
            let (item, part) = match kind {
                "reasoning" => (
                    json!({ "type": "reasoning", "id": new_id("rs"), "summary": [], "content": [] }),
                    json!({ "type": "reasoning_text", "text": "" }),
                ),
                _ => (
                    json!({ "type": "message", "id": new_id("msg"), "status": "in_progress",
                            "role": "assistant", "content": [] }),
                    json!({ "type": "output_text", "text": "", "annotations": [], "logprobs": [] }),
                ),
            };
            let index = self.done.len();
            let id = item["id"].clone();
            out.push(self.event(
                "response.output_item.added",
                json!({ "output_index": index, "item": item }),
            ));
            out.push(self.event(
                "response.content_part.added",
                json!({ "item_id": id, "output_index": index, "content_index": 0, "part": part }),
            ));
            self.open = Some((item, String::new()));
        }
        let index = self.done.len();
        let (item, so_far) = self.open.as_mut().expect("an item is open");
        so_far.push_str(text);
        let id = item["id"].clone();
        let delta = if kind == "reasoning" {
            "response.reasoning_text.delta"
        } else {
            "response.output_text.delta"
        };
        let mut data =
            json!({ "item_id": id, "output_index": index, "content_index": 0, "delta": text });
        if kind != "reasoning" {
            let logprobs = std::mem::take(&mut self.pending);
            data["logprobs"] = json!(logprobs);
            self.logprobs.extend(logprobs);
        }
        out.push(self.event(delta, data));
    }

    fn call(&mut self, call: &FunctionCall, out: &mut Vec<Named>) {
        self.close(out, false);
        let index = self.done.len();
        let id = new_id("fc");
        let mut item = json!({
            "type": "function_call", "id": id, "call_id": new_id("call"),
            "name": call.name, "arguments": "", "status": "in_progress",
        });
        out.push(self.event(
            "response.output_item.added",
            json!({ "output_index": index, "item": item }),
        ));
        out.push(self.event(
            "response.function_call_arguments.delta",
            json!({ "item_id": id, "output_index": index, "delta": call.arguments }),
        ));
        out.push(self.event(
            "response.function_call_arguments.done",
            json!({ "item_id": id, "output_index": index, "arguments": call.arguments, "name": call.name }),
        ));
        item["arguments"] = json!(call.arguments);
        item["status"] = json!("completed");
        out.push(self.event(
            "response.output_item.done",
            json!({ "output_index": index, "item": item }),
        ));
        self.done.push(item);
    }

    /// The events of one turn event; the final response when the turn ends (`Ok`), or
    /// its error.
    fn frames(&mut self, event: TurnEvent) -> (Vec<Named>, Option<Result<Value, ApiError>>) {
        let mut out = Vec::new();
        match event {
            TurnEvent::Logprobs(l) => self.pending.extend(l),
            // Only the message text has log-probabilities in this dialect: a reasoning
            // or call token's are dropped.
            TurnEvent::Part(ReplyPart::Reasoning(t)) => {
                self.pending.clear();
                self.text("reasoning", &t, &mut out)
            }
            TurnEvent::Part(ReplyPart::Content(t)) => self.text("message", &t, &mut out),
            TurnEvent::Part(ReplyPart::ToolCall(c)) => {
                self.pending.clear();
                self.call(&c, &mut out)
            }
            TurnEvent::Done(outcome) => {
                self.close(&mut out, outcome.finish == Finish::Length);
                let (status, kind) = match outcome.finish {
                    Finish::Length => ("incomplete", "response.incomplete"),
                    _ => ("completed", "response.completed"),
                };
                let response = self.response(status, Some(&outcome));
                out.push(self.event(kind, json!({ "response": response })));
                return (out, Some(Ok(response)));
            }
            TurnEvent::Failed(e) => {
                let mut response = self.response("failed", None);
                response["error"] = json!({ "code": "server_error", "message": e.message });
                out.push(self.event("response.failed", json!({ "response": response })));
                return (out, Some(Err(e)));
            }
        }
        (out, None)
    }
}

/// The assistant message a finished response adds to its conversation: its output items
/// read back as a follow-up's input would be (none for an empty output).
fn output_message(output: &[Value]) -> Option<Message> {
    let mut messages = Vec::new();
    push_items(output, &mut messages).ok()?;
    messages.pop()
}

/// `POST /v1/responses`.
pub async fn create(State(app): State<Arc<App>>, body: Body) -> Response {
    let parsed = request_body::read_body(body)
        .await
        .and_then(|b| translate(&b, &app.options.sampling, &app.responses));
    let Translated {
        conversation,
        history,
        echo,
        store,
    } = match parsed {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let stream = conversation.params.stream;
    let turn = match conversation::start(&app, conversation).await {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let mut base = echo;
    base["id"] = json!(new_id("resp"));
    base["object"] = json!("response");
    base["created_at"] = json!(unix_now());
    base["model"] = json!(turn.model);
    base["error"] = Value::Null;
    base["incomplete_details"] = Value::Null;
    base["usage"] = Value::Null;
    let mut items = Items::new(base, turn.prompt_tokens, 0);
    let keep = move |app: &App, response: &Value| {
        if store {
            let mut messages = history.clone();
            messages.extend(output_message(
                response["output"].as_array().map_or(&[], |v| v),
            ));
            let id = response["id"].as_str().unwrap_or_default().to_string();
            app.responses.put(id, messages, response.clone());
        }
    };
    if stream {
        let first = {
            let created = items.response("in_progress", None);
            vec![
                items.event("response.created", json!({ "response": created })),
                items.event("response.in_progress", json!({ "response": created })),
            ]
        };
        let app = app.clone();
        return named_events(turn_frames(turn, first, move |event| {
            let (out, end) = items.frames(event);
            if let Some(Ok(response)) = &end {
                keep(&app, response);
            }
            out
        }));
    }
    let mut turn: Turn = turn;
    while let Some(event) = turn.next().await {
        match items.frames(event).1 {
            Some(Ok(response)) => {
                keep(&app, &response);
                return generated_response(response);
            }
            Some(Err(e)) => return e.into_response(),
            None => {}
        }
    }
    ended_early().into_response()
}

/// A stored response; 404 when it is not (or no longer) stored.
pub async fn retrieve(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match app.responses.get(&id) {
        Some(stored) => Json(stored.response).into_response(),
        None => ApiError::not_found(format!("no stored response `{id}`")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::conversation::RequestStats;

    /// Reasoning, text and a call stream as three output items, each added, filled and
    /// done before the next; sequence numbers count up from where they started; the final
    /// response lists the items as they were done (same ids).
    /// Each of `events` through `items`: the stream events, and the end's response.
    fn play(
        items: &mut Items,
        events: impl IntoIterator<Item = TurnEvent>,
    ) -> (Vec<Named>, Option<Result<Value, ApiError>>) {
        let (mut out, mut end) = (Vec::new(), None);
        for e in events {
            let (frames, e) = items.frames(e);
            out.extend(frames);
            end = e.or(end);
        }
        (out, end)
    }

    #[test]
    fn a_reply_streams_as_output_items() {
        let mut items = Items::new(json!({ "id": "resp_1", "object": "response" }), 10, 2);
        let call = FunctionCall {
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        };
        let (events, end) = play(
            &mut items,
            [
                TurnEvent::Part(ReplyPart::Reasoning("think".into())),
                TurnEvent::Part(ReplyPart::Content("Check".into())),
                TurnEvent::Part(ReplyPart::Content("ing.".into())),
                TurnEvent::Part(ReplyPart::ToolCall(call)),
                TurnEvent::Done(Outcome {
                    completion_tokens: 5,
                    finish: Finish::ToolCalls,
                    stats: RequestStats::default(),
                    logprobs: Vec::new(),
                }),
            ],
        );
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, (name, data)) in events.iter().enumerate() {
            assert_eq!(data["type"], name.as_str());
            assert_eq!(data["sequence_number"], i as u64 + 2);
        }
        assert_eq!(events[10].1["text"], "Checking.");
        let response = end.unwrap().unwrap();
        assert_eq!(response["status"], "completed");
        let output = response["output"].as_array().unwrap();
        let kinds: Vec<&str> = output.iter().map(|o| o["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["reasoning", "message", "function_call"]);
        for (index, item) in output.iter().enumerate() {
            let added = events
                .iter()
                .find(|(n, d)| n == "response.output_item.added" && d["output_index"] == index)
                .unwrap();
            assert_eq!(added.1["item"]["id"], item["id"]);
        }
        assert_eq!(output[1]["content"][0]["text"], "Checking.");
        assert_eq!(output[2]["arguments"], r#"{"city":"Paris"}"#);
        assert_eq!(response["usage"]["total_tokens"], 15);
        // Read back as a follow-up's input, the output is one assistant message.
        let m = output_message(output).unwrap();
        assert_eq!(
            (
                m.reasoning_content.as_deref(),
                m.content.as_str(),
                m.tool_calls.len()
            ),
            (Some("think"), "Checking.", 1)
        );
    }

    fn logprob(token: &str, logprob: f32) -> TokenLogprob {
        TokenLogprob {
            token: token.into(),
            logprob,
            bytes: token.as_bytes().to_vec(),
            top_logprobs: Vec::new(),
        }
    }

    /// The message text's log-probabilities go with its deltas, its done event and its
    /// part; a reasoning token's and a call's are dropped.
    #[test]
    fn logprobs_follow_the_message_text() {
        let mut items = Items::new(json!({}), 1, 0);
        let (a, b, c) = (
            -rand::random::<f32>(),
            -rand::random::<f32>(),
            -rand::random::<f32>(),
        );
        let (events, end) = play(
            &mut items,
            [
                TurnEvent::Logprobs(vec![logprob("think", -0.5)]),
                TurnEvent::Part(ReplyPart::Reasoning("think".into())),
                TurnEvent::Logprobs(vec![logprob("He", a), logprob("llo", b)]),
                TurnEvent::Part(ReplyPart::Content("Hello".into())),
                TurnEvent::Logprobs(vec![logprob("!", c)]),
                TurnEvent::Part(ReplyPart::Content("!".into())),
                TurnEvent::Done(Outcome {
                    completion_tokens: 4,
                    finish: Finish::EndOfTurn,
                    stats: RequestStats::default(),
                    logprobs: Vec::new(),
                }),
            ],
        );
        let values = |v: &Value| -> Vec<(String, f32)> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|l| {
                    (
                        l["token"].as_str().unwrap().to_string(),
                        l["logprob"].as_f64().unwrap() as f32,
                    )
                })
                .collect()
        };
        let deltas: Vec<_> = events
            .iter()
            .filter(|(n, _)| n == "response.output_text.delta")
            .map(|(_, d)| values(&d["logprobs"]))
            .collect();
        let all = vec![("He".to_string(), a), ("llo".into(), b), ("!".into(), c)];
        assert_eq!(deltas, [all[..2].to_vec(), all[2..].to_vec()]);
        let done = events
            .iter()
            .find(|(n, _)| n == "response.output_text.done")
            .unwrap();
        assert_eq!(values(&done.1["logprobs"]), all);
        let response = end.unwrap().unwrap();
        assert_eq!(
            values(&response["output"][1]["content"][0]["logprobs"]),
            all
        );
        assert_eq!(
            response["output"][1]["content"][0]["logprobs"][0]["bytes"],
            json!(b"He")
        );
    }

    /// `include` asks for log-probabilities, `top_logprobs` for alternatives (0 to 20, as
    /// OpenAI bounds it); `top_logprobs` alone asks for nothing.
    #[test]
    fn include_asks_for_logprobs() {
        let asked = |body: Value| {
            translate(
                body.to_string().as_bytes(),
                &SamplingOptions::default(),
                &Store::default(),
            )
            .map(|t| t.conversation.params.logprobs)
        };
        let include = json!(["message.output_text.logprobs"]);
        assert_eq!(
            asked(json!({"input": "hi", "include": include})).unwrap(),
            Some(0)
        );
        assert_eq!(
            asked(json!({"input": "hi", "include": include, "top_logprobs": 20})).unwrap(),
            Some(20)
        );
        assert_eq!(
            asked(json!({"input": "hi", "top_logprobs": 3})).unwrap(),
            None
        );
        let e = asked(json!({"input": "hi", "include": include, "top_logprobs": 21})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = asked(json!({"input": "hi", "include": "x"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("include"));
    }

    #[test]
    fn one_assistant_turn_of_items_makes_one_message() {
        let items = json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "call the tool"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "14 C"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 14 C."}]},
            {"type": "message", "role": "assistant", "content": "Anything else?"},
        ]);
        let mut messages = Vec::new();
        push_items(items.as_array().unwrap(), &mut messages).unwrap();
        let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            ["user", "assistant", "tool", "assistant", "assistant"]
        );
        assert_eq!(
            messages[1].reasoning_content.as_deref(),
            Some("call the tool")
        );
        assert_eq!(messages[1].tool_calls.len(), 2);
        assert_eq!(messages[1].tool_calls[1].arguments, json!({"city": "Oslo"}));
        assert_eq!(messages[2].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(messages[3].content, "It is 14 C.");
    }

    #[test]
    fn the_store_keeps_the_newest_within_its_bound() {
        let store = Store::default();
        for i in 0..STORE_RESPONSES + 3 {
            store.put(
                format!("resp_{i}"),
                vec![Message::new("user", "hi")],
                json!({}),
            );
        }
        assert!(store.get("resp_0").is_none());
        assert!(store.get("resp_2").is_none());
        assert!(store.get("resp_3").is_some());
        assert!(store
            .get(&format!("resp_{}", STORE_RESPONSES + 2))
            .is_some());
    }
}
