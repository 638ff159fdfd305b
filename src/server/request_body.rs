//! Reading a request body, with a 413 that a client still sending its body receives.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use futures::StreamExt;

use super::error::ApiError;

/// The largest body read, in bytes (axum's default limit).
pub const BODY_LIMIT: usize = 2 << 20;

/// How long a whole body may take to arrive (a client that trickles it is cut off, not
/// waited for byte by byte).
const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// How much of an oversized body is read and dropped before the 413 goes out, in bytes.
/// Answering while the client still writes, then closing with its bytes unread, resets
/// the connection, and the client sees a broken pipe instead of the 413 (nginx's
/// lingering close drains for the same reason). Beyond this the connection is closed.
const DRAIN_LIMIT: usize = 64 << 20;

/// The whole body, at most [`BODY_LIMIT`] bytes.
///
/// Errors: 413 over the limit (after draining up to [`DRAIN_LIMIT`]), 408 when the body
/// takes longer than [`BODY_TIMEOUT`], 400 for a body that breaks off.
pub async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    let mut chunks = body.into_data_stream();
    let (mut kept, mut seen) = (Vec::new(), 0usize);
    let read = tokio::time::timeout(BODY_TIMEOUT, async {
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::unreadable_body(
                    StatusCode::BAD_REQUEST,
                    format!("failed to read the request body: {e}"),
                )
            })?;
            seen = seen.saturating_add(chunk.len());
            if seen <= BODY_LIMIT {
                kept.extend_from_slice(&chunk);
            } else if seen > DRAIN_LIMIT {
                break;
            }
        }
        Ok(())
    })
    .await;
    match read {
        Err(_) => Err(ApiError::unreadable_body(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s",
                BODY_TIMEOUT.as_secs()
            ),
        )),
        Ok(Err(e)) => Err(e),
        Ok(Ok(())) if seen > BODY_LIMIT => Err(ApiError::unreadable_body(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {BODY_LIMIT} bytes"),
        )),
        Ok(Ok(())) => Ok(kept.into()),
    }
}
