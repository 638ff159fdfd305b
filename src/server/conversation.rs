//! The conversation core under every dialect: a dialect module turns its request into a
//! [`Conversation`] (the engine's input, sampling, stops and limits) and reads the
//! [`Turn`] that [`start`] runs back into its wire format. Rendering (the chat template),
//! tokenizing, the context bound, the queue, stop sequences, the reply's split into
//! reasoning, text and tool calls ([`crate::reply`]), the prompt cache (inside the engine)
//! and the request's log line happen here once, whichever dialect asked.

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::stop::StopMatcher;
use super::App;
use crate::chat_template::{Chat, ChatPrompt, ToolChoice};
use crate::constraint::{tool_call_grammar, Constraint, Grammar};
use crate::engine::{Engine, Event, Generation, Input, Request};
use crate::reply::{Reply, ReplyOptions, ReplyParser, ReplyPart};
use crate::sampling::{SamplingOptions, TokenLogprobs};

/// What a dialect's request asks, translated.
pub struct Conversation {
    /// The prompt: a chat for the template, or raw text or ids.
    pub input: Input,
    /// Sampling, stops, the token limit, streaming, the model's name.
    pub params: Params,
    /// The route, for the request's log line.
    pub route: &'static str,
}

/// Why a reply ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model ended its turn (an end-of-sequence token).
    EndOfTurn,
    /// This stop sequence appeared (it is not part of the text).
    StopSequence(String),
    /// The token limit or the context was reached.
    Length,
    /// The reply called tools.
    ToolCalls,
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn openai(&self) -> &'static str {
        match self {
            Finish::EndOfTurn | Finish::StopSequence(_) => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

/// A request's statistics (`slotstream_stats` in OpenAI responses; the timings of
/// Ollama's final chunk).
#[derive(Clone, Debug, Default, Serialize)]
pub struct RequestStats {
    /// Prompt tokens continued from a kept state instead of being run.
    pub reused_prompt_tokens: usize,
    /// Prompt tokens run.
    pub prefill_tokens: usize,
    /// Seconds of prefill (the prompt's tokens run).
    pub prefill_seconds: f64,
    /// Seconds of decode (after the first new token).
    pub decode_seconds: f64,
    pub prefill_tps: f64,
    pub decode_tps: f64,
    /// Pool hit rate (null when experts are not streamed through a pool).
    pub hit_rate: Option<f64>,
    /// Bytes read from disk through the pool (demand, speculative, prefill sweeps,
    /// admission, n-gram rows: [`crate::pool::PoolStats::bytes_read`]).
    pub bytes_read: u64,
    pub prefetches_used: u64,
    pub prefetches_wasted: u64,
    /// Seconds of decode spent waiting on expert reads.
    pub decode_wait_seconds: f64,
    /// Draft tokens the MTP head proposed, those accepted, and verify passes (0 when the
    /// request did not draft).
    pub drafted: usize,
    pub accepted: usize,
    pub verify_passes: usize,
}

/// How a reply ended.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// New tokens counted (up to the one that completed a stop sequence).
    pub completion_tokens: usize,
    pub finish: Finish,
    pub stats: RequestStats,
    /// Every counted token's log-probabilities, when the request asked ([`Params::logprobs`]);
    /// filled by [`Turn::collect`] (a stream has them as [`TurnEvent::Logprobs`]).
    pub logprobs: Vec<TokenLogprob>,
}

/// A generated token's log-probability and the most probable tokens' at its step, as
/// OpenAI's chat `logprobs.content` entries and Ollama's `logprobs` show them (natural
/// logarithms of the model's own distribution, before penalties, filters and masks).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// The token's text (its bytes read as UTF-8, a partial character replaced).
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    /// Most probable first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// One of the most probable tokens at a step ([`TokenLogprob::top_logprobs`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// The generated tokens' `logprobs` with their texts and bytes. Errors: the vocabulary
/// cannot be read ([`Engine::token_bytes`]).
fn token_logprobs(
    engine: &Engine,
    steps: Vec<(u32, TokenLogprobs)>,
) -> crate::Result<Vec<TokenLogprob>> {
    let ids: Vec<u32> = steps
        .iter()
        .flat_map(|(id, l)| std::iter::once(*id).chain(l.top.iter().map(|t| t.0)))
        .collect();
    let mut bytes = engine.token_bytes(&ids)?.into_iter();
    let mut next = || {
        let b = bytes.next().unwrap_or_default();
        (String::from_utf8_lossy(&b).into_owned(), b)
    };
    Ok(steps
        .into_iter()
        .map(|(_, l)| {
            let (token, bytes) = next();
            let top_logprobs = l
                .top
                .iter()
                .map(|&(_, logprob)| {
                    let (token, bytes) = next();
                    TopLogprob {
                        token,
                        logprob,
                        bytes,
                    }
                })
                .collect();
            TokenLogprob {
                token,
                logprob: l.logprob,
                bytes,
                top_logprobs,
            }
        })
        .collect())
}

/// What a running turn yields, in order: parts (with the log-probabilities of their
/// tokens before them, when asked), then one `Done` or `Failed`.
#[derive(Debug)]
pub enum TurnEvent {
    /// The log-probabilities of tokens generated since the last ones (their text is in the
    /// parts that follow; a part may be held back, as a tool call is until it closes).
    Logprobs(Vec<TokenLogprob>),
    /// Reasoning, text or a whole tool call.
    Part(ReplyPart),
    Done(Outcome),
    /// The generation failed after it was accepted (a stream has sent its headers).
    Failed(ApiError),
}

/// A conversation accepted and queued: its events arrive as the engine runs it. Dropping
/// it cancels the generation (at the next token, or before it starts).
pub struct Turn {
    /// Tokens of the rendered prompt.
    pub prompt_tokens: usize,
    /// The model's name as the request gave it (else the served one), for responses.
    pub model: String,
    events: mpsc::UnboundedReceiver<TurnEvent>,
}

impl Turn {
    /// The next event; `None` after `Done` or `Failed`.
    pub async fn next(&mut self) -> Option<TurnEvent> {
        self.events.recv().await
    }

    /// The whole reply (for a response that is not streamed). Errors: the generation's.
    pub async fn collect(mut self) -> Result<(Reply, Outcome), ApiError> {
        let mut reply = Reply::default();
        let mut logprobs = Vec::new();
        while let Some(event) = self.next().await {
            match event {
                TurnEvent::Logprobs(l) => logprobs.extend(l),
                TurnEvent::Part(part) => reply.extend([part]),
                TurnEvent::Done(mut outcome) => {
                    outcome.logprobs = logprobs;
                    return Ok((reply, outcome));
                }
                TurnEvent::Failed(e) => return Err(e),
            }
        }
        Err(ended_early())
    }
}

/// Renders and tokenizes `conversation`, compiles its grammar, checks it against the
/// context, takes a place in the queue and starts it. Errors (before anything is sent): a
/// prompt the template or tokenizer refuses, a grammar llguidance refuses (400 with its
/// message), one that does not fit the context (400 `context_length_exceeded`), a full
/// queue (503).
pub async fn start(app: &Arc<App>, conversation: Conversation) -> Result<Turn, ApiError> {
    let engine = app.engine()?.clone();
    let Conversation {
        input,
        params,
        route,
    } = conversation;
    // Tokenizing is quick next to the model; it runs here so bad prompts are refused
    // before they queue.
    let reasoning = app.options.reasoning;
    let encoder = engine.clone();
    let mut grammar = params.grammar.clone();
    // Compiling a grammar is CPU work (milliseconds for a schema); it runs here too.
    let encoded = tokio::task::spawn_blocking(move || {
        let (ids, options, reply_prefix, thinking_open) = match input {
            Input::Chat(chat) => {
                let prompt = encoder.encode_chat(&chat)?;
                let options = reply_options(&chat, &prompt, reasoning);
                grammar = tool_grammar(&encoder, &chat, grammar)?;
                let images: Vec<_> = chat.images().map(|i| i.bytes.clone()).collect();
                (
                    match images.is_empty() {
                        true => Input::Ids(prompt.ids),
                        false => Input::IdsWithImages(prompt.ids, images),
                    },
                    options,
                    prompt.reply_prefix,
                    prompt.thinking_open,
                )
            }
            // Raw text and ids: the reply is all text.
            other => (
                Input::Ids(encoder.encode(&other)?),
                ReplyOptions::default(),
                String::new(),
                false,
            ),
        };
        let constraint = grammar
            .map(|g| encoder.constrain(&g.grammar, thinking_open, g.field))
            .transpose()?;
        Ok::<_, crate::Error>((ids, options, reply_prefix, constraint))
    })
    .await;
    let (prompt, options, reply_prefix, constraint) = match encoded {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return Err(ApiError::engine(&e)),
        Err(e) => return Err(ApiError::engine(&crate::Error::Internal(e.to_string()))),
    };
    let prompt_tokens = match &prompt {
        Input::Ids(ids) | Input::IdsWithImages(ids, _) => ids.len(),
        _ => 0,
    };
    if let Some(max) = app.options.max_prefill_wait {
        if let Some(why) = engine
            .prefill_estimate(prompt_tokens)
            .and_then(|e| e.exceeds(max))
        {
            return Err(ApiError::prefill_wait(why));
        }
    }
    let request = request(
        prompt,
        &params,
        constraint,
        engine.context(),
        app.options.default_max_tokens,
    )?;
    let Ok(permit) = app.queue.clone().try_acquire_owned() else {
        return Err(ApiError::busy(app.options.queue));
    };
    let mut parser = ReplyParser::new(options);
    let (tx, rx) = mpsc::unbounded_channel();
    // A required call's opening is in the prompt: the reply continues it.
    let opening = parser.push(&reply_prefix);
    let generation = engine.generate(request);
    let live = app.live.begin(prompt_tokens, generation.progress());
    let stops = params.stops.clone();
    let shared = app.clone();
    let resolver = engine.clone();
    let accepted = Instant::now();
    tokio::spawn(async move {
        let _permit = permit;
        let gone = || tracing::info!("POST {route} 499: the client went away");
        let mut calls = 0usize;
        let mut send = |part: ReplyPart| {
            calls += usize::from(matches!(part, ReplyPart::ToolCall(_)));
            tx.send(TurnEvent::Part(part)).is_ok()
        };
        if !opening.into_iter().all(&mut send) {
            return gone();
        }
        let mut last_token: Option<Instant> = None;
        let on_token = || {
            match last_token {
                None => shared.metrics.first_token(accepted.elapsed()),
                Some(t) => shared.metrics.next_token(t.elapsed()),
            }
            last_token = Some(Instant::now());
            live.token();
        };
        let sender = tx.clone();
        let driven = drive(generation, stops, on_token, |piece, steps| {
            if !steps.is_empty() {
                match token_logprobs(&resolver, steps) {
                    Ok(l) => {
                        if sender.send(TurnEvent::Logprobs(l)).is_err() {
                            return false;
                        }
                    }
                    // The vocabulary was read when the request was checked; a failure here
                    // leaves the log-probabilities out rather than the reply.
                    Err(e) => tracing::warn!("log-probabilities left out: {e}"),
                }
            }
            parser.push(&piece).into_iter().all(&mut send)
        });
        // A client that leaves while the request waits or prefills has been sent nothing
        // to fail on: watch the channel, and drop (cancel) the generation when it closes.
        let result = tokio::select! {
            r = driven => r,
            _ = tx.closed() => return gone(),
        };
        match result {
            Ok(Some(mut outcome)) => {
                if !parser.finish().into_iter().all(&mut send) {
                    return gone();
                }
                if calls > 0 {
                    outcome.finish = Finish::ToolCalls;
                }
                log_generation(route, 200, prompt_tokens, &outcome);
                shared.metrics.finished(prompt_tokens, &outcome);
                live.finished(&outcome);
                let _ = tx.send(TurnEvent::Done(outcome));
            }
            Ok(None) => gone(),
            Err(e) => {
                let error = ApiError::engine(&e);
                tracing::info!("POST {route} {}: {}", error.status.as_u16(), error.message);
                let _ = tx.send(TurnEvent::Failed(error));
            }
        }
    });
    Ok(Turn {
        prompt_tokens,
        model: params
            .model
            .clone()
            .unwrap_or_else(|| app.options.model_id.clone()),
        events: rx,
    })
}

/// The grammar of a chat's reply: its tool calls' ([`tool_call_grammar`]: a call that
/// `tool_choice` requires, or `auto` with a `strict: true` tool) in the template's
/// tool-call format, else the request's own (`requested`). A required call takes
/// precedence over a `response_format`; `auto` with a strict tool does not.
fn tool_grammar(
    engine: &Engine,
    chat: &Chat,
    requested: Option<GrammarField>,
) -> crate::Result<Option<GrammarField>> {
    let required = matches!(
        chat.tool_choice,
        ToolChoice::Required | ToolChoice::Function(_)
    );
    if requested.is_some() && !required {
        return Ok(requested);
    }
    let format = engine.template()?.and_then(|t| t.tool_call_format());
    let calls = format.and_then(|f| tool_call_grammar(f, &chat.tools, &chat.tool_choice));
    Ok(match calls {
        Some(grammar) => Some(GrammarField {
            grammar,
            field: "tools",
        }),
        None => requested,
    })
}

/// How the reply to `chat`, whose prompt is `prompt`, is read: reasoning split off when
/// `reasoning` (and from the start when the prompt opened `<think>`), tool calls parsed
/// when tools were given and `tool_choice` is not `none`, the first call alone when the
/// request asked for one call (`parallel_tool_calls: false`, Anthropic's
/// `disable_parallel_tool_use`).
fn reply_options(chat: &Chat, prompt: &ChatPrompt, reasoning: bool) -> ReplyOptions {
    let parses_tools = !chat.tools.is_empty() && chat.tool_choice != ToolChoice::None;
    ReplyOptions {
        reasoning,
        thinking_open: prompt.thinking_open,
        tools: parses_tools.then(|| chat.tools.clone()),
        single_call: chat.single_tool_call,
    }
}

/// Tokens of the prompt `input` stands for, rendered and tokenized as [`start`] would.
/// Errors: those [`start`] gives before queueing.
pub async fn count_tokens(app: &Arc<App>, input: Input) -> Result<usize, ApiError> {
    let engine = app.engine()?.clone();
    match tokio::task::spawn_blocking(move || engine.encode(&input)).await {
        Ok(Ok(ids)) => Ok(ids.len()),
        Ok(Err(e)) => Err(ApiError::engine(&e)),
        Err(e) => Err(ApiError::engine(&crate::Error::Internal(e.to_string()))),
    }
}

/// What the request asks of the engine besides its input, after checks.
pub struct Params {
    /// The model the request named, echoed in the response.
    pub model: Option<String>,
    /// New tokens at most (`None`: the server's default); capped by the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingOptions,
    /// Stop sequences: the reply ends before the first (which is not returned).
    pub stops: Vec<String>,
    /// Whether the answer streams.
    pub stream: bool,
    /// OpenAI's `stream_options.include_usage`: a last chunk with the token counts.
    pub include_usage: bool,
    /// slotstream's `slotstream_stats` (OpenAI's dialect): the request's statistics in the
    /// response.
    pub stats: bool,
    /// Log-probabilities of each token with this many of the most probable tokens'
    /// (`None`: none).
    pub logprobs: Option<usize>,
    /// The grammar the reply must match, and the request field that gave it.
    pub grammar: Option<GrammarField>,
}

/// A request's grammar and the field that gave it (named in a 400 when llguidance
/// refuses the grammar).
#[derive(Clone, Debug)]
pub struct GrammarField {
    pub grammar: Grammar,
    pub field: &'static str,
}

/// Checks tool definitions in OpenAI's chat shape (`{"type": "function", "function":
/// {"name", ...}}`), which every dialect's tools are given to the template in. Errors
/// name the tool at fault.
pub fn check_tools(tools: &[Value]) -> Result<(), ApiError> {
    for (i, tool) in tools.iter().enumerate() {
        if tool.get("type").is_some_and(|t| t != "function")
            || crate::chat_template::tool_name(tool).is_none()
        {
            return Err(ApiError::invalid(
                &format!("tools[{i}]"),
                "must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ));
        }
    }
    Ok(())
}

/// Stop sequences a request may give in dialects that set no limit of their own (each
/// is matched against the text after every token).
pub const MAX_STOPS: usize = 16;

/// Refuses a `tool_choice` that requires a call when there are no tools to call.
pub fn require_tools(choice: &ToolChoice, tools: &[Value]) -> Result<(), ApiError> {
    if matches!(choice, ToolChoice::Required | ToolChoice::Function(_)) && tools.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "requires a tool call, but no tools were given",
        ));
    }
    Ok(())
}

/// The most bytes one image of a request may take once its base64 is decoded (20 MiB).
pub const MAX_IMAGE_BYTES: usize = 20 << 20;

/// An image sent as base64 text (Anthropic's and Ollama's images, a `data:` URL's
/// payload): its bytes, which the engine decodes. Errors (400 naming `field`): not
/// base64, over [`MAX_IMAGE_BYTES`].
pub fn image_base64(field: &str, data: &str) -> Result<Arc<[u8]>, ApiError> {
    use base64::Engine as _;
    let data = data.trim();
    if data.len() / 4 * 3 > MAX_IMAGE_BYTES + 3 {
        return Err(ApiError::invalid(
            field,
            &format!("the image is over {} MiB", MAX_IMAGE_BYTES >> 20),
        ));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| ApiError::invalid(field, &format!("not base64: {e}")))?;
    Ok(bytes.into())
}

/// An image given by URL (OpenAI's `image_url`): a `data:` URL's bytes
/// (`data:image/png;base64,...`). Errors (400 naming `field`): an http(s) URL (the server
/// fetches nothing), another scheme, a data URL that is not base64.
pub fn image_url(field: &str, url: &str) -> Result<Arc<[u8]>, ApiError> {
    match url.strip_prefix("data:").and_then(|rest| rest.split_once(',')) {
        Some((meta, data)) if meta.ends_with(";base64") => image_base64(field, data),
        Some(_) => Err(ApiError::invalid(field, "a data: URL must be base64")),
        None if url.starts_with("http://") || url.starts_with("https://") => Err(ApiError::invalid(
            field,
            "image URLs are not fetched: send the image in a data: URL (data:image/png;base64,...)",
        )),
        None => Err(ApiError::invalid(
            field,
            "expected a data: URL (data:image/png;base64,...)",
        )),
    }
}

/// The role a chat template knows for a message's `role`: OpenAI's `developer` is the
/// system prompt (as OpenAI treats it for models without a developer role).
pub fn template_role(role: &str) -> &str {
    match role {
        "developer" => "system",
        other => other,
    }
}

/// Whether a reasoning effort (OpenAI's `reasoning_effort`, the Responses API's
/// `reasoning.effort`) turns thinking on: `none` and `minimal` off, any other on.
pub fn thinks_at(effort: &str) -> bool {
    !matches!(effort, "none" | "minimal")
}

/// The error of a turn whose events stopped before its end (the generation task ended).
pub fn ended_early() -> ApiError {
    ApiError::engine(&crate::Error::Internal("generation ended early".into()))
}

/// The engine request for the `prompt` ids with checked `params` and the compiled
/// `constraint` of their grammar: `max_tokens`
/// defaults to `default_max_tokens`, and either is capped at the room the context leaves
/// after the prompt (the reply then ends with finish reason `length`), as llama-server
/// caps it; `prompt` is ids, with the images their placeholders stand for or without
/// (an image's tokens are counted by the engine, which refuses a prompt they overfill).
/// Errors: a prompt that leaves no room (400 `context_length_exceeded`).
pub fn request(
    prompt: Input,
    params: &Params,
    constraint: Option<Constraint>,
    context: usize,
    default_max_tokens: usize,
) -> Result<Request, ApiError> {
    let held = match &prompt {
        Input::Ids(ids) | Input::IdsWithImages(ids, _) => ids.len(),
        _ => 0,
    };
    let room =
        crate::context::room(held, context).map_err(|e| ApiError::context_length(e.to_string()))?;
    Ok(Request {
        input: prompt,
        max_tokens: params.max_tokens.unwrap_or(default_max_tokens).min(room),
        sampling: params.sampling.clone(),
        logprobs: params.logprobs,
        constraint,
    })
}

/// The log line of a request that generated.
fn log_generation(route: &str, status: u16, prompt_tokens: usize, outcome: &Outcome) {
    let s = &outcome.stats;
    let drafts = match s.drafted {
        0 => String::new(),
        n => format!(
            ", drafts {} of {n} accepted in {} verify passes",
            s.accepted, s.verify_passes
        ),
    };
    tracing::info!(
        "POST {route} {status} {}: prompt {prompt_tokens} tokens ({} reused), output {} tokens, prefill {:.1} tok/s, decode {:.1} tok/s{drafts}",
        outcome.finish.openai(),
        s.reused_prompt_tokens,
        outcome.completion_tokens,
        s.prefill_tps,
        s.decode_tps
    );
}

/// Runs `generation` through the stop sequences, telling `on_token` of each new token
/// and handing released text to `on_text` with the log-probabilities of the counted
/// tokens since the last call (which returns `false` when nobody listens any more: then
/// this returns `Ok(None)` and dropping the generation cancels it).
async fn drive(
    mut generation: Generation,
    stops: Vec<String>,
    mut on_token: impl FnMut(),
    mut on_text: impl FnMut(String, Vec<(u32, TokenLogprobs)>) -> bool,
) -> crate::Result<Option<Outcome>> {
    let mut matcher = StopMatcher::new(stops);
    let mut steps = Vec::new();
    let mut stopped: Option<String> = None;
    // Tokens up to the one that completed a stop sequence (later ones were already under
    // way when it was found, and are neither returned nor counted).
    let mut counted = 0;
    while let Some(event) = generation.next().await {
        match event? {
            Event::Token { id, text, logprobs } => {
                if stopped.is_some() {
                    continue;
                }
                on_token();
                counted += 1;
                steps.extend(logprobs.map(|l| (id, l)));
                let (out, hit) = matcher.push(&text);
                if !out.is_empty() && !on_text(out, std::mem::take(&mut steps)) {
                    return Ok(None);
                }
                if hit.is_some() {
                    stopped = hit;
                    generation.cancel();
                }
            }
            Event::Done {
                output_ids,
                tail,
                reused_tokens,
                stats,
                pool,
            } => {
                let mut out = String::new();
                if stopped.is_none() {
                    let hit;
                    (out, hit) = matcher.push(&tail);
                    if hit.is_none() {
                        out.push_str(&matcher.finish());
                    }
                    stopped = hit;
                }
                let released = !out.is_empty() || !steps.is_empty();
                if released && !on_text(out, std::mem::take(&mut steps)) {
                    return Ok(None);
                }
                let finish = match stopped {
                    Some(stop) => Finish::StopSequence(stop),
                    None if stats.finish_reason == "length" => Finish::Length,
                    None => Finish::EndOfTurn,
                };
                let completion_tokens = match finish {
                    Finish::StopSequence(_) => counted,
                    _ => output_ids.len(),
                };
                let request_stats = RequestStats {
                    reused_prompt_tokens: reused_tokens,
                    prefill_tokens: stats.prompt_tokens,
                    prefill_seconds: stats.prefill_seconds,
                    decode_seconds: stats.decode_seconds,
                    prefill_tps: stats.prefill_tps,
                    decode_tps: stats.decode_tps,
                    hit_rate: pool.as_ref().map(|p| p.hit_rate),
                    bytes_read: pool.as_ref().map_or(0, |p| p.bytes_read),
                    prefetches_used: pool.as_ref().map_or(0, |p| p.prefetches_used),
                    prefetches_wasted: pool.as_ref().map_or(0, |p| p.prefetches_wasted),
                    decode_wait_seconds: pool.as_ref().map_or(0.0, |p| p.decode_wait_seconds),
                    drafted: stats.drafted,
                    accepted: stats.accepted,
                    verify_passes: stats.verify_passes,
                };
                return Ok(Some(Outcome {
                    completion_tokens,
                    finish,
                    stats: request_stats,
                    logprobs: Vec::new(),
                }));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::openai::{ApiRequest, ChatRequest};
    use serde_json::{json, Value};

    const REPLY: &str = "<think>\nweather twice\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>";

    /// The reply options an OpenAI chat request gives.
    fn options(body: Value, reasoning: bool) -> ReplyOptions {
        let request = ChatRequest::parse(body.to_string().as_bytes()).unwrap();
        let Ok(Input::Chat(chat)) = request.input() else {
            panic!("a chat request gives a chat")
        };
        reply_options(&chat, &ChatPrompt::default(), reasoning)
    }

    fn body(extra: Value) -> Value {
        let mut b = json!({
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        });
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    }

    /// `parallel_tool_calls: false` keeps the reply's first call; `true` or absent keeps
    /// both; `tool_choice: none` parses none; reasoning off keeps the think block as text.
    #[test]
    fn requests_set_how_the_reply_is_read() {
        for (extra, calls) in [
            (json!({ "parallel_tool_calls": false }), 1),
            (json!({ "parallel_tool_calls": true }), 2),
            (json!({}), 2),
            (json!({ "tool_choice": "none" }), 0),
        ] {
            let reply = Reply::parse(REPLY, options(body(extra.clone()), true));
            assert_eq!(reply.tool_calls.len(), calls, "{extra}");
            assert_eq!(reply.reasoning, "weather twice");
            if calls > 0 {
                assert_eq!(reply.tool_calls[0].arguments, r#"{"city":"Paris"}"#);
            }
        }
        let reply = Reply::parse("<think>x</think>y", options(body(json!({})), false));
        assert_eq!(reply.content, "<think>x</think>y");
    }
}
