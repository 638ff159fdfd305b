//! The web app and its live view: `GET /` serves the embedded page, script and style
//! (without the API key, and with no address outside the server in them), and
//! `GET /stats/stream` sends parseable `stats` events whose resident set is the pool's
//! (empty before a request, changed after one), or every record for a mapped checkpoint.
//! The page itself runs in a headless browser in tools/web_app_test.py (CI).

use futures::StreamExt;
use serde_json::{json, Value};
use slotstream::engine::{Engine, EngineOptions};
use slotstream::experts::SourceOptions;
use slotstream::server::{router, web, ConnectionLimits, ServerOptions};

use crate::common::fixture_dir;
use crate::serve::{listen, start, Server, NAME};

const KEY: &str = "web-key";

/// `GET path` without a key: its status, content type and body.
async fn get(server: &Server, path: &str) -> (u16, String, String) {
    let r = server.get(path).await;
    let status = r.status().as_u16();
    let kind = r
        .headers()
        .get("content-type")
        .map_or(String::new(), |v| v.to_str().unwrap().to_string());
    (status, kind, r.text().await.unwrap())
}

/// The first `n` events of `/stats/stream`, each checked to be a `stats` event of JSON.
async fn stats_events(server: &Server, key: Option<&str>, n: usize) -> Vec<Value> {
    let mut request = server.client.get(format!("{}/stats/stream", server.base));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.bytes_stream();
    let (mut buffer, mut events) = (String::new(), Vec::new());
    while events.len() < n {
        let chunk = body.next().await.expect("the stream ended").unwrap();
        buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            if frame.starts_with(':') {
                continue; // a keep-alive comment
            }
            let mut lines = frame.lines();
            assert_eq!(lines.next(), Some("event: stats"), "{frame}");
            let data = lines.next().unwrap().strip_prefix("data: ").unwrap();
            events.push(serde_json::from_str::<Value>(data).unwrap());
        }
    }
    events.truncate(n);
    events
}

/// The resident set of an event as (row, expert) pairs, read from its hexadecimal rows.
fn resident_pairs(event: &Value) -> Vec<(usize, usize)> {
    let r = &event["resident"];
    let experts = r["num_experts"].as_u64().unwrap() as usize;
    let mut pairs = Vec::new();
    for (row, hex) in r["rows"].as_array().unwrap().iter().enumerate() {
        let hex = hex.as_str().unwrap();
        assert_eq!(hex.len(), experts.div_ceil(4));
        for e in 0..experts {
            let digit = hex.as_bytes()[hex.len() - 1 - e / 4] as char;
            if digit.to_digit(16).unwrap() >> (e % 4) & 1 == 1 {
                pairs.push((row, e));
            }
        }
    }
    assert_eq!(pairs.len() as u64, r["count"].as_u64().unwrap());
    pairs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_and_its_assets_are_served_without_the_key_and_name_no_other_host() {
    let server = start(1, 0, Some(KEY)).await;
    let (status, kind, page) = get(&server, "/").await;
    assert_eq!((status, kind.as_str()), (200, "text/html; charset=utf-8"));
    assert_eq!(page, web::INDEX_HTML);
    for (path, kind, body) in [
        ("/web/app.js", "text/javascript; charset=utf-8", web::APP_JS),
        ("/web/style.css", "text/css; charset=utf-8", web::STYLE_CSS),
    ] {
        assert!(
            page.contains(&format!("\"{path}\"")),
            "the page loads {path}"
        );
        assert_eq!(
            get(&server, path).await,
            (200, kind.to_string(), body.to_string())
        );
    }
    // Nothing from another host: no absolute or protocol-relative address anywhere.
    for asset in [web::INDEX_HTML, web::APP_JS, web::STYLE_CSS] {
        for external in [
            "http://",
            "https://",
            "src=\"//",
            "href=\"//",
            "url(//",
            "@import",
        ] {
            assert!(!asset.contains(external), "an asset contains {external}");
        }
    }
    // The data behind the page keeps its key.
    assert_eq!(get(&server, "/stats/stream").await.0, 401);
    let events = stats_events(&server, Some(KEY), 1).await;
    assert_eq!(events[0]["loaded"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_shows_the_pools_resident_records_change_with_a_request() {
    let server = start(1, 0, None).await;
    let before = stats_events(&server, None, 2).await;
    let first = &before[0];
    assert_eq!(first["model"], NAME);
    assert_eq!(first["resident"]["streamed"], true);
    assert_eq!(first["resident"]["moe_layers"], json!([0, 1, 2, 3]));
    assert_eq!(first["resident"]["num_experts"], 16);
    assert!(resident_pairs(first).is_empty(), "a new pool is empty");
    assert_eq!(first["pool"]["slots"], 24);
    assert_eq!(first["disk_gbps"], 0.0);
    assert!(first["last"].is_null() && first["request"].is_null());
    // Later events measure the disk's rate over their interval: nothing read yet.
    assert_eq!(before[1]["disk_gbps"], 0.0);

    let (status, reply) = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12}),
        )
        .await;
    assert_eq!(status, 200, "{reply}");
    let after = &stats_events(&server, None, 1).await[0];
    let pairs = resident_pairs(after);
    assert!(!pairs.is_empty() && pairs.len() <= 24, "{pairs:?}");
    // The event's rows are the pool's set, read through the engine.
    let set = server.engine.resident_experts();
    let mut want = Vec::new();
    for row in 0..set.moe_layers.len() {
        for e in 0..set.num_experts {
            if set.contains(row, e) {
                want.push((row, e));
            }
        }
    }
    assert_eq!(pairs, want);
    let last = &after["last"];
    assert_eq!(
        last["completion_tokens"],
        reply["usage"]["completion_tokens"]
    );
    assert_eq!(last["prefill_tokens"], reply["usage"]["prompt_tokens"]);
    assert_eq!(after["pool"]["bytes_read"], last["bytes_read"]);
    assert!(
        after["pool"]["hits"].as_u64().unwrap() + after["pool"]["misses"].as_u64().unwrap() > 0
    );
    assert_eq!(after["engine"]["requests"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_checkpoint_shows_every_record_resident() {
    let engine = Engine::load(
        &fixture_dir(NAME),
        EngineOptions {
            device: Some("cpu".into()),
            source: SourceOptions::default(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let app = router(
        engine.clone(),
        ServerOptions {
            model_id: NAME.into(),
            aliases: vec![],
            queue: 1,
            api_key: None,
            default_max_tokens: 8,
            sampling: Default::default(),
            reasoning: true,
            max_prefill_wait: None,
        },
    );
    let server = listen(engine, app, ConnectionLimits::default()).await;
    let event = &stats_events(&server, None, 1).await[0];
    assert_eq!(event["resident"]["streamed"], false);
    assert_eq!(resident_pairs(event).len(), 4 * 16);
    assert!(event["pool"].is_null());
}
