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
            single_call: chat.single_tool_call,
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
        self.deltas_of(parts)
    }

    /// Stream deltas for what the end of the reply releases.
    pub fn finish_deltas(&mut self) -> Vec<Value> {
        let mut parts = std::mem::take(&mut self.pending);
        parts.extend(self.parser.finish());
        self.deltas_of(parts)
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

    fn deltas_of(&mut self, parts: Vec<ReplyPart>) -> Vec<Value> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(tool_choice: ToolChoice) -> Chat {
        Chat {
            tools: vec![json!({"type": "function", "function": {"name": "get_weather"}})],
            tool_choice,
            ..Default::default()
        }
    }

    const REPLY: &str = "<think>\nweather twice\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn calls_stream_as_indexed_deltas_and_end_with_tool_calls() {
        let mut reply = ChatReply::new(&chat(ToolChoice::Auto), &ChatPrompt::default(), true);
        let mut deltas = Vec::new();
        for piece in REPLY.split_inclusive(['\n', '"']) {
            deltas.extend(reply.deltas(piece));
        }
        deltas.extend(reply.finish_deltas());
        let field =
            |k: &str| -> String { deltas.iter().filter_map(|d| d.get(k)?.as_str()).collect() };
        assert_eq!(field("reasoning_content"), "weather twice");
        assert_eq!(field("content"), "Checking.");
        let calls: Vec<&Value> = deltas.iter().filter_map(|d| d.get("tool_calls")).collect();
        assert_eq!(calls.len(), 2);
        for (i, (call, city)) in calls.iter().zip(["Paris", "Oslo"]).enumerate() {
            assert_eq!(call[0]["index"], i);
            assert_eq!(call[0]["type"], "function");
            assert!(call[0]["id"].as_str().unwrap().starts_with("call_"));
            assert_eq!(call[0]["function"]["name"], "get_weather");
            let args: Value =
                serde_json::from_str(call[0]["function"]["arguments"].as_str().unwrap()).unwrap();
            assert_eq!(args, json!({ "city": city }));
        }
        assert_eq!(reply.finish_reason("stop"), "tool_calls");
    }

    #[test]
    fn whole_message_and_tool_choice_none() {
        let m =
            ChatReply::new(&chat(ToolChoice::Auto), &ChatPrompt::default(), true).message(REPLY);
        assert_eq!(m["reasoning_content"], "weather twice");
        assert_eq!(m["content"], "Checking.");
        assert_eq!(m["tool_calls"].as_array().unwrap().len(), 2);
        // A reply of calls alone has null content, as OpenAI's.
        let calls_only = &REPLY[REPLY.find("<tool_call>").unwrap()..];
        let m = ChatReply::new(&chat(ToolChoice::Auto), &ChatPrompt::default(), true)
            .message(calls_only);
        assert_eq!(m["content"], Value::Null);
        // tool_choice none: calls stay text; reasoning off: all of it is text.
        let m =
            ChatReply::new(&chat(ToolChoice::None), &ChatPrompt::default(), true).message(REPLY);
        assert!(m.get("tool_calls").is_none());
        assert!(m["content"].as_str().unwrap().ends_with("</tool_call>"));
        let m = ChatReply::new(&chat(ToolChoice::Auto), &ChatPrompt::default(), false)
            .message("<think>x</think>y");
        assert_eq!(m["content"], "<think>x</think>y");
        // A required call's opening from the prompt is read before the generated text.
        let prompt = ChatPrompt {
            reply_prefix: "<tool_call>\n{\"name\": \"".into(),
            ..Default::default()
        };
        let m = ChatReply::new(&chat(ToolChoice::Required), &prompt, true)
            .message("get_weather\", \"arguments\": {}}\n</tool_call>");
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], "{}");
    }

    /// `parallel_tool_calls: false` in a request keeps the reply's first call, streamed
    /// or whole; `true` or absent keeps both.
    #[test]
    fn parallel_tool_calls_false_keeps_the_first_call() {
        use crate::engine::Input;
        use crate::server::openai::{ApiRequest, ChatRequest};
        for (parallel, calls) in [(json!(false), 1), (json!(true), 2), (Value::Null, 2)] {
            let body = json!({
                "messages": [{"role": "user", "content": "weather?"}],
                "tools": chat(ToolChoice::Auto).tools,
                "parallel_tool_calls": parallel,
            });
            let request = ChatRequest::parse(body.to_string().as_bytes()).unwrap();
            let Ok(Input::Chat(chat)) = request.input() else {
                panic!("a chat request gives a chat")
            };
            let m = ChatReply::new(&chat, &ChatPrompt::default(), true).message(REPLY);
            let got = m["tool_calls"].as_array().unwrap();
            assert_eq!(got.len(), calls, "{parallel}");
            assert_eq!(got[0]["function"]["arguments"], "{\"city\":\"Paris\"}");
            let mut reply = ChatReply::new(&chat, &ChatPrompt::default(), true);
            let mut deltas = reply.deltas(REPLY);
            deltas.extend(reply.finish_deltas());
            let streamed = deltas.iter().filter(|d| d.get("tool_calls").is_some());
            assert_eq!(streamed.count(), calls, "{parallel}");
        }
    }
}
