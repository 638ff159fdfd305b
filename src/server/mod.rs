//! `slotstream serve`: the HTTP API on an [`Engine`], in the dialects its users' tools
//! speak, over one conversation core ([`conversation`]):
//!
//! - OpenAI: `POST /v1/chat/completions`, `POST /v1/completions` (with `stream: true`,
//!   server-sent events in OpenAI's chunk format ending with `data: [DONE]`), `GET
//!   /v1/models`, `GET /v1/models/{id}` ([`openai_reply`]), and the Responses API, `POST
//!   /v1/responses` ([`responses`]);
//! - Anthropic Messages: `POST /v1/messages`, `POST /v1/messages/count_tokens`
//!   ([`anthropic`]);
//! - Ollama: `POST /api/chat`, `/api/generate`, `/api/show`, `GET /api/tags`, `/api/ps`,
//!   `/api/version` ([`ollama`]);
//! - `GET /health` (503 `loading` until the model is loaded), `GET /stats` (the engine's
//!   and the pool's counters), `GET /stats/stream` (the same and the resident experts,
//!   live, as server-sent events: [`live`]), `GET /metrics` (Prometheus' scrape,
//!   [`metrics`]);
//! - `GET /`: the web app, a chat beside a live view of the pool ([`web`]).
//!
//! Requests run one at a time in arrival order (the engine's queue); at most
//! [`ServerOptions::queue`] may be running or waiting, and the next one gets 503 with
//! `Retry-After` (Anthropic's dialect: 529 `overloaded_error`). A client that disconnects
//! cancels its generation at the next token. An OpenAI chat or completion request with
//! `"slotstream_stats": true` gets its statistics in the response (the last streamed
//! chunk) as `slotstream_stats`.
//! Each request logs one line (route, status, tokens, speed, or the reason of a refusal)
//! through `tracing`.
//!
//! Chat replies come back as reasoning (a thinking model's `<think>` block), text and
//! tool calls ([`crate::reply`]), in each dialect's fields.

pub mod anthropic;
pub mod conversation;
pub mod error;
pub mod idle;
pub mod live;
mod metrics;
pub mod ollama;
pub mod openai;
mod openai_reply;
mod request_body;
pub mod responses;
mod stop;
pub mod web;

use std::convert::Infallible;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, Method, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

/// How long a shutdown waits for requests in progress before the process exits.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

use crate::engine::Engine;
use crate::sampling::SamplingOptions;
use conversation::{Turn, TurnEvent};
use error::ApiError;

/// How the server behaves.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The model's name in `/v1/models` and `/api/tags`. A request may name any model:
    /// the one loaded serves it (as llama.cpp's server does), and the response echoes the
    /// name.
    pub model_id: String,
    /// More names listed in `/v1/models`.
    pub aliases: Vec<String>,
    /// Requests running or waiting at once; more get 503 (at least 1).
    pub queue: usize,
    /// When set, the model's routes and `/stats` need `Authorization: Bearer <key>` or
    /// `x-api-key: <key>` (Anthropic's header).
    pub api_key: Option<String>,
    /// New tokens when a request gives no `max_tokens` (capped by the context).
    pub default_max_tokens: usize,
    /// Sampling when a request does not say (a request without `seed` gets a random one).
    pub sampling: SamplingOptions,
    /// A thinking model's `<think>...</think>` comes back as reasoning (false: it stays in
    /// the text, `--reasoning-format none`).
    pub reasoning: bool,
    /// Refuse (400) a prompt whose prefill is estimated to take longer than this many
    /// seconds (`--max-prefill-wait`; [`Engine::prefill_estimate`]).
    pub max_prefill_wait: Option<f64>,
}

/// What every route shares.
pub struct App {
    /// Set once the model has loaded ([`Loading::loaded`]).
    engine: OnceLock<Engine>,
    options: ServerOptions,
    queue: Arc<Semaphore>,
    /// Unix seconds when the server started.
    created: u64,
    /// Recent Responses API responses, for `previous_response_id`.
    responses: responses::Store,
    metrics: metrics::Metrics,
    /// The requests in progress, for `/stats/stream`.
    live: live::Live,
}

impl App {
    /// The engine. Errors: 503 while the model loads.
    fn engine(&self) -> Result<&Engine, ApiError> {
        self.engine.get().ok_or_else(ApiError::loading)
    }
}

/// The routes of a server whose model is still loading: `/health` answers 503 `loading`
/// and the model's routes 503 until [`Loading::loaded`] hands over the engine.
pub struct Loading(Arc<App>);

impl Loading {
    /// The model is ready: requests are served from now on.
    pub fn loaded(&self, engine: Engine) {
        let _ = self.0.engine.set(engine);
    }
}

/// The HTTP routes over `engine`.
pub fn router(engine: Engine, options: ServerOptions) -> Router {
    let (router, loading) = loading_router(options);
    loading.loaded(engine);
    router
}

/// The HTTP routes before the model has loaded; [`Loading::loaded`] completes them.
pub fn loading_router(options: ServerOptions) -> (Router, Loading) {
    let app = Arc::new(App {
        engine: OnceLock::new(),
        queue: Arc::new(Semaphore::new(options.queue.max(1))),
        options,
        created: unix_now(),
        responses: responses::Store::default(),
        metrics: metrics::Metrics::default(),
        live: live::Live::default(),
    });
    let authenticated = Router::new()
        .route("/v1/models", get(openai_reply::models))
        .route("/v1/models/{*id}", get(openai_reply::model))
        .route("/v1/chat/completions", post(openai_reply::chat_completions))
        .route("/v1/completions", post(openai_reply::completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/show", post(ollama::show))
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::ps))
        .route(
            "/api/embed",
            post(|| async { ollama::unsupported("embeddings") }),
        )
        .route(
            "/api/embeddings",
            post(|| async { ollama::unsupported("embeddings") }),
        )
        .route(
            "/api/pull",
            post(|| async { ollama::unsupported("pulling models") }),
        )
        .route(
            "/api/create",
            post(|| async { ollama::unsupported("creating models") }),
        )
        .route("/stats", get(stats))
        .route("/stats/stream", get(live::stream))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(app.clone(), authenticate));
    let router = Router::new()
        .route("/health", get(health))
        .route("/", get(web::index))
        .route("/web/app.js", get(web::app_js))
        .route("/web/style.css", get(web::style_css))
        .route("/api/version", get(ollama::version))
        .merge(authenticated)
        .fallback(
            |uri: Uri| async move { error_response(uri.path(), ApiError::no_route(uri.path())) },
        )
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            error_response(
                uri.path(),
                ApiError::method_not_allowed(&method, uri.path()),
            )
        })
        .layer(middleware::from_fn_with_state(app.clone(), log_request))
        .with_state(app.clone());
    (router, Loading(app))
}

/// 200 `ok` once the model is loaded, 503 `loading` before.
async fn health(State(app): State<Arc<App>>) -> Response {
    match app.engine() {
        Ok(_) => Json(json!({ "status": "ok" })).into_response(),
        Err(e) => (e.status, Json(json!({ "status": "loading" }))).into_response(),
    }
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
        let headers = request.headers();
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        // Anthropic's clients send the key in `x-api-key`.
        let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        let given = |t: Option<&str>| t.is_some_and(|t| same_secret(t.as_bytes(), key.as_bytes()));
        if !given(bearer) && !given(x_api_key) {
            return error_response(request.uri().path(), ApiError::unauthorized());
        }
    }
    next.run(request).await
}

/// Compares in time independent of where the inputs differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `error` in the shape of the dialect that `path` belongs to (Anthropic's for
/// `/v1/messages`, Ollama's for `/api/...`, else OpenAI's).
fn error_response(path: &str, error: ApiError) -> Response {
    if path.starts_with("/v1/messages") {
        anthropic::error_response(error)
    } else if path.starts_with("/api/") {
        ollama::error_response(error)
    } else {
        error.into_response()
    }
}

/// Marks a response whose request logs its own line (with its tokens) when it ends.
#[derive(Clone, Copy)]
struct Logged;

/// One log line per request: those that generated log theirs at the end (with tokens and
/// speed), the others here, with the reason of a refusal ([`error::Reason`]).
async fn log_request(State(app): State<Arc<App>>, request: HttpRequest, next: Next) -> Response {
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str().to_string());
    let start = std::time::Instant::now();
    let response = next.run(request).await;
    app.metrics
        .request(route.as_deref(), response.status().as_u16());
    if response.extensions().get::<Logged>().is_none() {
        let reason = response
            .extensions()
            .get::<error::Reason>()
            .map_or(String::new(), |r| format!(": {}", r.0));
        tracing::info!(
            "{method} {path} {} in {:.3}s{reason}",
            response.status().as_u16(),
            start.elapsed().as_secs_f64()
        );
    }
    response
}

async fn stats(State(app): State<Arc<App>>) -> Response {
    let engine = match app.engine() {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    Json(json!({
        "engine": engine.stats(),
        "pool": engine.pool_stats(),
        "ngram": engine.ngram_counts(),
        "queued_or_running": app.options.queue.max(1) - app.queue.available_permits(),
    }))
    .into_response()
}

/// `GET /metrics`: the OpenMetrics text Prometheus scrapes.
async fn metrics(State(app): State<Arc<App>>) -> Response {
    let queue = app.options.queue.max(1) - app.queue.available_permits();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.render(
            queue,
            app.engine().ok().and_then(|e| e.pool_stats()).as_ref(),
        ),
    )
        .into_response()
}

/// The frames of a streamed turn: `first` at once, then those `frames` makes of each of
/// the turn's events. Dropping the stream (the client went away) drops the turn, which
/// cancels the generation.
fn turn_frames<T: Send + 'static>(
    turn: Turn,
    first: Vec<T>,
    frames: impl FnMut(TurnEvent) -> Vec<T> + Send + 'static,
) -> impl Stream<Item = T> + Send {
    let rest = futures::stream::unfold((turn, frames), |(mut turn, mut frames)| async move {
        let event = turn.next().await?;
        let out = frames(event);
        Some((futures::stream::iter(out), (turn, frames)))
    })
    .flatten();
    futures::stream::iter(first).chain(rest)
}

/// Server-sent events of `events`, with keep-alive comments while the model is quiet.
/// The request logs its own line when its generation ends.
fn sse_response(events: impl Stream<Item = SseEvent> + Send + 'static) -> Response {
    let mut response = Sse::new(events.map(Ok::<_, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response();
    response.extensions_mut().insert(Logged);
    response
}

/// A server-sent event as a name and its JSON data (Anthropic's and the Responses API's
/// streams name every event).
pub type Named = (String, Value);

/// Server-sent events of named events.
fn named_events(events: impl Stream<Item = Named> + Send + 'static) -> Response {
    sse_response(events.map(|(name, data)| SseEvent::default().event(name).data(data.to_string())))
}

/// A JSON response of a request that generated (it logged its own line).
fn generated_response(body: Value) -> Response {
    let mut response = Json(body).into_response();
    response.extensions_mut().insert(Logged);
    response
}

/// Unix time in seconds, with its fraction.
fn unix_now_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
