//! `GET /metrics`: the server's counters in the OpenMetrics text format that Prometheus
//! scrapes (through the `prometheus-client` crate), as llama-server and vLLM expose
//! theirs: requests by route and status, prompt and generated tokens, the queue, time to
//! first token and the time between tokens, the pool's hit rate and bytes read, an
//! elastic pool's size and resizes, and prompt-cache hits.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::pool::PoolStats;

use super::conversation::Outcome;

/// The labels of a request count.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    /// The route's pattern (`/v1/chat/completions`), or `unmatched`: never the raw path,
    /// which a client could fill with any number of values.
    route: String,
    status: u16,
}

/// The server's metrics and their registry.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    prompt_tokens: Counter,
    generated_tokens: Counter,
    queue: Gauge,
    time_to_first_token: Histogram,
    time_per_token: Histogram,
    hit_rate: Gauge<f64, AtomicU64>,
    bytes_read: Counter,
    prompt_cache_hits: Counter,
    reused_prompt_tokens: Counter,
    slots: Gauge,
    shrinks: Counter,
    grows: Counter,
    bytes_returned: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("slotstream");
        let m = Metrics {
            registry: Registry::default(),
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            queue: Gauge::default(),
            // 10 ms to about 80 s.
            time_to_first_token: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            // 1 ms to about 8 s.
            time_per_token: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            hit_rate: Gauge::default(),
            bytes_read: Counter::default(),
            prompt_cache_hits: Counter::default(),
            reused_prompt_tokens: Counter::default(),
            slots: Gauge::default(),
            shrinks: Counter::default(),
            grows: Counter::default(),
            bytes_returned: Counter::default(),
        };
        // The metrics are shared handles: the registry keeps clones of them.
        let r = &mut registry;
        r.register(
            "requests",
            "HTTP requests answered, by route and status",
            m.requests.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of finished generations",
            m.prompt_tokens.clone(),
        );
        r.register(
            "generated_tokens",
            "Tokens generated",
            m.generated_tokens.clone(),
        );
        r.register(
            "queue_length",
            "Requests running or waiting",
            m.queue.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "From a request's acceptance to its first new token",
            m.time_to_first_token.clone(),
        );
        r.register(
            "time_per_output_token_seconds",
            "Between consecutive new tokens of a request",
            m.time_per_token.clone(),
        );
        r.register(
            "pool_hit_rate",
            "The slot pool's hit rate over the last finished request (0 to 1)",
            m.hit_rate.clone(),
        );
        r.register(
            "pool_bytes_read",
            "Bytes read from disk through the pool by finished requests",
            m.bytes_read.clone(),
        );
        r.register(
            "prompt_cache_hits",
            "Requests that continued from a kept state",
            m.prompt_cache_hits.clone(),
        );
        r.register(
            "prompt_cache_reused_tokens",
            "Prompt tokens continued from a kept state instead of being run",
            m.reused_prompt_tokens.clone(),
        );
        r.register(
            "pool_slots",
            "Slots the pool has now (an elastic pool's change as the machine's memory does)",
            m.slots.clone(),
        );
        r.register(
            "pool_shrinks",
            "Times the elastic pool gave slots back because the machine ran short",
            m.shrinks.clone(),
        );
        r.register(
            "pool_grows",
            "Times the elastic pool took slots back once memory came back",
            m.grows.clone(),
        );
        r.register(
            "pool_bytes_returned",
            "Bytes of the elastic pool's retired slots returned to the OS",
            m.bytes_returned.clone(),
        );
        Metrics { registry, ..m }
    }
}

impl Metrics {
    /// Counts an answered request.
    pub fn request(&self, route: Option<&str>, status: u16) {
        let route = route.unwrap_or("unmatched").to_string();
        self.requests
            .get_or_create(&RequestLabels { route, status })
            .inc();
    }

    /// A generation's first token came `after` its acceptance.
    pub fn first_token(&self, after: Duration) {
        self.time_to_first_token.observe(after.as_secs_f64());
    }

    /// A token came `after` the one before it.
    pub fn next_token(&self, after: Duration) {
        self.time_per_token.observe(after.as_secs_f64());
    }

    /// A generation ended.
    pub fn finished(&self, prompt_tokens: usize, outcome: &Outcome) {
        let s = &outcome.stats;
        self.prompt_tokens.inc_by(prompt_tokens as u64);
        self.generated_tokens
            .inc_by(outcome.completion_tokens as u64);
        if let Some(rate) = s.hit_rate {
            self.hit_rate.set(rate);
        }
        self.bytes_read.inc_by(s.bytes_read);
        if s.reused_prompt_tokens > 0 {
            self.prompt_cache_hits.inc();
            self.reused_prompt_tokens
                .inc_by(s.reused_prompt_tokens as u64);
        }
    }

    /// The text a scrape gets, with `queue` requests running or waiting now and the
    /// pool's counters now (`None` without a pool, or before the model has loaded).
    pub fn render(&self, queue: usize, pool: Option<&PoolStats>) -> String {
        self.queue.set(queue as i64);
        if let Some(p) = pool {
            self.slots.set(p.slots as i64);
            if let Some(e) = &p.elastic {
                // The pool counts from its start; the counters catch up with it.
                for (counter, total) in [
                    (&self.shrinks, e.shrinks),
                    (&self.grows, e.grows),
                    (&self.bytes_returned, e.bytes_returned),
                ] {
                    counter.inc_by(total.saturating_sub(counter.get()));
                }
            }
        }
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}
