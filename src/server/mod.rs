//! `slotstream serve`: an OpenAI-compatible HTTP API on an [`Engine`].
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (with `stream: true`,
//! server-sent events in OpenAI's chunk format ending with `data: [DONE]`), `GET
//! /v1/models`, `GET /health`, and `GET /stats` (the engine's and the pool's counters).
//!
//! Requests run one at a time in arrival order (the engine's queue); at most
//! [`ServerOptions::queue`] may be running or waiting, and the next one gets 503 with
//! `Retry-After`. A client that disconnects cancels its generation at the next token.
//! A request with `"slotstream_stats": true` gets its statistics in the response (the
//! last streamed chunk) as `slotstream_stats`. Each request logs one line (route, status,
//! tokens, speed) through `tracing`.
//!
//! Chat replies come back as OpenAI's `content`, `reasoning_content` (a thinking model's
//! `<think>` block) and `tool_calls` ([`crate::reply`]).

mod chat_reply;
pub mod error;
pub mod idle;
pub mod openai;
mod request_body;
mod stop;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Path, Request as HttpRequest, State};
use axum::http::{header, Method, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// How long a shutdown waits for requests in progress before the process exits.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

use crate::engine::{Engine, Event, Generation, Input};
use crate::sampling::SamplingOptions;
use chat_reply::ChatReply;
use error::ApiError;
use openai::{ApiRequest, ChatRequest, CompletionRequest, Params, Usage};
use stop::StopMatcher;

/// How the server behaves.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The model's name in `/v1/models`. A request may name any model: the one loaded
    /// serves it (as llama.cpp's server does), and the response echoes the name.
    pub model_id: String,
    /// More names listed in `/v1/models`.
    pub aliases: Vec<String>,
    /// Requests running or waiting at once; more get 503 (at least 1).
    pub queue: usize,
    /// When set, `/v1/...` and `/stats` need `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// New tokens when a request gives no `max_tokens` (capped by the context).
    pub default_max_tokens: usize,
    /// Sampling when a request does not say (a request without `seed` gets a random one).
    pub sampling: SamplingOptions,
    /// A thinking model's `<think>...</think>` comes back as `reasoning_content` (false:
    /// it stays in `content`, `--reasoning-format none`).
    pub reasoning: bool,
    /// Refuse (400) a prompt whose prefill is estimated to take longer than this many
    /// seconds (`--max-prefill-wait`; [`Engine::prefill_estimate`]).
    pub max_prefill_wait: Option<f64>,
}

struct App {
    engine: Engine,
    options: ServerOptions,
    queue: Arc<Semaphore>,
    created: u64,
}

/// The HTTP routes over `engine`.
pub fn router(engine: Engine, options: ServerOptions) -> Router {
    let app = Arc::new(App {
        engine,
        queue: Arc::new(Semaphore::new(options.queue.max(1))),
        options,
        created: unix_now(),
    });
    let authenticated = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/stats", get(stats))
        .route_layer(middleware::from_fn_with_state(app.clone(), authenticate));
    Router::new()
        .route("/health", get(|| async { Json(json!({ "status": "ok" })) }))
        .merge(authenticated)
        .fallback(|uri: Uri| async move { ApiError::no_route(uri.path()) })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::method_not_allowed(&method, uri.path())
        })
        .layer(middleware::from_fn(log_request))
        .with_state(app)
}

/// How long and how many connections the server keeps open.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Time a connection has to send a request's headers (from its opening, or from the
    /// end of its previous request): a client that sends nothing, or trickles its headers,
    /// is closed rather than holding a file descriptor for ever.
    pub header_timeout: Duration,
    /// Connections open at once; further ones wait in the listener's backlog.
    pub connections: usize,
}

impl Default for ConnectionLimits {
    /// 20 s for headers (Apache's default; shorter than the shutdown's grace, so a
    /// half-sent request cannot hold a shutdown to its end); 1,024 connections, fewer where
    /// the open-file limit leaves less room (see [`serve`]). Requests beyond the queue get
    /// 503 anyway.
    fn default() -> Self {
        ConnectionLimits {
            header_timeout: Duration::from_secs(20),
            connections: 1024,
        }
    }
}

/// Descriptors kept free of connections for everything else the process opens
/// (checkpoint shards, prompt-cache snapshots, the listener).
const RESERVED_DESCRIPTORS: usize = 256;

/// Connections that fit the process's open-file limit, at most `wanted`: the soft limit is
/// raised to the hard one first (as Go's runtime does), since 1,024, a common soft limit,
/// would otherwise run out before the connection cap.
fn descriptor_room(wanted: usize) -> usize {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit read or write the struct passed, nothing else.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
            if limit.rlim_cur < limit.rlim_max {
                let raised = libc::rlimit {
                    rlim_cur: limit.rlim_max,
                    rlim_max: limit.rlim_max,
                };
                // SAFETY: as above.
                if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                    limit = raised;
                }
            }
            let room = usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX);
            return wanted.min(room.saturating_sub(RESERVED_DESCRIPTORS).max(16));
        }
    }
    wanted
}

/// Serves `router` on `listener` (HTTP/1.1) within `limits` until Ctrl-C or SIGTERM.
/// Requests in progress then get up to 30 s to finish; a second signal, or the end of
/// that grace, ends the process.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: ConnectionLimits,
) -> std::io::Result<()> {
    serve_until(listener, router, limits, std::future::pending()).await
}

/// As [`serve`], and shuts down the same way when `stop` resolves too (`--idle-exit`:
/// [`idle::Idle::elapsed`]).
pub async fn serve_until(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: ConnectionLimits,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let open = Arc::new(Semaphore::new(descriptor_room(limits.connections).max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut stop = std::pin::pin!(async {
        tokio::select! {
            _ = terminated() => {}
            _ = stop => {}
        }
    });
    loop {
        let permit = tokio::select! {
            permit = open.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
            _ = &mut stop => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // A client that gave up before its connection was taken: nothing to wait on.
                Err(e) if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionRefused
                ) => continue,
                Err(e) => {
                    // Out of file descriptors, say: wait rather than spin.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        // Token-sized SSE writes go out at once rather than waiting on Nagle's algorithm.
        let _ = stream.set_nodelay(true);
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(
                TokioIo::new(stream),
                hyper_util::service::TowerToHyperService::new(router.clone()),
            );
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection closed");
            }
            drop(permit);
        });
    }
    // New clients are refused at once, rather than waiting in the backlog to be reset.
    drop(listener);
    tracing::info!("shutting down: finishing requests in progress (Ctrl-C again to stop now)");
    tokio::select! {
        _ = graceful.shutdown() => Ok(()),
        _ = terminated() => std::process::exit(130),
        _ = tokio::time::sleep(SHUTDOWN_GRACE) => {
            tracing::warn!("requests still open after the grace period");
            std::process::exit(130)
        }
    }
}

/// Resolves at Ctrl-C (SIGINT) or, on Unix, SIGTERM (what `kill` and service managers
/// send). Listening starts at the first poll, and from then on neither signal ends the
/// process by itself.
async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

async fn authenticate(State(app): State<Arc<App>>, request: HttpRequest, next: Next) -> Response {
    if let Some(key) = &app.options.api_key {
        let token = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        if !token.is_some_and(|t| same_secret(t.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

/// Compares in time independent of where the inputs differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Marks a response whose request logs its own line (with its tokens) when it ends.
#[derive(Clone, Copy)]
struct Logged;

/// One log line per request: those that generated log theirs at the end (with tokens and
/// speed), the others here.
async fn log_request(request: HttpRequest, next: Next) -> Response {
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let start = std::time::Instant::now();
    let response = next.run(request).await;
    if response.extensions().get::<Logged>().is_none() {
        tracing::info!(
            "{method} {path} {} in {:.3}s",
            response.status().as_u16(),
            start.elapsed().as_secs_f64()
        );
    }
    response
}

/// The log line of a request that generated.
fn log_generation(route: &str, status: u16, prompt_tokens: usize, outcome: &Outcome) {
    let s = &outcome.stats;
    tracing::info!(
        "POST {route} {status} {}: prompt {prompt_tokens} tokens ({} reused), output {} tokens, prefill {:.1} tok/s, decode {:.1} tok/s",
        outcome.finish_reason,
        s.reused_prompt_tokens,
        outcome.completion_tokens,
        s.prefill_tps,
        s.decode_tps
    );
}

/// The model objects `/v1/models` lists: the loaded model's name, then its aliases, each
/// with the context in tokens (`context_window`, which `launch` hands to the tools).
fn model_objects(app: &App) -> impl Iterator<Item = Value> + '_ {
    let o = &app.options;
    std::iter::once(&o.model_id).chain(&o.aliases).map(|id| {
        json!({ "id": id, "object": "model", "created": app.created, "owned_by": "slotstream",
                          "context_window": app.engine.context() })
    })
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    let data: Vec<Value> = model_objects(&app).collect();
    Json(json!({ "object": "list", "data": data }))
}

/// One listed model (the OpenAI clients' `models.retrieve`); 404 for another name.
async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match model_objects(&app).find(|m| m["id"] == id.as_str()) {
        Some(m) => Json(m).into_response(),
        None => ApiError::no_model(&id).into_response(),
    }
}

async fn stats(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({
        "engine": app.engine.stats(),
        "pool": app.engine.pool_stats(),
        "ngram": app.engine.ngram_counts(),
        "queued_or_running": app.options.queue.max(1) - app.queue.available_permits(),
    }))
}

async fn chat_completions(State(app): State<Arc<App>>, body: Body) -> Response {
    handle::<ChatRequest>(app, Endpoint::Chat, body).await
}

async fn completions(State(app): State<Arc<App>>, body: Body) -> Response {
    handle::<CompletionRequest>(app, Endpoint::Completion, body).await
}

/// Parses and checks a request of either endpoint, then answers it.
async fn handle<R: ApiRequest>(app: Arc<App>, endpoint: Endpoint, body: Body) -> Response {
    // An unreadable body (too large: 413) gets an OpenAI-shaped error too.
    let parsed = request_body::read_body(body)
        .await
        .and_then(|b| R::parse(&b))
        .and_then(|r| Ok((r.input()?, r.common().params(&app.options.sampling)?)));
    match parsed {
        Ok((input, params)) => respond(app, endpoint, input, params).await,
        Err(e) => e.into_response(),
    }
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
}

impl Meta {
    /// A streamed chunk: a chat `delta` (`{}` for none), or a completion's `text` (the
    /// delta's `content`).
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish })
            }
            Endpoint::Completion => {
                json!({ "index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")),
                                            "logprobs": null, "finish_reason": finish })
            }
        };
        self.envelope(choice, true)
    }

    /// A whole response: a chat `message`, or a completion's `text`.
    fn response(&self, body: Value, finish: &str) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({ "index": 0, "message": body, "logprobs": null, "finish_reason": finish })
            }
            Endpoint::Completion => {
                json!({ "index": 0, "text": body, "logprobs": null, "finish_reason": finish })
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
}

/// A request's statistics (`slotstream_stats` in the response).
#[derive(Clone, Debug, Serialize)]
pub struct RequestStats {
    /// Prompt tokens continued from a kept state instead of being run.
    pub reused_prompt_tokens: usize,
    /// Prompt tokens run.
    pub prefill_tokens: usize,
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
}

/// How a generation ended.
struct Outcome {
    completion_tokens: usize,
    finish_reason: &'static str,
    stats: RequestStats,
}

/// The 400 of a prompt whose estimated prefill is longer than `--max-prefill-wait`.
fn prefill_wait_refusal(app: &App, prompt_tokens: usize) -> Option<ApiError> {
    let max = app.options.max_prefill_wait?;
    let why = app.engine.prefill_estimate(prompt_tokens)?.exceeds(max)?;
    Some(ApiError::prefill_wait(why))
}

async fn respond(app: Arc<App>, endpoint: Endpoint, input: Input, params: Params) -> Response {
    // Tokenizing is quick next to the model; it runs here so bad prompts are refused
    // before they queue. A chat's reply is read as reasoning, text and tool calls.
    let engine = app.engine.clone();
    let reasoning = app.options.reasoning;
    let encoded = tokio::task::spawn_blocking(move || match input {
        Input::Chat(chat) => engine
            .encode_chat(&chat)
            .map(|p| (ChatReply::new(&chat, &p, reasoning), p.ids))
            .map(|(reply, ids)| (ids, Some(reply))),
        other => engine.encode(&other).map(|ids| (ids, None)),
    })
    .await;
    let (prompt, reply) = match encoded {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return ApiError::engine(&e).into_response(),
        Err(e) => return ApiError::engine(&crate::Error::Internal(e.to_string())).into_response(),
    };
    let prompt_tokens = prompt.len();
    if let Some(refusal) = prefill_wait_refusal(&app, prompt_tokens) {
        return refusal.into_response();
    }
    let request = match openai::request(
        prompt,
        &params,
        app.engine.context(),
        app.options.default_max_tokens,
    ) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let Ok(permit) = app.queue.clone().try_acquire_owned() else {
        return ApiError::busy(app.options.queue).into_response();
    };
    let prefix = if endpoint == Endpoint::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let meta = Meta {
        endpoint,
        id: format!("{prefix}-{:016x}", rand::random::<u64>()),
        created: unix_now(),
        model: params
            .model
            .clone()
            .unwrap_or_else(|| app.options.model_id.clone()),
        prompt_tokens,
    };
    let generation = app.engine.generate(request);
    if params.stream {
        let mut response = stream_response(meta, generation, params, reply, permit);
        response.extensions_mut().insert(Logged);
        return response;
    }
    let _permit = permit;
    let mut text = String::new();
    let outcome = match drive(generation, params.stops.clone(), |piece| {
        text.push_str(&piece);
        true
    })
    .await
    {
        Ok(Some(outcome)) => outcome,
        Ok(None) => {
            return ApiError::engine(&crate::Error::Internal("generation ended early".into()))
                .into_response()
        }
        Err(e) => return ApiError::engine(&e).into_response(),
    };
    let mut body = match reply {
        Some(reply) => {
            let message = reply.message(&text);
            let finish = match message.get("tool_calls") {
                Some(_) => "tool_calls",
                None => outcome.finish_reason,
            };
            meta.response(message, finish)
        }
        None => meta.response(json!(text), outcome.finish_reason),
    };
    body["usage"] = json!(Usage::new(prompt_tokens, outcome.completion_tokens));
    if params.stats {
        body["slotstream_stats"] = json!(outcome.stats);
    }
    log_generation(endpoint.route(), 200, prompt_tokens, &outcome);
    let mut response = Json(body).into_response();
    response.extensions_mut().insert(Logged);
    response
}

/// Server-sent events for one request. The events are produced by a task that owns the
/// generation and the queue permit; when the client goes away the body (and with it the
/// channel) is dropped, the task's next send fails, and dropping the generation cancels
/// it.
fn stream_response(
    meta: Meta,
    generation: Generation,
    params: Params,
    mut reply: Option<ChatReply>,
    permit: OwnedSemaphorePermit,
) -> Response {
    let (tx, rx) = mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        let _permit = permit;
        let gone = || {
            tracing::info!(
                "POST {} 499 (streamed): the client went away",
                meta.endpoint.route()
            )
        };
        if meta.endpoint == Endpoint::Chat {
            let first = meta.chunk(json!({ "role": "assistant", "content": "" }), None);
            if tx.send(first.to_string()).is_err() {
                return gone();
            }
        }
        let send = |delta: Value| tx.send(meta.chunk(delta, None).to_string()).is_ok();
        let driven = drive(generation, params.stops.clone(), |piece| match &mut reply {
            Some(r) => r.deltas(&piece).into_iter().all(send),
            None => send(json!({ "content": piece })),
        });
        // A client that leaves while the request waits or prefills has sent nothing to
        // fail on: watch the channel, and drop (cancel) the generation when it closes.
        let result = tokio::select! {
            r = driven => r,
            _ = tx.closed() => return gone(),
        };
        match result {
            Ok(Some(outcome)) => {
                let mut finish = outcome.finish_reason;
                if let Some(r) = &mut reply {
                    if !r.finish_deltas().into_iter().all(send) {
                        return gone();
                    }
                    finish = r.finish_reason(finish);
                }
                let mut last = meta.chunk(json!({}), Some(finish));
                if params.stats {
                    last["slotstream_stats"] = json!(outcome.stats);
                }
                let _ = tx.send(last.to_string());
                if params.include_usage {
                    let mut usage = meta.envelope(json!(null), true);
                    usage["choices"] = json!([]);
                    usage["usage"] =
                        json!(Usage::new(meta.prompt_tokens, outcome.completion_tokens));
                    let _ = tx.send(usage.to_string());
                }
                log_generation(meta.endpoint.route(), 200, meta.prompt_tokens, &outcome);
            }
            Ok(None) => return gone(),
            Err(e) => {
                let error = ApiError::engine(&e);
                tracing::info!(
                    "POST {} {} (streamed): {}",
                    meta.endpoint.route(),
                    error.status.as_u16(),
                    error.message
                );
                let _ = tx.send(error.body().to_string());
            }
        }
        let _ = tx.send("[DONE]".into());
    });
    let events = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|data| (Ok::<_, Infallible>(SseEvent::default().data(data)), rx))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Runs `generation` through the stop sequences, handing released text to `on_text`
/// (which returns `false` when nobody listens any more: then this returns `Ok(None)` and
/// dropping the generation cancels it).
async fn drive(
    mut generation: Generation,
    stops: Vec<String>,
    mut on_text: impl FnMut(String) -> bool,
) -> crate::Result<Option<Outcome>> {
    let mut matcher = StopMatcher::new(stops);
    let mut stopped = false;
    // Tokens up to the one that completed a stop sequence (later ones were already under
    // way when it was found, and are neither returned nor counted).
    let mut counted = 0;
    while let Some(event) = generation.next().await {
        match event? {
            Event::Token { text, .. } => {
                if stopped {
                    continue;
                }
                counted += 1;
                let (out, hit) = matcher.push(&text);
                if !out.is_empty() && !on_text(out) {
                    return Ok(None);
                }
                if hit {
                    stopped = true;
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
                if !stopped {
                    let (mut out, hit) = matcher.push(&tail);
                    stopped = hit;
                    if !hit {
                        out.push_str(&matcher.finish());
                    }
                    if !out.is_empty() && !on_text(out) {
                        return Ok(None);
                    }
                }
                let finish_reason = if !stopped && stats.finish_reason == "length" {
                    "length"
                } else {
                    "stop"
                };
                let request_stats = RequestStats {
                    reused_prompt_tokens: reused_tokens,
                    prefill_tokens: stats.prompt_tokens,
                    prefill_tps: stats.prefill_tps,
                    decode_tps: stats.decode_tps,
                    hit_rate: pool.as_ref().map(|p| p.hit_rate),
                    bytes_read: pool.as_ref().map_or(0, |p| p.bytes_read),
                    prefetches_used: pool.as_ref().map_or(0, |p| p.prefetches_used),
                    prefetches_wasted: pool.as_ref().map_or(0, |p| p.prefetches_wasted),
                    decode_wait_seconds: pool.as_ref().map_or(0.0, |p| p.decode_wait_seconds),
                };
                return Ok(Some(Outcome {
                    completion_tokens: if stopped { counted } else { output_ids.len() },
                    finish_reason,
                    stats: request_stats,
                }));
            }
        }
    }
    Ok(None)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
