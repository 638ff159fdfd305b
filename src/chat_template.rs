//! Chat templates: how a conversation (messages, tool definitions, template variables)
//! becomes prompt ids, the one way every chat path takes (CLI `generate` and `chat`, the
//! server's chat endpoint, `engine::Engine`).
//!
//! The model's template (`chat_template` in tokenizer_config.json, or chat_template.jinja)
//! is rendered with minijinja as transformers renders it: blocks trimmed, Python string
//! methods, `raise_exception`, and a `tojson` that writes what Python's `json.dumps`
//! writes. Every string that comes from the conversation is marked before rendering
//! ([`Tokenizer::mark_data`]), so the special tokens in the rendered prompt are the
//! template's own markup: a user who types `<|im_end|>` gets the ids of those characters,
//! never the control token (transformers and llama.cpp tokenize the rendered prompt
//! whole, so there the user's text would open a turn of its own).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// The model's chat template.
pub struct ChatTemplate {
    source: String,
    path: PathBuf,
    bos_token: String,
    eos_token: String,
}

/// One chat message, as the template reads it (the fields OpenAI's chat API sends).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool` (templates may know others).
    pub role: String,
    /// The text (a `null` content counts as empty).
    pub content: String,
    /// An assistant turn's reasoning, when the client sends it apart from `content`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The tools an assistant turn called.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The name of the tool or participant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The message's images (OpenAI's `image_url` parts, Anthropic's image blocks,
    /// Ollama's `images`, the CLI's `--image`), in order. The template then gets the
    /// content as parts, as transformers passes them: `{"type": "image"}` for each image
    /// and `{"type": "text", "text": ...}` between (a Qwen3.5 template renders an image
    /// as `<|vision_start|><|image_pad|><|vision_end|>`).
    #[serde(skip)]
    pub images: Vec<ChatImage>,
}

/// An image in a message: its encoded bytes (PNG, JPEG, WebP, GIF; decoded by the engine)
/// and where it goes in the message's text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatImage {
    /// Byte offset in `content` the image comes before (a char boundary; `content.len()`
    /// puts it after the text).
    pub at: usize,
    pub bytes: Arc<[u8]>,
}

impl Message {
    /// A message with only a role and text.
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }
}

/// A tool call in an assistant turn, given to templates in OpenAI's shape: `{"id", "type":
/// "function", "function": {"name", "arguments"}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "WireToolCall", into = "WireToolCall")]
pub struct ToolCall {
    pub id: Option<String>,
    pub name: String,
    /// The arguments as the template expects them: a mapping, or text that was not a
    /// JSON object ([`ToolCall::arguments_from_text`]).
    pub arguments: Value,
}

impl ToolCall {
    /// OpenAI sends a call's arguments as a JSON string; templates iterate a mapping
    /// (transformers' callers pass a dict). A string holding a JSON object becomes that
    /// mapping; anything else stays text, which templates print as it is.
    pub fn arguments_from_text(text: &str) -> Value {
        match serde_json::from_str::<Value>(text) {
            Ok(v @ Value::Object(_)) => v,
            _ => Value::String(text.to_string()),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct WireToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    #[serde(rename = "type")]
    kind: String,
    function: WireFunction,
}

#[derive(Serialize, Deserialize)]
struct WireFunction {
    name: String,
    #[serde(default)]
    arguments: Value,
}

impl From<WireToolCall> for ToolCall {
    fn from(w: WireToolCall) -> Self {
        let arguments = match w.function.arguments {
            Value::String(s) => ToolCall::arguments_from_text(&s),
            Value::Null => Value::Object(Map::new()),
            v => v,
        };
        ToolCall {
            id: w.id,
            name: w.function.name,
            arguments,
        }
    }
}

impl From<ToolCall> for WireToolCall {
    fn from(c: ToolCall) -> Self {
        WireToolCall {
            id: c.id,
            kind: "function".into(),
            function: WireFunction {
                name: c.name,
                arguments: c.arguments,
            },
        }
    }
}

/// Whether and how the reply must call a tool (OpenAI's `tool_choice`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides; calls in the reply are parsed.
    #[default]
    Auto,
    /// The tools are still rendered (as llama.cpp and vLLM do) but the reply is text.
    None,
    /// The reply starts with a tool call: its opening is put in the prompt.
    Required,
    /// The reply starts with a call of this function.
    Function(String),
}

/// How the template asks the model to write tool calls, found in its source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Json,
    /// Qwen3-Coder: `<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n
    /// </function>\n</tool_call>`.
    Xml,
}

/// What a chat template renders: the conversation, the tools the model may call and the
/// template's variables.
#[derive(Clone, Debug, Default)]
pub struct Chat {
    pub messages: Vec<Message>,
    /// Tool definitions as the client sent them (OpenAI's `{"type": "function",
    /// "function": {...}}`); the template renders them as it does in transformers.
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    /// Only the reply's first tool call is kept, the later ones dropped (OpenAI's
    /// `parallel_tool_calls: false`); the template is not told.
    pub single_tool_call: bool,
    /// Extra template variables (`chat_template_kwargs`), e.g. `enable_thinking`, passed
    /// to the template as transformers passes `apply_chat_template`'s keyword arguments.
    pub kwargs: Map<String, Value>,
}

/// Template variables a request may not set: the renderer sets them.
pub const RESERVED_KWARGS: [&str; 3] = ["messages", "tools", "add_generation_prompt"];

impl Chat {
    /// Every message's images, in the order the prompt places them.
    pub fn images(&self) -> impl Iterator<Item = &ChatImage> {
        self.messages.iter().flat_map(|m| &m.images)
    }

    /// A conversation without tools or variables.
    pub fn new(messages: Vec<Message>) -> Self {
        Chat {
            messages,
            ..Default::default()
        }
    }
}

/// Sets the template variable `enable_thinking` (the switch of thinking models such as
/// Qwen3) in `kwargs`. Errors: `kwargs` already gives it the other value.
pub fn set_enable_thinking(
    kwargs: &mut Map<String, Value>,
    on: bool,
) -> std::result::Result<(), String> {
    match kwargs.get("enable_thinking") {
        Some(v) if *v != Value::Bool(on) => Err(format!(
            "enable_thinking is {on} here but {v} in the chat template kwargs"
        )),
        _ => {
            kwargs.insert("enable_thinking".into(), Value::Bool(on));
            Ok(())
        }
    }
}

/// A rendered prompt: the template's markup as text, the conversation's strings marked
/// ([`Tokenizer::mark_data`]). Only [`Rendered::encode`] turns it into ids.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rendered(String);

impl Rendered {
    /// Token ids: markup's special tokens as control ids, data as plain text.
    pub fn encode(&self, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
        tokenizer.encode_rendered(&self.0)
    }

    /// What follows `prefix`, if this rendering starts with it.
    pub fn strip_prefix(&self, prefix: &Rendered) -> Option<Rendered> {
        self.0.strip_prefix(&prefix.0).map(|s| Rendered(s.into()))
    }

    /// Appends template-like markup (special tokens in it count).
    pub fn push_markup(&mut self, text: &str) {
        self.0.push_str(text);
    }

    /// Appends conversation text (special tokens in it are text).
    pub fn push_data(&mut self, tokenizer: &Tokenizer, text: &str) {
        self.0.push_str(&tokenizer.mark_data(text));
    }

    /// The prompt as text, data unmarked.
    pub fn text(&self, tokenizer: &Tokenizer) -> String {
        tokenizer.unmark(&self.0).into_owned()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the prompt ends inside an open `<think>` block (templates of thinking
    /// models that open the reasoning themselves, as Qwen3-Thinking's do): the reply then
    /// starts with reasoning and closes it with `</think>`.
    pub fn thinking_open(&self) -> bool {
        self.0.trim_end().ends_with("<think>")
    }
}

/// A chat's prompt ids and how the reply starts.
#[derive(Clone, Debug, Default)]
pub struct ChatPrompt {
    pub ids: Vec<u32>,
    /// Text the reply starts with that is already at the end of the prompt: the opening
    /// of a tool call that `tool_choice` requires (empty otherwise). Parse it before the
    /// generated text.
    pub reply_prefix: String,
    /// The reply starts inside a `<think>` block ([`Rendered::thinking_open`]).
    pub thinking_open: bool,
}

/// The prompt of `chat`: rendered with `template` (without one, the messages' texts
/// joined by newlines), marked data tokenized as text, and the opening of a tool call
/// that `chat.tool_choice` requires. Errors: those of [`ChatTemplate::render`], and tools
/// or a required call that the template has no way to render.
pub fn chat_prompt(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    chat: &Chat,
) -> Result<ChatPrompt> {
    let Some(template) = template else {
        if !chat.tools.is_empty() {
            return Err(Error::InvalidInput(
                "this model has no chat template, so it cannot be given tools".into(),
            ));
        }
        let mut rendered = Rendered::default();
        for (i, m) in chat.messages.iter().enumerate() {
            if i > 0 {
                rendered.push_markup("\n");
            }
            rendered.push_data(tokenizer, &m.content);
        }
        return Ok(ChatPrompt {
            ids: rendered.encode(tokenizer)?,
            ..Default::default()
        });
    };
    let mut rendered = template.render(tokenizer, chat)?;
    let thinking_open = rendered.thinking_open();
    let opening = template.tool_call_opening(tokenizer, chat)?;
    let reply_prefix = opening
        .as_ref()
        .map_or(String::new(), |o| o.text(tokenizer));
    if let Some(o) = &opening {
        rendered.0.push_str(&o.0);
    }
    Ok(ChatPrompt {
        ids: rendered.encode(tokenizer)?,
        reply_prefix,
        thinking_open: thinking_open && opening.is_none(),
    })
}

impl ChatTemplate {
    /// Reads the template of the model in `dir`. `Ok(None)` if the model has none.
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let cfg_path = dir.join("tokenizer_config.json");
        let mut source = None;
        let (mut bos_token, mut eos_token) = (String::new(), String::new());
        if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
            let cfg: Value = serde_json::from_str(&text).map_err(|e| Error::Json {
                path: cfg_path.clone(),
                message: e.to_string(),
            })?;
            source = match cfg.get("chat_template") {
                Some(Value::String(t)) => Some(t.clone()),
                // Named templates: [{"name": "default", "template": ...}, ...].
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str())
                    .map(str::to_string),
                _ => None,
            };
            let token = |k: &str| {
                cfg.get(k)
                    .and_then(|v| {
                        v.as_str()
                            .or_else(|| v.get("content").and_then(|c| c.as_str()))
                    })
                    .unwrap_or_default()
                    .to_string()
            };
            bos_token = token("bos_token");
            eos_token = token("eos_token");
        }
        // chat_template.jinja takes precedence, as in transformers.
        let jinja = dir.join("chat_template.jinja");
        let (source, path) = match source {
            _ if jinja.exists() => (
                std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?,
                jinja,
            ),
            Some(s) => (s, cfg_path),
            None => return Ok(None),
        };
        Ok(Some(ChatTemplate {
            source,
            path,
            bos_token,
            eos_token,
        }))
    }

    /// The template's source text (Ollama's `/api/show` reports it).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template has a thinking switch (Qwen3's `enable_thinking`).
    pub fn has_thinking_switch(&self) -> bool {
        self.source.contains("enable_thinking")
    }

    /// How this template asks for tool calls, if it does.
    pub fn tool_call_format(&self) -> Option<ToolCallFormat> {
        if self.source.contains("<function=") {
            Some(ToolCallFormat::Xml)
        } else if self.source.contains("<tool_call>") {
            Some(ToolCallFormat::Json)
        } else {
            None
        }
    }

    /// Renders `chat` with the assistant's turn opened (`add_generation_prompt`). The
    /// template gets `messages`, `tools` (none when there are none, as transformers passes
    /// them), `add_generation_prompt`, `bos_token`, `eos_token` and every key of
    /// `chat.kwargs` (which may override the two tokens, as in transformers). Errors
    /// ([`Error::Template`]): a template that does not compile or refuses the input
    /// (`raise_exception`), a reserved variable in `kwargs`, tools given to a template that
    /// does not render them.
    pub fn render(&self, tokenizer: &Tokenizer, chat: &Chat) -> Result<Rendered> {
        let err = |message: String| Error::Template {
            path: self.path.clone(),
            message,
        };
        if let Some(k) = RESERVED_KWARGS
            .iter()
            .find(|k| chat.kwargs.contains_key(**k))
        {
            return Err(err(format!(
                "template variable `{k}` is set by the request itself, not in its kwargs"
            )));
        }
        if !chat.tools.is_empty() && !self.source.contains("tools") {
            return Err(err(
                "this model's chat template does not render tools, so it cannot be given any"
                    .into(),
            ));
        }
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_filter("tojson", python_tojson);
        env.add_template("chat", &self.source)
            .map_err(|e| err(e.to_string()))?;
        let mark = |v: Value| mark_strings(tokenizer, v);
        let mut context = Map::new();
        context.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        context.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        for (k, v) in &chat.kwargs {
            context.insert(k.clone(), mark(v.clone()));
        }
        let mut messages = serde_json::to_value(&chat.messages)
            .map_err(|e| Error::Internal(format!("messages: {e}")))?;
        if chat.images().next().is_some() {
            if !self.source.contains("image") {
                return Err(err(
                    "this model's chat template does not render images, so it cannot be given any"
                        .into(),
                ));
            }
            for (m, v) in chat
                .messages
                .iter()
                .zip(messages.as_array_mut().into_iter().flatten())
            {
                if !m.images.is_empty() {
                    v["content"] = content_parts(m)?;
                }
            }
        }
        context.insert("messages".into(), mark(messages));
        context.insert(
            "tools".into(),
            match chat.tools.is_empty() {
                true => Value::Null,
                false => mark(Value::Array(chat.tools.clone())),
            },
        );
        context.insert("add_generation_prompt".into(), Value::Bool(true));
        let text = env
            .get_template("chat")
            .and_then(|t| t.render(minijinja::Value::from_serialize(&context)))
            .map_err(|e| err(e.to_string()))?;
        Ok(Rendered(text))
    }

    /// The opening of the tool call `chat.tool_choice` requires, to put at the end of the
    /// prompt (the model continues the call; no constrained decoding). `None` for `auto`
    /// and `none`, or without tools. Errors: a required call with a template that has no
    /// tool-call format, or naming a function that is not among the tools.
    fn tool_call_opening(&self, tokenizer: &Tokenizer, chat: &Chat) -> Result<Option<Rendered>> {
        let name = match &chat.tool_choice {
            ToolChoice::Auto | ToolChoice::None => return Ok(None),
            _ if chat.tools.is_empty() => return Ok(None),
            ToolChoice::Required => None,
            ToolChoice::Function(name) => {
                if !chat.tools.iter().any(|t| tool_name(t) == Some(name)) {
                    return Err(Error::InvalidInput(format!(
                        "tool_choice names `{name}`, which is not among the tools"
                    )));
                }
                Some(name)
            }
        };
        let Some(format) = self.tool_call_format() else {
            return Err(Error::InvalidInput(
                "this model's chat template has no tool-call format, so a tool call cannot be required"
                    .into(),
            ));
        };
        let mut opening = Rendered::default();
        match (format, name) {
            (ToolCallFormat::Json, None) => opening.push_markup("<tool_call>\n{\"name\": \""),
            (ToolCallFormat::Json, Some(name)) => {
                opening.push_markup("<tool_call>\n{\"name\": ");
                opening.push_data(tokenizer, &Value::String(name.clone()).to_string());
                opening.push_markup(", \"arguments\": ");
            }
            (ToolCallFormat::Xml, None) => opening.push_markup("<tool_call>\n<function="),
            (ToolCallFormat::Xml, Some(name)) => {
                opening.push_markup("<tool_call>\n<function=");
                opening.push_data(tokenizer, name);
                opening.push_markup(">\n");
            }
        }
        Ok(Some(opening))
    }
}

/// A tool definition's function name (`{"function": {"name": ...}}`, or `{"name": ...}`).
pub fn tool_name(tool: &Value) -> Option<&str> {
    tool.get("function").unwrap_or(tool).get("name")?.as_str()
}

/// `value` with every string (keys included) marked as data.
/// A message's content as transformers passes parts to a template: its text cut at its
/// images' offsets, `{"type": "text", "text": ...}` and `{"type": "image"}` in order.
/// Errors: an offset beyond the text or inside a character.
fn content_parts(m: &Message) -> Result<Value> {
    let mut parts = Vec::new();
    let mut done = 0;
    let text = |s: &str| serde_json::json!({"type": "text", "text": s});
    for image in &m.images {
        if image.at < done || !m.content.is_char_boundary(image.at) {
            return Err(Error::InvalidInput(format!(
                "an image at byte {} of a message of {} bytes",
                image.at,
                m.content.len()
            )));
        }
        if image.at > done {
            parts.push(text(&m.content[done..image.at]));
        }
        parts.push(serde_json::json!({"type": "image"}));
        done = image.at;
    }
    if done < m.content.len() {
        parts.push(text(&m.content[done..]));
    }
    Ok(Value::Array(parts))
}

fn mark_strings(tokenizer: &Tokenizer, value: Value) -> Value {
    match value {
        Value::String(s) => Value::String(tokenizer.mark_data(&s)),
        Value::Array(items) => Value::Array(
            items
                .into_iter()
                .map(|v| mark_strings(tokenizer, v))
                .collect(),
        ),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (tokenizer.mark_data(&k), mark_strings(tokenizer, v)))
                .collect(),
        ),
        v => v,
    }
}

/// transformers' `tojson` filter: Python's `json.dumps(x, ensure_ascii=False,
/// indent=indent)`, so `", "` and `": "` between items (`","` with an indent), no HTML
/// escaping (minijinja's own filter writes `<` as `\u003c`), keys in their order, floats
/// as Python's `repr`.
fn python_tojson(
    value: &minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = " ".repeat(n);
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                PythonJson {
                    indent: Some(pad.as_bytes()),
                    level: 0,
                    has_value: false,
                },
            );
            value.serialize(&mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                PythonJson {
                    indent: None,
                    level: 0,
                    has_value: false,
                },
            );
            value.serialize(&mut ser)
        }
    };
    written.map_err(|e| {
        minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("tojson: {e}"),
        )
    })?;
    let text = String::from_utf8(out).map_err(|e| {
        minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("tojson: {e}"),
        )
    })?;
    Ok(minijinja::Value::from_safe_string(text))
}

/// A serde_json formatter writing what Python's `json.dumps` writes.
struct PythonJson<'a> {
    indent: Option<&'a [u8]>,
    level: usize,
    has_value: bool,
}

impl PythonJson<'_> {
    fn open<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    /// Closes a container, on a line of its own when it had items and an indent.
    fn close<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(bracket)
    }

    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(pad) = self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(pad)?;
            }
        }
        Ok(())
    }

    fn separator<W: ?Sized + std::io::Write>(&self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }
}

impl serde_json::ser::Formatter for PythonJson<'_> {
    fn write_f64<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        value: f64,
    ) -> std::io::Result<()> {
        w.write_all(python_float_repr(value).as_bytes())
    }

    fn write_f32<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        value: f32,
    ) -> std::io::Result<()> {
        w.write_all(python_float_repr(value as f64).as_bytes())
    }

    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }

    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }

    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.separator(w, first)
    }

    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }

    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.separator(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }

    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip, positional for decimal
/// exponents in [-4, 16), else `d.ddde+XX` with at least two exponent digits.
fn python_float_repr(value: f64) -> String {
    if !value.is_finite() {
        return match value {
            v if v.is_nan() => "NaN".into(),
            v if v > 0.0 => "Infinity".into(),
            _ => "-Infinity".into(),
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: `-1.2345e3`.
    let sci = format!("{value:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if (point as usize) >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{body}")
    } else {
        let frac = &digits[1..];
        let mantissa = if frac.is_empty() {
            digits[..1].to_string()
        } else {
            format!("{}.{frac}", &digits[..1])
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        for (v, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456789.125, "123456789.125"),
            (1e22, "1e+22"),
            (0.0, "0.0"),
        ] {
            assert_eq!(python_float_repr(v), want, "{v}");
        }
    }

    #[test]
    fn tojson_writes_what_json_dumps_writes() {
        let v = minijinja::Value::from_serialize(serde_json::json!({
            "b": [1, 2.5, "x<y>&'"], "a": {}, "c": [], "d": {"e": null, "f": true}
        }));
        let kw = |indent: Option<usize>| {
            minijinja::value::Kwargs::from_iter(
                indent.map(|i| ("indent", minijinja::Value::from(i))),
            )
        };
        let compact = python_tojson(&v, kw(None)).unwrap().to_string();
        // json.dumps({"b": [1, 2.5, "x<y>&'"], "a": {}, "c": [], "d": {"e": None, "f": True}})
        assert_eq!(
            compact,
            r#"{"b": [1, 2.5, "x<y>&'"], "a": {}, "c": [], "d": {"e": null, "f": true}}"#
        );
        let indented = python_tojson(&v, kw(Some(2))).unwrap().to_string();
        assert_eq!(
            indented,
            "{\n  \"b\": [\n    1,\n    2.5,\n    \"x<y>&'\"\n  ],\n  \"a\": {},\n  \"c\": [],\n  \"d\": {\n    \"e\": null,\n    \"f\": true\n  }\n}"
        );
    }
}
