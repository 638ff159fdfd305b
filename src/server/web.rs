//! The web app at `GET /`: a chat over `/v1/chat/completions` (streamed, with markdown,
//! code blocks, collapsible reasoning, a system prompt, sampling settings and a stop
//! button) beside a live view of the pool fed by `/stats/stream` ([`super::live`]): the
//! resident experts as a heatmap, the hit rate, the disk's rate, the prefill's progress,
//! tokens per second, the memory plan and the pool's size.
//!
//! The page, its script and its style are plain HTML, JS and CSS compiled into the binary
//! (`src/server/web/`): nothing is fetched from elsewhere, so it works offline. They are
//! served without the API key (they hold no data); the page sends the key with its API
//! calls, from `#key=...` in its address or from its settings field, and asks for it when
//! a call gets 401.

use axum::http::header;
use axum::response::{IntoResponse, Response};

/// The page.
pub const INDEX_HTML: &str = include_str!("web/index.html");
/// Its script.
pub const APP_JS: &str = include_str!("web/app.js");
/// Its style sheet.
pub const STYLE_CSS: &str = include_str!("web/style.css");

/// `body` as `content_type`, revalidated on each load (the binary may have changed).
fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// `GET /`.
pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

/// `GET /web/app.js`.
pub async fn app_js() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

/// `GET /web/style.css`.
pub async fn style_css() -> Response {
    asset("text/css; charset=utf-8", STYLE_CSS)
}
