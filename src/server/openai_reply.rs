//! OpenAI's chat and completion endpoints on the conversation core: requests
//! ([`super::openai`]) in, replies out as a `chat.completion` message or
//! `chat.completion.chunk` deltas (`content`, `reasoning_content`, indexed `tool_calls`), or
//! a `text_completion`.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::conversation::{self, Conversation, Outcome, TokenLogprob, Turn, TurnEvent};
use super::error::ApiError;
use super::openai::{ApiRequest, ChatRequest, CompletionRequest, Usage, OPENAI_STOPS};
use super::{generated_response, request_body, sse_response, turn_frames, unix_now, App};
use crate::reply::{FunctionCall, Reply, ReplyPart};

/// The model objects `/v1/models` lists: the loaded model's name, then its aliases, with
/// the context window (`context_window`, as LM Studio and vLLM add it) once loaded.
fn model_objects(app: &App) -> impl Iterator<Item = Value> + '_ {
    let o = &app.options;
    let context = app.engine().ok().map(|e| e.context());
    std::iter::once(&o.model_id).chain(&o.aliases).map(move |id| {
        let mut m = json!({ "id": id, "object": "model", "created": app.created, "owned_by": "slotstream" });
        if let Some(c) = context {
            m["context_window"] = json!(c);
        }
        m
    })
}

/// `GET /v1/models`.
pub async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    let data: Vec<Value> = model_objects(&app).collect();
    Json(json!({ "object": "list", "data": data }))
}

/// One listed model (the OpenAI clients' `models.retrieve`); 404 for another name.
pub async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match model_objects(&app).find(|m| m["id"] == id.as_str()) {
        Some(m) => Json(m).into_response(),
        None => ApiError::no_model(&id).into_response(),
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(app): State<Arc<App>>, body: Body) -> Response {
    handle::<ChatRequest>(app, Endpoint::Chat, body).await
}

/// `POST /v1/completions`.
pub async fn completions(State(app): State<Arc<App>>, body: Body) -> Response {
    handle::<CompletionRequest>(app, Endpoint::Completion, body).await
}

/// Parses and checks a request of either endpoint, then answers it.
async fn handle<R: ApiRequest>(app: Arc<App>, endpoint: Endpoint, body: Body) -> Response {
    // An unreadable body (too large: 413) gets an OpenAI-shaped error too.
    let parsed = request_body::read_body(body)
        .await
        .and_then(|b| R::parse(&b))
        .and_then(|r| {
            Ok((
                r.input()?,
                r.common().params(&app.options.sampling, OPENAI_STOPS)?,
            ))
        });
    let (input, params) = match parsed {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let (stream, include_usage, stats) = (params.stream, params.include_usage, params.stats);
    let logprobs = params.logprobs.is_some();
    let conversation = Conversation {
        input,
        params,
        route: endpoint.route(),
    };
    let turn = match conversation::start(&app, conversation).await {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completion => "cmpl",
    };
    let meta = Meta {
        endpoint,
        id: format!("{prefix}-{:016x}", rand::random::<u64>()),
        created: unix_now(),
        model: turn.model.clone(),
        prompt_tokens: turn.prompt_tokens,
        logprobs,
    };
    if stream {
        return stream_response(meta, turn, include_usage, stats);
    }
    let (reply, outcome) = match turn.collect().await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let logprobs = meta.logprobs(outcome.logprobs.clone(), &mut 0);
    let mut body = match endpoint {
        Endpoint::Chat => meta.response(message(&reply), outcome.finish.openai(), logprobs),
        Endpoint::Completion => {
            meta.response(json!(reply.content), outcome.finish.openai(), logprobs)
        }
    };
    body["usage"] = json!(Usage::new(meta.prompt_tokens, outcome.completion_tokens));
    if stats {
        body["slotstream_stats"] = json!(outcome.stats);
    }
    generated_response(body)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    fn route(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completion => "/v1/completions",
        }
    }
}

/// What every chunk or response of one request repeats.
struct Meta {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    /// The request asked for log-probabilities.
    logprobs: bool,
}

impl Meta {
    /// A choice's `logprobs` for `tokens` (`null` when not asked): the chat endpoint's
    /// `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}`, or the
    /// completion endpoint's `{tokens, token_logprobs, top_logprobs, text_offset}`, whose
    /// offsets (in characters of the reply) start at `offset` and advance it.
    fn logprobs(&self, tokens: Vec<TokenLogprob>, offset: &mut usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.endpoint {
            Endpoint::Chat => json!({ "content": tokens, "refusal": null }),
            Endpoint::Completion => {
                let mut text_offset = Vec::with_capacity(tokens.len());
                for t in &tokens {
                    text_offset.push(*offset);
                    *offset += t.token.chars().count();
                }
                let top: Vec<serde_json::Map<String, Value>> = tokens
                    .iter()
                    .map(|t| {
                        t.top_logprobs
                            .iter()
                            .map(|a| (a.token.clone(), json!(a.logprob)))
                            .collect()
                    })
                    .collect();
                json!({
                    "tokens": tokens.iter().map(|t| &t.token).collect::<Vec<_>>(),
                    "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": text_offset,
                })
            }
        }
    }

    /// A streamed chunk: a chat `delta` (`{}` for none), or a completion's `text` (the
    /// delta's `content`), with its tokens' `logprobs`.
    fn chunk(&self, delta: Value, finish: Option<&str>, logprobs: Value) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish })
            }
            Endpoint::Completion => {
                json!({ "index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")),
                                            "logprobs": logprobs, "finish_reason": finish })
            }
        };
        self.envelope(choice, true)
    }

    /// A whole response: a chat `message`, or a completion's `text`.
    fn response(&self, body: Value, finish: &str, logprobs: Value) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({ "index": 0, "message": body, "logprobs": logprobs, "finish_reason": finish })
            }
            Endpoint::Completion => {
                json!({ "index": 0, "text": body, "logprobs": logprobs, "finish_reason": finish })
            }
        };
        self.envelope(choice, false)
    }

    fn envelope(&self, choice: Value, streaming: bool) -> Value {
        let object = match (self.endpoint, streaming) {
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Completion, _) => "text_completion",
        };
        json!({ "id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice] })
    }

    /// The last chunks after `outcome`: the finish reason (with the statistics when
    /// asked, and the `logprobs` of tokens whose text no earlier chunk carried), then the
    /// usage when asked.
    fn end(
        &self,
        outcome: &Outcome,
        include_usage: bool,
        stats: bool,
        logprobs: Value,
    ) -> Vec<Value> {
        let mut last = self.chunk(json!({}), Some(outcome.finish.openai()), logprobs);
        if stats {
            last["slotstream_stats"] = json!(outcome.stats);
        }
        let mut chunks = vec![last];
        if include_usage {
            let mut usage = self.envelope(json!(null), true);
            usage["choices"] = json!([]);
            usage["usage"] = json!(Usage::new(self.prompt_tokens, outcome.completion_tokens));
            chunks.push(usage);
        }
        chunks
    }
}

/// A whole reply as OpenAI's assistant `message`.
fn message(reply: &Reply) -> Value {
    let mut message = json!({ "role": "assistant", "content": reply.content });
    if !reply.reasoning.is_empty() {
        message["reasoning_content"] = json!(reply.reasoning);
    }
    if !reply.tool_calls.is_empty() {
        if reply.content.is_empty() {
            message["content"] = Value::Null; // as OpenAI answers a call without text
        }
        message["tool_calls"] = reply.tool_calls.iter().map(tool_call).collect();
    }
    message
}

/// A parsed call as OpenAI's `tool_calls` entry, with a fresh id.
fn tool_call(call: &FunctionCall) -> Value {
    json!({
        "id": format!("call_{:024x}", rand::random::<u128>() >> 32),
        "type": "function",
        "function": { "name": call.name, "arguments": call.arguments },
    })
}

/// Server-sent chunks for one request, ending with `data: [DONE]` (after an error's body
/// too, as OpenAI's stream ends).
fn stream_response(meta: Meta, turn: Turn, include_usage: bool, stats: bool) -> Response {
    let data = |v: Value| SseEvent::default().data(v.to_string());
    let first = match meta.endpoint {
        Endpoint::Chat => vec![data(meta.chunk(
            json!({ "role": "assistant", "content": "" }),
            None,
            meta.logprobs(Vec::new(), &mut 0),
        ))],
        Endpoint::Completion => Vec::new(),
    };
    let mut calls = 0usize;
    // Log-probabilities of tokens whose text has not been sent, and the completion
    // endpoint's text offset.
    let mut pending = Vec::new();
    let mut offset = 0;
    let frames = move |event: TurnEvent| -> Vec<SseEvent> {
        let done = || SseEvent::default().data("[DONE]");
        match event {
            TurnEvent::Logprobs(l) => {
                pending.extend(l);
                Vec::new()
            }
            TurnEvent::Part(part) => {
                let delta = match part {
                    ReplyPart::Content(t) => json!({ "content": t }),
                    ReplyPart::Reasoning(t) => json!({ "reasoning_content": t }),
                    ReplyPart::ToolCall(c) => {
                        let mut call = tool_call(&c);
                        call["index"] = json!(calls);
                        calls += 1;
                        json!({ "tool_calls": [call] })
                    }
                };
                let logprobs = meta.logprobs(std::mem::take(&mut pending), &mut offset);
                vec![data(meta.chunk(delta, None, logprobs))]
            }
            TurnEvent::Done(outcome) => {
                let logprobs = meta.logprobs(std::mem::take(&mut pending), &mut offset);
                let mut out: Vec<SseEvent> = meta
                    .end(&outcome, include_usage, stats, logprobs)
                    .into_iter()
                    .map(data)
                    .collect();
                out.push(done());
                out
            }
            TurnEvent::Failed(e) => vec![data(e.body()), done()],
        }
    };
    sse_response(turn_frames(turn, first, frames))
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPLY: &str = "<think>\nweather twice\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>";

    fn parsed(text: &str) -> Reply {
        let tools = vec![json!({"type": "function", "function": {"name": "get_weather"}})];
        Reply::parse(
            text,
            crate::reply::ReplyOptions {
                reasoning: true,
                thinking_open: false,
                tools: Some(tools),
                single_call: false,
            },
        )
    }

    #[test]
    fn a_message_carries_reasoning_text_and_calls() {
        let m = message(&parsed(REPLY));
        assert_eq!(m["reasoning_content"], "weather twice");
        assert_eq!(m["content"], "Checking.");
        let calls = m["tool_calls"].as_array().unwrap();
        for (call, city) in calls.iter().zip(["Paris", "Oslo"]) {
            assert_eq!(call["type"], "function");
            assert!(call["id"].as_str().unwrap().starts_with("call_"));
            assert_eq!(call["function"]["name"], "get_weather");
            let args: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            assert_eq!(args, json!({ "city": city }));
        }
        // A reply of calls alone has null content, as OpenAI's.
        let calls_only = &REPLY[REPLY.find("<tool_call>").unwrap()..];
        assert_eq!(message(&parsed(calls_only))["content"], Value::Null);
    }
}
