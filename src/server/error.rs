//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a
//! 4xx or 5xx status. The other dialects render the same error in their own shape
//! ([`super::anthropic::error_response`], [`super::ollama::error_response`]).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// A refusal's message, kept on its response for the request's log line.
#[derive(Clone, Debug)]
pub struct Reason(pub String);

/// An error response.
#[derive(Clone, Debug, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    pub status: StatusCode,
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(
        status: StatusCode,
        kind: &'static str,
        code: Option<&'static str>,
        message: String,
    ) -> Self {
        ApiError {
            status,
            message,
            kind,
            param: None,
            code,
        }
    }

    /// 400: a field with a bad value.
    pub fn invalid(param: &str, message: &str) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                format!("{param}: {message}"),
            )
        }
    }

    /// The same error for a field inside `parent` (Ollama's `options`): `temperature`
    /// becomes `options.temperature`.
    pub fn under(self, parent: &str) -> Self {
        match self.param.clone() {
            Some(param) => self.renamed(&param, &format!("{parent}.{param}")),
            None => self,
        }
    }

    /// The same error with the field `from` named `to` (a dialect's name for a field the
    /// core checks under OpenAI's name: Anthropic's `stop_sequences` for `stop`).
    pub fn renamed(mut self, from: &str, to: &str) -> Self {
        if self.param.as_deref() == Some(from) {
            if let Some(rest) = self.message.strip_prefix(&format!("{from}:")) {
                self.message = format!("{to}:{rest}");
            }
            self.param = Some(to.to_string());
        }
        self
    }

    /// 400: a body that is not JSON, or not of the request's shape.
    pub fn malformed(message: String) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            None,
            message,
        )
    }

    /// 400: prompt and max_tokens do not fit the context.
    pub fn context_length(message: String) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("context_length_exceeded"),
            message,
        )
    }

    /// 400: a prompt whose prefill would take longer than the server allows
    /// (`--max-prefill-wait`).
    pub fn prefill_wait(message: String) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("prefill_wait_exceeded"),
            message,
        )
    }

    /// A body that could not be read (413 when over the limit).
    pub fn unreadable_body(status: StatusCode, message: String) -> Self {
        Self::new(status, "invalid_request_error", None, message)
    }

    /// 405: a known path with another method.
    pub fn method_not_allowed(method: &axum::http::Method, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            None,
            format!("{method} is not allowed on {path}"),
        )
    }

    /// 401: a missing or wrong API key.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            "missing or incorrect API key (send `Authorization: Bearer <key>` or `x-api-key: <key>`)".into(),
        )
    }

    /// 404: a model this server does not serve (`GET /v1/models/{id}`).
    pub fn no_model(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("model_not_found"),
            format!("the model `{id}` does not exist"),
        )
    }

    /// 404: an unknown path.
    pub fn no_route(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            None,
            format!("no endpoint {path} (OpenAI: POST /v1/chat/completions, /v1/completions, /v1/responses; Anthropic: POST /v1/messages; Ollama: POST /api/chat, /api/generate)"),
        )
    }

    /// 404: something else this server does not have (a stored response, say).
    pub fn not_found(message: String) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            None,
            message,
        )
    }

    /// 501: a feature of a dialect that slotstream does not implement.
    pub fn unsupported(message: String) -> Self {
        Self::new(
            StatusCode::NOT_IMPLEMENTED,
            "invalid_request_error",
            Some("unsupported"),
            message,
        )
    }

    /// 503: the model is still loading.
    pub fn loading() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("loading"),
            "the model is loading; retry shortly (GET /health answers 200 once it is ready)".into(),
        )
    }

    /// 503 with `Retry-After`: the queue is full.
    pub fn busy(queue: usize) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("queue_full"),
            format!("the server is busy ({queue} requests running or queued); retry shortly"),
        )
    }

    /// The status and type of an engine error: 400 for the request's fault (named
    /// field where there is one, `context_length_exceeded`), 500 `inference_error` when
    /// the model's output is unusable, 500 `server_error` otherwise.
    pub fn engine(e: &crate::Error) -> Self {
        match e {
            crate::Error::ContextFull { .. } => Self::context_length(e.to_string()),
            crate::Error::Sampling { field, message } => Self::invalid(field, message),
            crate::Error::NoFiniteLogits { .. } | crate::Error::NothingAllowed => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "inference_error",
                None,
                e.to_string(),
            ),
            crate::Error::InvalidInput(m) => Self::malformed(m.clone()),
            crate::Error::Image(_) => Self::malformed(e.to_string()),
            crate::Error::Grammar { field, message } => Self::invalid(field, message),
            // A template that refuses the conversation (raise_exception, tools it does not
            // render) refuses the request.
            crate::Error::Template { message, .. } => {
                Self::malformed(format!("chat template: {message}"))
            }
            crate::Error::Tokenizer { message, .. } => {
                Self::malformed(format!("tokenizer: {message}"))
            }
            _ => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                None,
                e.to_string(),
            ),
        }
    }

    /// The body: `{"error": {...}}`.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({ "error": self })
    }
}

impl ApiError {
    /// A response with `status` and `body`, carrying what every dialect's error response
    /// carries: `Retry-After` on a 503 or 529, and the message for the log line.
    pub fn respond(&self, status: StatusCode, body: serde_json::Value) -> Response {
        let mut response = (status, axum::Json(body)).into_response();
        if matches!(status.as_u16(), 503 | 529) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
            .extensions_mut()
            .insert(Reason(self.message.clone()));
        response
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.respond(self.status, self.body())
    }
}
