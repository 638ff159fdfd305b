//! Reading a chat reply as it streams: the reasoning of thinking models
//! (`<think>...</think>`), the text, and tool calls in Qwen3's JSON form
//! (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`) or Qwen3-Coder's XML
//! form (`<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n</function>\n
//! </tool_call>`), as llama.cpp's and vLLM's parsers split them into
//! `reasoning_content`, `content` and `tool_calls`.
//!
//! The newlines around the tags are markup and are dropped: whitespace after `<think>` and
//! before `</think>`, after `</think>` and a tool call, and before a tool call. A call that
//! does not parse comes back as text, tags included; so does a call or reasoning cut off
//! by the token limit (reasoning stays reasoning).
//!
//! A call is read as its format defines it, not to the first `</tool_call>`: a JSON call
//! to the end of its JSON value (a `</tool_call>` inside a string stays in the string, as
//! llama.cpp reads it), an XML call parameter by parameter, each to its `</parameter>`.
//! With reasoning left in the text, a `<think>` block is text, whole and in place: no
//! call is taken from inside it.

use serde_json::{Map, Value};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// What to look for in a reply.
#[derive(Clone, Debug, Default)]
pub struct ReplyOptions {
    /// Split `<think>...</think>` off as reasoning (a reply that starts with `<think>`);
    /// off, reasoning stays in the text (`--reasoning-format none`).
    pub reasoning: bool,
    /// The prompt left a `<think>` block open: the reply starts as reasoning.
    pub thinking_open: bool,
    /// Parse tool calls, with these tool definitions (which give XML parameters their
    /// JSON types); `None`: calls stay in the text.
    pub tools: Option<Vec<Value>>,
    /// Keep the reply's first tool call only (OpenAI's `parallel_tool_calls: false`); the
    /// later ones are dropped, with a warning.
    pub single_call: bool,
}

/// A piece of a reply.
#[derive(Clone, Debug, PartialEq)]
pub enum ReplyPart {
    Reasoning(String),
    Content(String),
    ToolCall(FunctionCall),
}

/// A parsed tool call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON object's text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// A whole reply, its parts gathered.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reply {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<FunctionCall>,
}

impl Reply {
    /// Gathers streamed parts.
    pub fn extend(&mut self, parts: impl IntoIterator<Item = ReplyPart>) {
        for part in parts {
            match part {
                ReplyPart::Reasoning(t) => self.reasoning.push_str(&t),
                ReplyPart::Content(t) => self.content.push_str(&t),
                ReplyPart::ToolCall(c) => self.tool_calls.push(c),
            }
        }
    }

    /// Parses a whole reply.
    pub fn parse(text: &str, options: ReplyOptions) -> Reply {
        let mut parser = ReplyParser::new(options);
        let mut reply = Reply::default();
        reply.extend(parser.push(text));
        reply.extend(parser.finish());
        reply
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Not yet known whether the reply opens with `<think>`.
    Start,
    /// Inside `<think>`; `started` once its leading whitespace is behind.
    Reasoning { started: bool },
    /// Text; `skip_space` right after markup, whose trailing newlines are dropped.
    Content { skip_space: bool },
    /// Inside a `<think>` block that stays text (reasoning off): no calls are read.
    TextThink,
    /// Inside `<tool_call>`.
    Call,
}

/// Splits a reply into parts as its text arrives, holding back only what may be the
/// start of a tag (or whitespace that may come before one).
pub struct ReplyParser {
    options: ReplyOptions,
    mode: Mode,
    pending: String,
    /// Calls returned so far.
    calls: usize,
}

impl ReplyParser {
    pub fn new(options: ReplyOptions) -> Self {
        let mode = match (options.reasoning, options.thinking_open) {
            (false, false) => Mode::Content { skip_space: false },
            (false, true) => Mode::TextThink,
            (true, true) => Mode::Reasoning { started: false },
            (true, false) => Mode::Start,
        };
        ReplyParser {
            options,
            mode,
            pending: String::new(),
            calls: 0,
        }
    }

    /// Adds `text`; returns the parts it completes.
    pub fn push(&mut self, text: &str) -> Vec<ReplyPart> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.mode {
                Mode::Start => {
                    let t = self.pending.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                        self.pending = rest.to_string();
                        self.mode = Mode::Reasoning { started: false };
                    } else if THINK_OPEN.starts_with(t) {
                        return out; // maybe `<think>` still to come
                    } else {
                        self.mode = Mode::Content { skip_space: false };
                    }
                }
                Mode::Reasoning { started } => {
                    if !started {
                        self.skip_space();
                        if self.pending.is_empty() {
                            return out;
                        }
                        self.mode = Mode::Reasoning { started: true };
                    }
                    if let Some(i) = self.pending.find(THINK_CLOSE) {
                        let text = self.pending[..i].trim_end().to_string();
                        self.pending.drain(..i + THINK_CLOSE.len());
                        push_text(&mut out, ReplyPart::Reasoning(text));
                        self.mode = Mode::Content { skip_space: true };
                    } else {
                        let text = self.release(&[THINK_CLOSE]);
                        push_text(&mut out, ReplyPart::Reasoning(text));
                        return out;
                    }
                }
                Mode::Content { skip_space } => {
                    if skip_space {
                        self.skip_space();
                        if self.pending.is_empty() {
                            return out;
                        }
                        self.mode = Mode::Content { skip_space: false };
                    }
                    if self.options.tools.is_none() {
                        let text = std::mem::take(&mut self.pending);
                        push_text(&mut out, ReplyPart::Content(text));
                        return out;
                    }
                    // With reasoning off, a `<think>` block is text with no calls in it.
                    let think = (!self.options.reasoning)
                        .then(|| self.pending.find(THINK_OPEN))
                        .flatten();
                    match (self.pending.find(CALL_OPEN), think) {
                        (Some(i), t) if t.is_none_or(|t| i < t) => {
                            let text = self.pending[..i].trim_end().to_string();
                            self.pending.drain(..i + CALL_OPEN.len());
                            push_text(&mut out, ReplyPart::Content(text));
                            self.mode = Mode::Call;
                        }
                        (_, Some(t)) => {
                            let text: String = self.pending.drain(..t + THINK_OPEN.len()).collect();
                            push_text(&mut out, ReplyPart::Content(text));
                            self.mode = Mode::TextThink;
                        }
                        (_, None) => {
                            let tags: &[&str] = match self.options.reasoning {
                                true => &[CALL_OPEN],
                                false => &[CALL_OPEN, THINK_OPEN],
                            };
                            let text = self.release(tags);
                            push_text(&mut out, ReplyPart::Content(text));
                            return out;
                        }
                    }
                }
                Mode::TextThink => {
                    if let Some(i) = self.pending.find(THINK_CLOSE) {
                        let text: String = self.pending.drain(..i + THINK_CLOSE.len()).collect();
                        push_text(&mut out, ReplyPart::Content(text));
                        self.mode = Mode::Content { skip_space: false };
                    } else {
                        let text = self.release(&[THINK_CLOSE]);
                        push_text(&mut out, ReplyPart::Content(text));
                        return out;
                    }
                }
                Mode::Call => {
                    let Some((body_end, end)) = call_end(&self.pending) else {
                        return out;
                    };
                    let body: String = self.pending[..body_end].to_string();
                    let raw: String = self.pending.drain(..end).collect();
                    let tools = self.options.tools.as_deref().unwrap_or_default();
                    match parse_call(&body, tools) {
                        Some(call) if self.options.single_call && self.calls > 0 => {
                            tracing::warn!(
                                name = call.name,
                                "parallel_tool_calls is false: a tool call after the first is dropped"
                            );
                            self.mode = Mode::Content { skip_space: true };
                        }
                        Some(call) => {
                            self.calls += 1;
                            out.push(ReplyPart::ToolCall(call));
                            self.mode = Mode::Content { skip_space: true };
                        }
                        None => {
                            push_text(&mut out, ReplyPart::Content(format!("{CALL_OPEN}{raw}")));
                            self.mode = Mode::Content { skip_space: false };
                        }
                    }
                }
            }
        }
    }

    /// At the end of the reply: whatever was held back.
    pub fn finish(&mut self) -> Vec<ReplyPart> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        let part = match self.mode {
            Mode::Start => ReplyPart::Content(rest),
            Mode::Reasoning { .. } => ReplyPart::Reasoning(rest.trim().to_string()),
            Mode::Content { skip_space: true } => ReplyPart::Content(rest.trim_start().into()),
            Mode::Content { skip_space: false } | Mode::TextThink => ReplyPart::Content(rest),
            Mode::Call => ReplyPart::Content(format!("{CALL_OPEN}{rest}")),
        };
        push_text(&mut out, part);
        self.mode = Mode::Content { skip_space: false };
        out
    }

    fn skip_space(&mut self) {
        let start = self.pending.len() - self.pending.trim_start().len();
        self.pending.drain(..start);
    }

    /// Takes the pending text but what may start one of `tags` and the whitespace before
    /// that.
    fn release(&mut self, tags: &[&str]) -> String {
        let p = &self.pending;
        let partial = tags
            .iter()
            .filter_map(|tag| (1..tag.len()).rev().find(|&k| p.ends_with(&tag[..k])))
            .max()
            .unwrap_or(0);
        let keep_from = p[..p.len() - partial].trim_end().len();
        let text = p[..keep_from].to_string();
        self.pending.drain(..keep_from);
        text
    }
}

/// Adds a text part unless it is empty.
fn push_text(out: &mut Vec<ReplyPart>, part: ReplyPart) {
    match &part {
        ReplyPart::Reasoning(t) | ReplyPart::Content(t) if t.is_empty() => {}
        _ => out.push(part),
    }
}

/// Where the call that `pending` holds (after `<tool_call>`) ends, read as its format
/// defines it: its body's end and the end of its `</tool_call>`; `None` while it may
/// still be coming. A JSON call ends with its JSON value, an XML call after the
/// `</function>` that follows its last `</parameter>`; a body in neither form (or not
/// followed by `</tool_call>`) ends at the first `</tool_call>`, to come back as text.
fn call_end(pending: &str) -> Option<(usize, usize)> {
    const FUNCTION: &str = "<function=";
    const PARAMETER: &str = "<parameter=";
    const PARAMETER_CLOSE: &str = "</parameter>";
    const FUNCTION_CLOSE: &str = "</function>";
    let malformed = || pending.find(CALL_CLOSE).map(|i| (i, i + CALL_CLOSE.len()));
    // After the body: whitespace, then `</tool_call>`.
    let close = |body_end: usize| {
        let rest = pending[body_end..].trim_start();
        if rest.starts_with(CALL_CLOSE) {
            Some((body_end, pending.len() - rest.len() + CALL_CLOSE.len()))
        } else if CALL_CLOSE.starts_with(rest) {
            None
        } else {
            malformed()
        }
    };
    let body = pending.trim_start();
    let at = |s: &str| pending.len() - s.len();
    if body.starts_with('{') {
        let mut values = serde_json::Deserializer::from_str(body).into_iter::<Value>();
        return match values.next() {
            Some(Ok(_)) => close(at(body) + values.byte_offset()),
            Some(Err(e)) if e.is_eof() => None,
            _ => malformed(),
        };
    }
    let Some(rest) = body.strip_prefix(FUNCTION) else {
        return match FUNCTION.starts_with(body) {
            true => None,
            false => malformed(),
        };
    };
    // `NAME>`, then parameters, each read to its closing tag, then `</function>`; a
    // `?` where the rest has not come yet.
    let gt = rest.find(['>', '<', '\n'])?;
    if !rest[gt..].starts_with('>') {
        return malformed();
    }
    let mut rest = &rest[gt + 1..];
    loop {
        let s = rest.trim_start();
        if let Some(param) = s.strip_prefix(PARAMETER) {
            let gt = param.find(['>', '<', '\n'])?;
            if !param[gt..].starts_with('>') {
                return malformed();
            }
            let end = param[gt..].find(PARAMETER_CLOSE)?;
            rest = &param[gt + end + PARAMETER_CLOSE.len()..];
        } else if let Some(after) = s.strip_prefix(FUNCTION_CLOSE) {
            return close(at(after));
        } else if PARAMETER.starts_with(s) || FUNCTION_CLOSE.starts_with(s) {
            return None;
        } else {
            return malformed();
        }
    }
}

/// A call's body (between the tags) in either form; `None` when it is malformed.
fn parse_call(body: &str, tools: &[Value]) -> Option<FunctionCall> {
    let body = body.trim();
    match body.strip_prefix("<function=") {
        Some(rest) => parse_xml_call(rest, tools),
        None => parse_json_call(body),
    }
}

/// `{"name": "f", "arguments": {...}}` (`arguments` may also be a string holding a JSON
/// object, or absent for none).
fn parse_json_call(body: &str) -> Option<FunctionCall> {
    let Value::Object(call) = serde_json::from_str::<Value>(body).ok()? else {
        return None;
    };
    let name = call.get("name")?.as_str().filter(|n| !n.is_empty())?;
    let arguments = match call.get("arguments") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s).ok()? {
            v @ Value::Object(_) => v.to_string(),
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(FunctionCall {
        name: name.to_string(),
        arguments,
    })
}

/// `NAME>\n<parameter=P>\nvalue\n</parameter>\n...</function>` (after `<function=`). A
/// value is text where the tool's schema says `string` or says nothing of the parameter
/// (as vLLM's Qwen3-Coder parser reads it), otherwise JSON when it parses as JSON.
fn parse_xml_call(rest: &str, tools: &[Value]) -> Option<FunctionCall> {
    let (name, body) = rest.split_once('>')?;
    let name = name.trim();
    if name.is_empty() || name.contains(['<', '\n']) {
        return None;
    }
    let mut body = body.trim().strip_suffix("</function>")?.trim_start();
    let properties = tools
        .iter()
        .find(|t| crate::chat_template::tool_name(t) == Some(name))
        .and_then(|t| {
            t.get("function")
                .unwrap_or(t)
                .get("parameters")?
                .get("properties")
        });
    let mut arguments = Map::new();
    while !body.is_empty() {
        let (param, after) = body.strip_prefix("<parameter=")?.split_once('>')?;
        let (value, after) = after.split_once("</parameter>")?;
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let kind = properties
            .and_then(|p| p.get(param.trim())?.get("type")?.as_str())
            .unwrap_or("string");
        let value = match kind {
            "string" => Value::String(value.to_string()),
            _ => serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.into())),
        };
        arguments.insert(param.trim().to_string(), value);
        body = after.trim_start();
    }
    Some(FunctionCall {
        name: name.to_string(),
        arguments: Value::Object(arguments).to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}
            }}}),
        ]
    }

    fn options(thinking_open: bool, tools_on: bool) -> ReplyOptions {
        ReplyOptions {
            reasoning: true,
            thinking_open,
            tools: tools_on.then(tools),
            single_call: false,
        }
    }

    fn call(name: &str, arguments: Value) -> FunctionCall {
        FunctionCall {
            name: name.into(),
            arguments: arguments.to_string(),
        }
    }

    #[test]
    fn reasoning_text_and_calls_are_split() {
        let r = Reply::parse(
            "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n10001\n</parameter>\n</function>\n</tool_call>",
            options(false, true),
        );
        assert_eq!(r.reasoning, "The user wants weather.");
        assert_eq!(r.content, "Let me check.");
        assert_eq!(
            r.tool_calls,
            vec![
                call("get_weather", json!({"city": "Paris", "days": 2})),
                // Types from the schema: `days` an integer, `zip` stays text.
                call(
                    "get_weather",
                    json!({"city": "New\nYork", "days": 3, "zip": "10001"})
                ),
            ]
        );
    }

    #[test]
    fn a_prompt_that_opened_thinking_starts_in_reasoning() {
        let r = Reply::parse("I should answer.\n</think>\n\nHello!", options(true, false));
        assert_eq!(
            (r.reasoning.as_str(), r.content.as_str()),
            ("I should answer.", "Hello!")
        );
        // Cut off before `</think>`: all reasoning.
        let r = Reply::parse("still thinking", options(true, false));
        assert_eq!(
            (r.reasoning.as_str(), r.content.as_str()),
            ("still thinking", "")
        );
    }

    #[test]
    fn off_switches_keep_the_raw_text() {
        let text = "<think>x</think>\n\nhi <tool_call>\n{\"name\": \"f\"}\n</tool_call>";
        let r = Reply::parse(text, ReplyOptions::default());
        assert_eq!(
            r,
            Reply {
                content: text.into(),
                ..Default::default()
            }
        );
        // Tools off: calls stay text, reasoning still splits.
        let r = Reply::parse(text, options(false, false));
        assert_eq!(r.reasoning, "x");
        assert_eq!(r.content, "hi <tool_call>\n{\"name\": \"f\"}\n</tool_call>");
        // A reply that does not open with <think> is all text, whitespace included.
        let r = Reply::parse("  plain </think> reply\n", options(false, true));
        assert_eq!(r.content, "  plain </think> reply\n");
    }

    #[test]
    fn malformed_calls_come_back_as_text() {
        for body in [
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": }}",
            "{\"arguments\": {}}",
            "[1, 2]",
            "{\"name\": \"f\", \"arguments\": 5}",
            "<function=get_weather>\n<parameter=city>\nParis\n</function>",
            "<function=>\n</function>",
        ] {
            let text = format!("ok <tool_call>\n{body}\n</tool_call> after");
            let r = Reply::parse(&text, options(false, true));
            assert!(r.tool_calls.is_empty(), "{body}");
            assert_eq!(
                r.content,
                format!("ok<tool_call>\n{body}\n</tool_call> after")
            );
        }
        // Cut off inside a call.
        let r = Reply::parse("a\n<tool_call>\n{\"name\": ", options(false, true));
        assert_eq!(r.content, "a<tool_call>\n{\"name\": ");
        // Arguments given as a string holding an object, or absent.
        let r = Reply::parse(
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call><tool_call>{\"name\": \"g\"}</tool_call>",
            options(false, true),
        );
        assert_eq!(
            r.tool_calls,
            vec![call("f", json!({"a": 1})), call("g", json!({}))]
        );
    }

    /// A `</tool_call>` (or `</function>`) inside an argument is part of the argument: a
    /// JSON call is read to the end of its value, an XML parameter to `</parameter>`.
    #[test]
    fn closing_tags_inside_arguments_stay_in_them() {
        let code = "print('</tool_call>')\n</function>";
        let json_call = json!({"name": "get_weather", "arguments": {"city": code, "days": 1}});
        let text = format!(
            "<tool_call>\n{json_call}\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n{code}\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\nDone."
        );
        let want = vec![
            call("get_weather", json!({"city": code, "days": 1})),
            call("get_weather", json!({"city": code, "days": 2})),
        ];
        let r = Reply::parse(&text, options(false, true));
        assert_eq!((r.tool_calls, r.content.as_str()), (want.clone(), "Done."));
        // Streamed a character at a time.
        let cuts: Vec<usize> = (0..text.chars().count()).collect();
        let r = streamed(&text, &cuts, options(false, true));
        assert_eq!((r.tool_calls, r.content.as_str()), (want, "Done."));
        // A JSON value followed by something other than `</tool_call>` is text up to the
        // first `</tool_call>`, as before.
        let text = "<tool_call>{\"name\": \"f\"} x</tool_call> y";
        let r = Reply::parse(text, options(false, true));
        assert!(r.tool_calls.is_empty());
        assert_eq!(r.content, text);
    }

    /// With reasoning left in the text (`--reasoning-format none`), a `<think>` block is
    /// text, whole and in place, and no call is taken from inside it; calls after it are.
    #[test]
    fn reasoning_off_takes_no_call_from_inside_think() {
        let inside = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        let after = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
        let off = |thinking_open| ReplyOptions {
            reasoning: false,
            ..options(thinking_open, true)
        };
        for (thinking_open, think) in [
            (false, format!("<think>\nMaybe {inside} first?\n</think>")),
            (true, format!("Maybe {inside} first?\n</think>")),
        ] {
            let text = format!("{think}\n\nChecking.\n{after}");
            let r = Reply::parse(&text, off(thinking_open));
            assert_eq!(
                r.content,
                format!("{think}\n\nChecking."),
                "{thinking_open}"
            );
            assert_eq!(r.reasoning, "");
            assert_eq!(
                r.tool_calls,
                vec![call("get_weather", json!({"city": "Rome"}))]
            );
            // Cut off inside the block: all of it is text.
            let r = Reply::parse(&think[..think.len() - 9], off(thinking_open));
            assert_eq!(r.content, &think[..think.len() - 9]);
            assert!(r.tool_calls.is_empty());
        }
    }

    /// `single_call` (`parallel_tool_calls: false`) keeps the first call only.
    #[test]
    fn a_single_call_keeps_the_first() {
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>\n<tool_call>{\"name\": \"g\"}</tool_call>\nok";
        let single = ReplyOptions {
            single_call: true,
            ..options(false, true)
        };
        let r = Reply::parse(text, single);
        assert_eq!(r.tool_calls, vec![call("f", json!({"a": 1}))]);
        assert_eq!(r.content, "ok");
        let r = Reply::parse(text, options(false, true));
        assert_eq!(r.tool_calls.len(), 2);
    }

    fn streamed(text: &str, cuts: &[usize], options: ReplyOptions) -> Reply {
        let chars: Vec<char> = text.chars().collect();
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
        bounds.extend([0, chars.len()]);
        bounds.sort();
        bounds.dedup();
        let mut parser = ReplyParser::new(options);
        let mut reply = Reply::default();
        for w in bounds.windows(2) {
            let piece: String = chars[w[0]..w[1]].iter().collect();
            reply.extend(parser.push(&piece));
        }
        reply.extend(parser.finish());
        reply
    }

    proptest! {
        /// However the reply is cut into pieces, the parts add up to the whole's.
        #[test]
        fn any_split_gives_the_whole_replys_parts(
            words in prop::collection::vec(prop::sample::select(vec![
                "<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "é", "x",
                "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}",
                "{\"name\": \"f\", \"arguments\": {\"s\": \"a</tool_call>\"}}",
                "<function=get_weather>\n<parameter=days>\n4\n</parameter>\n</function>",
                "<function=f>\n<parameter=s>\n</tool_call></function>\n</parameter>\n</function>",
                "<thi", "</tool", "{", "\"", "<parameter=", "</parameter>", "</function>",
            ]), 0..14),
            cuts in prop::collection::vec(0usize..200, 0..10),
            reasoning in any::<bool>(),
            thinking_open in any::<bool>(),
            tools_on in any::<bool>(),
            single_call in any::<bool>(),
        ) {
            let text: String = words.concat();
            let o = ReplyOptions { reasoning, single_call, ..options(thinking_open, tools_on) };
            prop_assert_eq!(streamed(&text, &cuts, o.clone()), Reply::parse(&text, o));
        }
    }
}
