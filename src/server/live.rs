//! `GET /stats/stream`: the engine, the pool and the request in progress as server-sent
//! events, a few a second, for the web app's live view ([`super::web`]) and any dashboard:
//! which records are resident (a heatmap's rows of bits), the hit rate, the disk's rate,
//! the prefill's progress, tokens per second, the memory plan and the pool's size.
//!
//! Each event is one `stats` event whose data is a JSON object:
//!
//! - `loaded`: false while the model loads (and nothing else but `time`);
//! - `time`: Unix seconds;
//! - `pool`: the pool's counters since the current or last request began
//!   ([`crate::pool::PoolStats`] less its per-layer counts), null without a pool;
//! - `disk_gbps`: 10^9 bytes per second read through the pool since this stream's previous
//!   event (0 in the first);
//! - `resident`: `{ streamed, moe_layers, num_experts, count, rows }`, `rows` one
//!   hexadecimal number per MoE layer of `ceil(num_experts / 4)` digits whose bit `e` is
//!   set when expert `e` is in a slot (the last digit holds experts 0 to 3); with every
//!   record mapped, `streamed` is false and every bit is set;
//! - `request`: the request running now (`phase` `queued`, `prefill` or `decode`;
//!   `prompt_tokens`, `prefilled`: tokens run so far, those reused from a kept state
//!   left out; `generated`; `decode_tps` since its first token), or null;
//! - `last`: the last finished request's `prefill_tps`, `decode_tps`, `hit_rate` and
//!   tokens, or null;
//! - `plan`: the memory plan ([`crate::plan::Plan`]) when a budget sized the pool, else
//!   null; `queued_or_running`; `engine`: [`crate::engine::EngineStats`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::{json, Value};

use super::conversation::Outcome;
use super::App;
use crate::engine::PrefillProgress;
use crate::pool::ResidentSet;

/// Time between two events of a stream.
pub const INTERVAL: Duration = Duration::from_millis(250);

/// The requests accepted and not yet ended, and the last one that finished.
#[derive(Default)]
pub struct Live {
    inner: Arc<Mutex<Requests>>,
}

#[derive(Default)]
struct Requests {
    next_id: u64,
    running: Vec<Running>,
    last: Option<Value>,
}

struct Running {
    id: u64,
    prompt_tokens: usize,
    progress: PrefillProgress,
    generated: usize,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

impl Running {
    /// Tokens per second since the first new token (null before the second).
    fn decode_tps(&self) -> Option<f64> {
        let (first, last) = (self.first_token?, self.last_token?);
        let seconds = last.duration_since(first).as_secs_f64();
        (self.generated > 1 && seconds > 0.0).then(|| (self.generated - 1) as f64 / seconds)
    }

    fn phase(&self) -> &'static str {
        if self.generated > 0 {
            "decode"
        } else if self.progress.tokens() > 0 {
            "prefill"
        } else {
            "queued"
        }
    }

    fn describe(&self) -> Value {
        json!({
            "phase": self.phase(),
            "prompt_tokens": self.prompt_tokens,
            "prefilled": self.progress.tokens(),
            "generated": self.generated,
            "decode_tps": self.decode_tps(),
        })
    }
}

impl Live {
    /// Tracks a request accepted with `prompt_tokens` tokens until the returned guard is
    /// dropped.
    pub fn begin(&self, prompt_tokens: usize, progress: PrefillProgress) -> LiveRequest {
        let mut r = lock(&self.inner);
        r.next_id += 1;
        let id = r.next_id;
        r.running.push(Running {
            id,
            prompt_tokens,
            progress,
            generated: 0,
            first_token: None,
            last_token: None,
        });
        LiveRequest {
            requests: self.inner.clone(),
            id,
        }
    }

    /// The request that runs now (the first past its queue; else the first queued), or
    /// null; and the last finished one, or null.
    fn snapshot(&self) -> (Value, Value) {
        let r = lock(&self.inner);
        let now = r
            .running
            .iter()
            .find(|q| q.phase() != "queued")
            .or(r.running.first())
            .map_or(Value::Null, Running::describe);
        (now, r.last.clone().unwrap_or(Value::Null))
    }
}

fn lock(m: &Mutex<Requests>) -> std::sync::MutexGuard<'_, Requests> {
    // Counters only: a panic elsewhere leaves nothing inconsistent to fear.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One request tracked by [`Live`]; dropping it ends the tracking.
pub struct LiveRequest {
    requests: Arc<Mutex<Requests>>,
    id: u64,
}

impl LiveRequest {
    /// A new token arrived.
    pub fn token(&self) {
        let mut r = lock(&self.requests);
        if let Some(q) = r.running.iter_mut().find(|q| q.id == self.id) {
            let now = Instant::now();
            q.first_token.get_or_insert(now);
            q.last_token = Some(now);
            q.generated += 1;
        }
    }

    /// The request finished with `outcome`: it becomes the `last` of the events.
    pub fn finished(&self, outcome: &Outcome) {
        let s = &outcome.stats;
        lock(&self.requests).last = Some(json!({
            "prefill_tokens": s.prefill_tokens,
            "reused_prompt_tokens": s.reused_prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            "prefill_tps": s.prefill_tps,
            "decode_tps": s.decode_tps,
            "hit_rate": s.hit_rate,
            "bytes_read": s.bytes_read,
        }));
    }
}

impl Drop for LiveRequest {
    fn drop(&mut self) {
        lock(&self.requests).running.retain(|q| q.id != self.id);
    }
}

/// The heatmap's part of an event (see the module's documentation).
#[derive(Serialize)]
struct Resident {
    streamed: bool,
    moe_layers: Vec<usize>,
    num_experts: usize,
    count: usize,
    rows: Vec<String>,
}

impl From<&ResidentSet> for Resident {
    fn from(set: &ResidentSet) -> Self {
        let digits = set.num_experts.div_ceil(4).max(1);
        let rows = (0..set.moe_layers.len())
            .map(|row| {
                // The highest word first, so the row reads as one hexadecimal number.
                let hex: String = set
                    .row(row)
                    .iter()
                    .rev()
                    .map(|w| format!("{w:016x}"))
                    .collect();
                hex[hex.len() - digits..].to_string()
            })
            .collect();
        Resident {
            streamed: set.streamed,
            moe_layers: set.moe_layers.clone(),
            num_experts: set.num_experts,
            count: set.count(),
            rows,
        }
    }
}

/// A stream's memory between events: what the disk's rate is measured against.
struct Previous {
    at: Instant,
    bytes_read: u64,
}

/// One event's data (see the module's documentation).
fn event(app: &App, previous: &mut Option<Previous>) -> Value {
    let time = super::unix_now_f64();
    let Ok(engine) = app.engine() else {
        return json!({ "loaded": false, "time": time });
    };
    let pool = engine.pool_stats();
    let now = Instant::now();
    let bytes_read = pool.as_ref().map_or(0, |p| p.bytes_read);
    let disk_gbps = match previous.as_ref() {
        Some(p) => {
            // The pool's counters start again with each request: a drop is a new count.
            let read = if bytes_read >= p.bytes_read {
                bytes_read - p.bytes_read
            } else {
                bytes_read
            };
            let seconds = now.duration_since(p.at).as_secs_f64();
            if seconds > 0.0 {
                read as f64 / seconds / 1e9
            } else {
                0.0
            }
        }
        None => 0.0,
    };
    *previous = Some(Previous {
        at: now,
        bytes_read,
    });
    let pool = pool.map(|p| {
        let mut v = serde_json::to_value(&p).unwrap_or(Value::Null);
        if let Some(o) = v.as_object_mut() {
            o.remove("per_layer");
        }
        v
    });
    let (request, last) = app.live.snapshot();
    json!({
        "loaded": true,
        "time": time,
        "model": app.options.model_id,
        "pool": pool,
        "disk_gbps": disk_gbps,
        "resident": Resident::from(&engine.resident_experts()),
        "request": request,
        "last": last,
        "plan": engine.plan(),
        "queued_or_running": app.options.queue.max(1) - app.queue.available_permits(),
        "engine": engine.stats(),
    })
}

/// `GET /stats/stream`: a `stats` event now and every [`INTERVAL`] until the client goes
/// away.
pub async fn stream(State(app): State<Arc<App>>) -> Response {
    let events = futures::stream::unfold(
        (app, None::<Previous>, true),
        |(app, mut previous, first)| async move {
            if !first {
                tokio::time::sleep(INTERVAL).await;
            }
            let data = event(&app, &mut previous);
            let event = SseEvent::default().event("stats").data(data.to_string());
            Some((
                Ok::<_, std::convert::Infallible>(event),
                (app, previous, false),
            ))
        },
    );
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_read_as_hexadecimal_numbers_of_the_experts_bits() {
        // 70 experts: two words a row, 18 digits.
        let set = ResidentSet::all(vec![0, 2], 70);
        let r = Resident::from(&set);
        assert_eq!(r.count, 140);
        assert_eq!(r.rows[0], format!("3{}", "f".repeat(17)));
        let empty = Resident::from(&ResidentSet::empty(vec![1], 16));
        assert_eq!(empty.rows, vec!["0000".to_string()]);
        assert!(empty.streamed);
    }
}
