//! The chat endpoint's reply: the model's text read as reasoning, content and tool calls
//! ([`crate::reply`]), as OpenAI's stream deltas or message.

use serde_json::{json, Value};

use crate::chat_template::{Chat, ChatPrompt, ToolChoice};
use crate::reply::{FunctionCall, Reply, ReplyOptions, ReplyParser, ReplyPart};

/// Reads one reply as its text arrives.
pub struct ChatReply {
    parser: ReplyParser,
    /// Parts of the prompt's reply prefix, sent with the first text.
    pending: Vec<ReplyPart>,
    calls: usize,
}

impl ChatReply {
    /// For the reply to `chat`, whose prompt is `prompt`; `reasoning` splits off a
    /// thinking model's `<think>` block. Tool calls are parsed when tools were given and
    /// `tool_choice` is not `none`.
    pub fn new(chat: &Chat, prompt: &ChatPrompt, reasoning: bool) -> Self {
        let parse_tools = !chat.tools.is_empty() && chat.tool_choice != ToolChoice::None;
        let mut parser = ReplyParser::new(ReplyOptions {
            reasoning,
            thinking_open: prompt.thinking_open,
            tools: parse_tools.then(|| chat.tools.clone()),
        });
        // A required call's opening is in the prompt; the reply continues it.
        let pending = parser.push(&prompt.reply_prefix);
        ChatReply {
            parser,
            pending,
            calls: 0,
        }
    }

    /// Stream deltas for `text`, the next piece of the reply.
    pub fn deltas(&mut self, text: &str) -> Vec<Value> {
        let mut parts = std::mem::take(&mut self.pending);
        parts.extend(self.parser.push(text));
        self.to_deltas(parts)
    }

    /// Stream deltas for what the end of the reply releases.
    pub fn finish_deltas(&mut self) -> Vec<Value> {
        let mut parts = std::mem::take(&mut self.pending);
        parts.extend(self.parser.finish());
        self.to_deltas(parts)
    }

    /// The whole reply's message (`text` is all of it).
    pub fn message(mut self, text: &str) -> Value {
        let mut reply = Reply::default();
        reply.extend(std::mem::take(&mut self.pending));
        reply.extend(self.parser.push(text));
        reply.extend(self.parser.finish());
        let mut message = json!({ "role": "assistant", "content": reply.content });
        if !reply.reasoning.is_empty() {
            message["reasoning_content"] = json!(reply.reasoning);
        }
        if !reply.tool_calls.is_empty() {
            if reply.content.is_empty() {
                message["content"] = Value::Null; // as OpenAI answers a call without text
            }
            let calls: Vec<Value> = reply.tool_calls.iter().map(tool_call).collect();
            self.calls = calls.len();
            message["tool_calls"] = Value::Array(calls);
        }
        message
    }

    /// Whether the reply called tools: its finish reason is then `tool_calls`.
    pub fn called_tools(&self) -> bool {
        self.calls > 0
    }

    /// The finish reason, given the generation's.
    pub fn finish_reason<'a>(&self, generation: &'a str) -> &'a str {
        if self.called_tools() {
            "tool_calls"
        } else {
            generation
        }
    }

    fn to_deltas(&mut self, parts: Vec<ReplyPart>) -> Vec<Value> {
        parts
            .into_iter()
            .map(|part| match part {
                ReplyPart::Content(t) => json!({ "content": t }),
                ReplyPart::Reasoning(t) => json!({ "reasoning_content": t }),
                ReplyPart::ToolCall(c) => {
                    let mut call = tool_call(&c);
                    call["index"] = json!(self.calls);
                    self.calls += 1;
                    json!({ "tool_calls": [call] })
                }
            })
            .collect()
    }
}

/// A parsed call as OpenAI's `tool_calls` entry, with a fresh id.
fn tool_call(call: &FunctionCall) -> Value {
    json!({
        "id": format!("call_{:024x}", rand::random::<u128>() >> 32),
        "type": "function",
        "function": { "name": call.name, "arguments": call.arguments },
    })
}
