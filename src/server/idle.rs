//! `serve --idle-exit`: how long the server has gone without a request.
//!
//! [`Idle::track`] wraps a router in a layer that counts each request as active from its
//! arrival until its response body has been sent or dropped (a stream that generates for
//! minutes is one request in progress, not idle time), and [`Idle::elapsed`] resolves once
//! no request has been active for a given duration; [`super::serve_until`] takes that
//! future as its stop. Every route counts, `/health` too: a client that polls a server is
//! using it.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;
use http_body::{Frame, SizeHint};
use tokio::sync::Notify;
use tokio::time::Instant;

/// The activity of a server's requests; clones share it.
#[derive(Clone, Debug, Default)]
pub struct Idle {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Requests in progress, and when the last one ended (or the tracker began).
    state: Mutex<Activity>,
    /// Woken when the last request in progress ends.
    quiet: Notify,
}

#[derive(Debug)]
struct Activity {
    active: usize,
    since: Instant,
}

impl Default for Inner {
    fn default() -> Self {
        Inner {
            state: Mutex::new(Activity {
                active: 0,
                since: Instant::now(),
            }),
            quiet: Notify::new(),
        }
    }
}

impl Idle {
    /// A tracker with no request yet: idle from now.
    pub fn new() -> Self {
        Self::default()
    }

    /// `router` with every request counted by this tracker (the outermost layer, so the
    /// fallbacks and errors count too).
    pub fn track(&self, router: Router) -> Router {
        router.layer(middleware::from_fn_with_state(self.clone(), record))
    }

    /// Marks one request in progress until the returned guard is dropped.
    pub fn begin(&self) -> Active {
        self.lock().active += 1;
        Active(self.clone())
    }

    /// Resolves once no request has been in progress for `after` (counted from the end of
    /// the last one, or from [`Idle::new`] if none came).
    pub async fn elapsed(&self, after: Duration) {
        loop {
            // Registered before the check, so an end between the check and the wait
            // still wakes it.
            let quiet = self.inner.quiet.notified();
            let deadline = {
                let state = self.lock();
                (state.active == 0).then(|| state.since + after)
            };
            match deadline {
                // A request that comes and ends before the deadline moves it: look again.
                Some(deadline) if Instant::now() < deadline => {
                    tokio::time::sleep_until(deadline).await
                }
                Some(_) => return,
                None => quiet.await,
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Activity> {
        // The state is two plain values, consistent even if a holder panicked.
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One request in progress (see [`Idle::begin`]).
#[derive(Debug)]
pub struct Active(Idle);

impl Drop for Active {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.active -= 1;
        state.since = Instant::now();
        if state.active == 0 {
            self.0.inner.quiet.notify_waiters();
        }
    }
}

/// The layer of [`Idle::track`]: the request is active until its body is done.
async fn record(State(idle): State<Idle>, request: Request, next: Next) -> Response {
    let active = idle.begin();
    next.run(request).await.map(|body| {
        Body::new(Watched {
            body,
            _active: active,
        })
    })
}

/// A response body that keeps its request [`Active`] until hyper has sent it or dropped
/// it (a client that left).
struct Watched {
    body: Body,
    _active: Active,
}

impl HttpBody for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    /// The inner body's, so a JSON response keeps its Content-Length.
    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_millis(200);

    #[tokio::test]
    async fn idle_time_counts_from_the_end_of_the_last_request() {
        let idle = Idle::new();
        let first = idle.begin();
        let second = idle.begin();
        // While a request is in progress the server is never idle, however long it runs.
        let waited = tokio::time::timeout(3 * AFTER, idle.elapsed(AFTER)).await;
        assert!(waited.is_err(), "idle with two requests in progress");
        drop(first);
        let waited = tokio::time::timeout(3 * AFTER, idle.elapsed(AFTER)).await;
        assert!(waited.is_err(), "idle with one request in progress");
        drop(second);
        let ended = Instant::now();
        idle.elapsed(AFTER).await;
        assert!(ended.elapsed() >= AFTER, "{:?}", ended.elapsed());
    }

    #[tokio::test]
    async fn a_request_in_the_wait_moves_the_deadline() {
        let idle = Idle::new();
        let waiting = tokio::spawn({
            let idle = idle.clone();
            async move {
                idle.elapsed(AFTER).await;
                Instant::now()
            }
        });
        tokio::time::sleep(AFTER / 3).await;
        drop(idle.begin());
        let ended = Instant::now();
        let resolved = waiting.await.unwrap();
        assert!(resolved >= ended + AFTER, "{:?}", resolved - ended);
    }
}
