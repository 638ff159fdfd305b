//! The server's dialects on one conversation core: one conversation renders to the same
//! ids through OpenAI chat, Ollama, Anthropic Messages and the Responses API; each
//! dialect's text equals `slotstream generate`'s, streamed or not; their event sequences,
//! final fields and error shapes; Anthropic's thinking signatures round-trip and its full
//! queue is a 529; stored responses continue a conversation; `/health` says `loading`
//! until the model is handed over.

use serde_json::{json, Value};
use slotstream::engine::{Engine, EngineOptions, Input};
use slotstream::experts::SourceOptions;
use slotstream::server::openai::{ApiRequest, ChatRequest};
use slotstream::server::{anthropic, loading_router, ollama, responses, serve, ServerOptions};

use crate::common::*;
use crate::serve::{cli_generate, start, start_on, start_without_eos, Server, NAME};

/// A word from fresh random letters, so each run renders a conversation of its own.
fn word() -> String {
    (0..6)
        .map(|_| char::from(b'a' + rand::random::<u8>() % 26))
        .collect()
}

/// The ids `input` renders to with the template of the model in `dir`.
fn ids(engine: &slotstream::engine::Prepared, input: &Input) -> Vec<u32> {
    engine.encode(input).unwrap()
}

#[test]
fn every_dialect_renders_one_conversation_to_the_same_ids() {
    let dir = fixture_with_template(NAME, &qwen3_template());
    let engine = Engine::open(dir.path(), EngineOptions::default()).unwrap();
    let (system, question, city, result, follow_up) = (word(), word(), word(), word(), word());
    let schema = json!({ "type": "object", "properties": { "city": { "type": "string" } }, "required": ["city"] });
    let defaults = Default::default();

    let openai = json!({
        "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": question },
            { "role": "assistant", "content": null, "tool_calls": [{ "id": "call_1", "type": "function",
              "function": { "name": "get_weather", "arguments": json!({ "city": city }).to_string() } }] },
            { "role": "tool", "tool_call_id": "call_1", "content": result },
            { "role": "user", "content": follow_up },
        ],
        "tools": [{ "type": "function", "function": { "name": "get_weather", "description": "Weather", "parameters": schema } }],
    });
    let openai_body = openai.to_string();
    let openai = ChatRequest::parse(openai_body.as_bytes())
        .unwrap()
        .input()
        .unwrap();

    let ollama = json!({
        "model": "m",
        "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": question },
            { "role": "assistant", "content": "", "tool_calls": [{ "function": { "name": "get_weather", "arguments": { "city": city } } }] },
            { "role": "tool", "tool_name": "get_weather", "content": result },
            { "role": "user", "content": follow_up },
        ],
        "tools": [{ "type": "function", "function": { "name": "get_weather", "description": "Weather", "parameters": schema } }],
    });
    let ollama = ollama::chat_conversation(ollama.to_string().as_bytes(), &defaults)
        .unwrap()
        .unwrap()
        .input;

    let anthropic = json!({
        "model": "m",
        "max_tokens": 8,
        "system": [{ "type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=1;" }, { "type": "text", "text": system }],
        "messages": [
            { "role": "user", "content": question },
            { "role": "assistant", "content": [{ "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": { "city": city } }] },
            { "role": "user", "content": [
                { "type": "tool_result", "tool_use_id": "toolu_1", "content": [{ "type": "text", "text": result }] },
                { "type": "text", "text": follow_up },
            ] },
        ],
        "tools": [{ "name": "get_weather", "description": "Weather", "input_schema": schema },
                  { "type": "web_search_20250305", "name": "web_search" }],
    });
    let anthropic = anthropic::conversation(anthropic.to_string().as_bytes(), &defaults, false)
        .unwrap()
        .input;

    let responses = json!({
        "instructions": system,
        "input": [
            { "role": "user", "content": question },
            { "type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json!({ "city": city }).to_string() },
            { "type": "function_call_output", "call_id": "call_1", "output": result },
            { "type": "message", "role": "user", "content": [{ "type": "input_text", "text": follow_up }] },
        ],
        "tools": [{ "type": "function", "name": "get_weather", "description": "Weather", "parameters": schema }],
    });
    let responses = responses::translate(
        responses.to_string().as_bytes(),
        &defaults,
        &responses::Store::default(),
    )
    .unwrap()
    .conversation
    .input;

    // OpenAI's `developer` role is the system prompt; `reasoning_effort: none` is
    // thinking off, as `enable_thinking: false` is.
    let mut developer: Value = serde_json::from_str(&openai_body).unwrap();
    developer["messages"][0]["role"] = json!("developer");
    let chat = |body: &Value| {
        ChatRequest::parse(body.to_string().as_bytes())
            .unwrap()
            .input()
            .unwrap()
    };
    assert_eq!(ids(&engine, &chat(&developer)), ids(&engine, &openai));
    let mut effort = developer.clone();
    effort["reasoning_effort"] = json!("none");
    let mut off = developer.clone();
    off["enable_thinking"] = json!(false);
    assert_eq!(ids(&engine, &chat(&effort)), ids(&engine, &chat(&off)));
    assert_ne!(ids(&engine, &chat(&effort)), ids(&engine, &openai));

    let want = ids(&engine, &openai);
    let text = engine.tokenizer().unwrap().decode(&want).unwrap();
    for (dialect, input) in [
        ("ollama", &ollama),
        ("anthropic", &anthropic),
        ("responses", &responses),
    ] {
        assert_eq!(ids(&engine, input), want, "{dialect}: {text}");
    }
    // The conversation is all there: the tool's schema, the call and its result.
    for needle in [
        &system,
        &question,
        &city,
        &result,
        &follow_up,
        &"get_weather".to_string(),
    ] {
        assert!(text.contains(needle.as_str()), "{needle} not in {text}");
    }
}

/// The lines of an Ollama stream.
pub(crate) async fn ndjson(s: &Server, path: &str, body: &Value) -> Vec<Value> {
    let (kind, raw) = s.post_text(path, body).await;
    assert_eq!(kind, "application/x-ndjson");
    raw.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Named server-sent events: `(event, data)`.
async fn named_events(s: &Server, path: &str, body: &Value) -> Vec<(String, Value)> {
    let (_, raw) = s.post_text(path, body).await;
    let mut events = Vec::new();
    for block in raw.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let name = block.lines().find_map(|l| l.strip_prefix("event: "));
        let data = block.lines().find_map(|l| l.strip_prefix("data: "));
        if let (Some(name), Some(data)) = (name, data) {
            events.push((name.to_string(), serde_json::from_str(data).unwrap()));
        }
    }
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_chat_and_generate_equal_generate() {
    let s = start(16, 0, None).await;
    let question = word();
    let cli = cli_generate(&["--prompt", &question, "--max-tokens", "12"]);
    let prompt_tokens = cli["prompt_ids"].as_array().unwrap().len();
    let body = json!({ "model": "any", "messages": [{ "role": "user", "content": question }],
                       "options": { "num_predict": 12, "temperature": 0 }, "stream": false });
    let (status, v) = s.post("/api/chat", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["message"]["content"], cli["text"], "{v}");
    assert_eq!(v["message"]["role"], "assistant");
    assert_eq!(v["model"], "any");
    assert_eq!(v["done"], true);
    // The random model may end its turn before the limit: then the CLI's output is shorter.
    let generated = cli["output_ids"].as_array().unwrap().len();
    let reason = if generated == 12 { "length" } else { "stop" };
    assert_eq!(v["done_reason"], reason);
    assert_eq!(v["prompt_eval_count"], prompt_tokens);
    assert_eq!(v["eval_count"], generated);
    for field in ["total_duration", "prompt_eval_duration", "eval_duration"] {
        assert!(v[field].as_u64().is_some_and(|ns| ns > 0), "{field}: {v}");
    }
    // Streamed by default: the same text in pieces, then a last line with the counts.
    let mut streamed = body.clone();
    streamed.as_object_mut().unwrap().remove("stream");
    let lines = ndjson(&s, "/api/chat", &streamed).await;
    let (last, pieces) = lines.split_last().unwrap();
    assert!(pieces.iter().all(|l| l["done"] == false));
    let text: String = pieces
        .iter()
        .map(|l| l["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, cli["text"].as_str().unwrap());
    assert_eq!(
        (
            last["done"].clone(),
            last["done_reason"].clone(),
            last["eval_count"].clone()
        ),
        (json!(true), json!(reason), json!(generated))
    );

    // /api/generate: the prompt through the template, or raw.
    let (_, g) = s
        .post(
            "/api/generate",
            &json!({ "model": "m", "prompt": question, "stream": false, "options": { "num_predict": 12 } }),
        )
        .await;
    assert_eq!(g["response"], cli["text"], "{g}");
    let raw_cli = cli_generate(&["--raw", "--prompt", &question, "--max-tokens", "6"]);
    let lines = ndjson(
        &s,
        "/api/generate",
        &json!({ "model": "m", "prompt": question, "raw": true, "options": { "num_predict": 6 } }),
    )
    .await;
    let text: String = lines
        .iter()
        .map(|l| l["response"].as_str().unwrap())
        .collect();
    assert_eq!(text, raw_cli["text"].as_str().unwrap());

    // Loading a model: the acknowledgement.
    let (status, ack) = s
        .post("/api/chat", &json!({ "model": "m", "messages": [] }))
        .await;
    assert_eq!(
        (status, ack["done_reason"].clone()),
        (200, json!("load")),
        "{ack}"
    );
    let (_, ack) = s.post("/api/generate", &json!({ "model": "m" })).await;
    assert_eq!(ack["done_reason"], "load", "{ack}");

    // Metadata.
    let tags: Value = s.get_json("/api/tags").await;
    let names: Vec<&str> = tags["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, [NAME, "alias-a", "alias-b"]);
    assert_eq!(tags["models"][0]["details"]["family"], "qwen3_next");
    assert!(tags["models"][0]["size"].as_u64().unwrap() > 1 << 20);
    let (status, show) = s.post("/api/show", &json!({ "model": NAME })).await;
    assert_eq!(status, 200, "{show}");
    assert_eq!(show["model_info"]["general.architecture"], "qwen3_next");
    assert_eq!(show["model_info"]["qwen3_next.expert_count"], 16);
    assert_eq!(
        show["model_info"]["qwen3_next.context_length"],
        SourceOptions::default().context
    );
    assert_eq!(show["capabilities"], json!(["completion"]));
    let ps: Value = s.get_json("/api/ps").await;
    assert_eq!(ps["models"][0]["name"], NAME);
    let version: Value = s.get_json("/api/version").await;
    assert!(version["version"].as_str().is_some());

    // Errors are `{"error": "..."}` with the status.
    for (path, body, status) in [
        (
            "/api/chat",
            json!({ "messages": [{ "role": "user", "content": "a", "images": ["aGk="] }] }),
            400,
        ),
        (
            "/api/chat",
            json!({ "messages": [{ "role": "x", "content": "a" }] }),
            400,
        ),
        (
            "/api/chat",
            json!({ "messages": [{ "role": "user", "content": "a" }], "format": 7 }),
            400,
        ),
        (
            "/api/chat",
            json!({ "messages": [{ "role": "user", "content": "a" }], "options": { "temperature": -1 } }),
            400,
        ),
        (
            "/api/generate",
            json!({ "prompt": "a", "context": [1, 2] }),
            400,
        ),
        ("/api/show", json!({ "model": "no-such-model" }), 404),
        ("/api/embed", json!({ "model": "m", "input": "a" }), 501),
        ("/api/pull", json!({ "model": "m" }), 501),
        ("/api/no-such-route", json!({}), 404),
    ] {
        let (got, v) = s.post(path, &body).await;
        assert_eq!(got, status, "{path} {body}: {v}");
        assert!(v["error"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
    let (_, v) = s
        .post("/api/chat", &json!({ "messages": [{ "role": "user", "content": "a" }], "options": { "temperature": -1 } }))
        .await;
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .starts_with("options.temperature"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_equal_generate_and_answer_in_its_shapes() {
    let s = start(16, 0, Some("k")).await;
    let question = word();
    let cli = cli_generate(&["--prompt", &question, "--max-tokens", "10"]);
    let prompt_tokens = cli["prompt_ids"].as_array().unwrap().len();
    let body = json!({ "model": "claude-x", "max_tokens": 10, "messages": [{ "role": "user", "content": question }] });
    let post = |body: Value, key: &'static str, path: &'static str| {
        s.client
            .post(format!("{}{path}", s.base))
            .header("x-api-key", key)
            .header("anthropic-version", "2023-06-01")
            .json(&body)
            .send()
    };
    let r = post(body.clone(), "k", "/v1/messages").await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "message");
    assert_eq!(v["model"], "claude-x");
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(v["content"][0]["text"], cli["text"], "{v}");
    let generated = cli["output_ids"].as_array().unwrap().len();
    let reason = if generated == 10 {
        "max_tokens"
    } else {
        "end_turn"
    };
    assert_eq!(v["stop_reason"], reason);
    assert_eq!(v["usage"]["output_tokens"], generated);
    assert_eq!(
        v["usage"]["input_tokens"].as_u64().unwrap()
            + v["usage"]["cache_read_input_tokens"].as_u64().unwrap(),
        prompt_tokens as u64
    );

    let r = post(
        json!({ "model": "m", "messages": body["messages"] }),
        "k",
        "/v1/messages/count_tokens",
    )
    .await
    .unwrap();
    assert_eq!(
        r.json::<Value>().await.unwrap()["input_tokens"],
        prompt_tokens
    );

    // Streamed: the event order Anthropic's SDK expects, the same text.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = {
        let r = post(streamed, "k", "/v1/messages").await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let raw = r.text().await.unwrap();
        raw.split("\n\n")
            .filter_map(|b| {
                let name = b.lines().find_map(|l| l.strip_prefix("event: "))?;
                let data = b.lines().find_map(|l| l.strip_prefix("data: "))?;
                Some((
                    name.to_string(),
                    serde_json::from_str::<Value>(data).unwrap(),
                ))
            })
            .collect::<Vec<_>>()
    };
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..3], ["message_start", "ping", "content_block_start"]);
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    let text: String = events
        .iter()
        .filter_map(|(_, d)| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, cli["text"].as_str().unwrap());
    assert_eq!(
        events[events.len() - 2].1["delta"]["stop_reason"],
        "max_tokens"
    );

    // Error shapes.
    let error = |v: &Value| v["error"]["type"].as_str().map(String::from);
    let r = post(json!({ "messages": body["messages"] }), "k", "/v1/messages")
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        (v["type"].as_str(), error(&v).as_deref()),
        (Some("error"), Some("invalid_request_error"))
    );
    let r = post(body.clone(), "wrong", "/v1/messages").await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(
        error(&r.json().await.unwrap()).as_deref(),
        Some("authentication_error")
    );
    let image = json!({ "model": "m", "max_tokens": 4, "messages": [{ "role": "user", "content": [
        { "type": "image", "source": { "type": "base64", "media_type": "image/png", "data": "aGk=" } }] }] });
    let r = post(image, "k", "/v1/messages").await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
}

/// A template whose reply opens a `<think>` block: the random model never closes it, so
/// the whole reply is reasoning, which comes back as a thinking block.
const THINKING_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n<think>\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_thinking_round_trips_and_a_full_queue_is_overloaded() {
    let dir = fixture_with_template(NAME, THINKING_TEMPLATE);
    let s = start_on(
        dir.path(),
        SourceOptions::default().context,
        16,
        0,
        None,
        true,
    )
    .await;
    let question = word();
    let body = json!({ "model": "m", "max_tokens": 6, "thinking": { "type": "enabled", "budget_tokens": 1024 },
                       "messages": [{ "role": "user", "content": question }] });
    let (status, v) = s.post("/v1/messages", &body).await;
    assert_eq!(status, 200, "{v}");
    let block = v["content"][0].clone();
    assert_eq!(block["type"], "thinking", "{v}");
    assert!(block["signature"].as_str().is_some_and(|s| !s.is_empty()));
    // Sent back as the assistant's turn, the block is accepted; edited, it is refused.
    let mut next = body.clone();
    next["messages"] = json!([
        { "role": "user", "content": question },
        { "role": "assistant", "content": [block.clone(), { "type": "text", "text": "ok" }] },
        { "role": "user", "content": word() },
    ]);
    let (status, v) = s.post("/v1/messages", &next).await;
    assert_eq!(status, 200, "{v}");
    next["messages"][1]["content"][0]["thinking"] =
        json!(format!("{} edited", block["thinking"].as_str().unwrap()));
    let (status, v) = s.post("/v1/messages", &next).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let (s, _tmp) = start_without_eos(1).await;
    let hold = s
        .client
        .post(format!("{}/v1/messages", s.base))
        .json(
            &json!({ "model": "m", "max_tokens": 3000, "stream": true, "temperature": 1.0,
                       "messages": [{ "role": "user", "content": "hold" }] }),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(hold.status().as_u16(), 200);
    let (status, v) = s
        .post("/v1/messages", &json!({ "model": "m", "max_tokens": 1, "messages": [{ "role": "user", "content": "a" }] }))
        .await;
    assert_eq!(status, 529, "{v}");
    assert_eq!(v["error"]["type"], "overloaded_error");
    drop(hold);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_equal_generate_and_continue_stored_ones() {
    let s = start(16, 0, None).await;
    let question = word();
    let cli = cli_generate(&["--prompt", &question, "--max-tokens", "8"]);
    let body = json!({ "model": "m", "input": question, "max_output_tokens": 8 });
    let (status, v) = s.post("/v1/responses", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "response");
    let complete = cli["output_ids"].as_array().unwrap().len() < 8;
    let (status, last) = match complete {
        true => ("completed", "response.completed"),
        false => ("incomplete", "response.incomplete"),
    };
    assert_eq!(v["status"], status);
    if !complete {
        assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    }
    let message = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["type"] == "message")
        .unwrap();
    assert_eq!(message["content"][0]["type"], "output_text");
    assert_eq!(message["content"][0]["text"], cli["text"], "{v}");
    assert_eq!(
        v["usage"]["input_tokens"],
        cli["prompt_ids"].as_array().unwrap().len()
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = named_events(&s, "/v1/responses", &streamed).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..2], ["response.created", "response.in_progress"]);
    assert_eq!(names.last(), Some(&last));
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i);
    }
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, cli["text"].as_str().unwrap());

    // A follow-up continues the stored conversation: its prompt is the chat of the
    // question, the reply and the follow-up.
    let id = v["id"].as_str().unwrap();
    let stored: Value = s.get_json(&format!("/v1/responses/{id}")).await;
    assert_eq!(stored["id"], id);
    let follow_up = word();
    let (status, v2) = s
        .post(
            "/v1/responses",
            &json!({ "input": follow_up, "previous_response_id": id, "max_output_tokens": 2 }),
        )
        .await;
    assert_eq!(status, 200, "{v2}");
    let chat = json!({ "messages": [
        { "role": "user", "content": question },
        { "role": "assistant", "content": cli["text"] },
        { "role": "user", "content": follow_up },
    ], "max_tokens": 2 });
    let (_, c) = s.post("/v1/chat/completions", &chat).await;
    assert_eq!(
        v2["usage"]["input_tokens"], c["usage"]["prompt_tokens"],
        "{v2} {c}"
    );
    // `store: false` keeps nothing; an unknown id is a 404.
    let (_, v3) = s
        .post(
            "/v1/responses",
            &json!({ "input": "a", "store": false, "max_output_tokens": 1 }),
        )
        .await;
    let gone = v3["id"].as_str().unwrap();
    let (status, _) = s
        .post(
            "/v1/responses",
            &json!({ "input": "a", "previous_response_id": gone }),
        )
        .await;
    assert_eq!(status, 404);
    let (status, v) = s
        .post("/v1/responses", &json!({ "input": [{ "role": "user", "content": [{ "type": "input_image", "image_url": "data:," }] }] }))
        .await;
    assert_eq!(status, 400, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_loading_until_the_engine_is_handed_over() {
    let (app, loading) = loading_router(ServerOptions {
        model_id: "m".into(),
        aliases: Vec::new(),
        queue: 4,
        api_key: None,
        default_max_tokens: 4,
        sampling: Default::default(),
        reasoning: true,
        max_prefill_wait: None,
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(serve(listener, app, Default::default()));
    let client = reqwest::Client::new();
    let r = client.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "loading");
    let r = client
        .post(format!("{base}/api/chat"))
        .json(&json!({ "messages": [{ "role": "user", "content": "a" }] }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let engine = Engine::load(
        &fixture_dir(NAME),
        EngineOptions {
            device: Some("cpu".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    loading.loaded(engine);
    let r = client.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = client
        .post(format!("{base}/api/chat"))
        .json(&json!({ "messages": [{ "role": "user", "content": "a" }], "stream": false, "options": { "num_predict": 2 } }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

/// `GET /metrics` in OpenMetrics text: requests by route and status, tokens, the queue and
/// the latency histograms add up to what the requests answered; the pool's size is its
/// slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_was_served() {
    let s = start(16, 0, None).await;
    let (mut prompt, mut generated, mut gaps) = (0, 0, 0);
    for stream in [false, false, true] {
        let body = json!({ "messages": [{ "role": "user", "content": word() }], "max_tokens": 5, "stream": stream,
                           "stream_options": if stream { json!({ "include_usage": true }) } else { Value::Null } });
        let usage = if stream {
            let (_, _, chunks) = s.stream("/v1/chat/completions", &body).await;
            chunks.last().unwrap()["usage"].clone()
        } else {
            let (status, v) = s.post("/v1/chat/completions", &body).await;
            assert_eq!(status, 200, "{v}");
            v["usage"].clone()
        };
        prompt += usage["prompt_tokens"].as_u64().unwrap();
        let n = usage["completion_tokens"].as_u64().unwrap();
        generated += n;
        gaps += n.saturating_sub(1);
    }
    let r = s.get("/no-such-route").await;
    assert_eq!(r.status().as_u16(), 404);
    let r = s.get("/metrics").await;
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/openmetrics-text"));
    let text = r.text().await.unwrap();
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    assert_eq!(
        value(r#"slotstream_requests_total{route="/v1/chat/completions",status="200"}"#),
        3.0
    );
    assert_eq!(
        value(r#"slotstream_requests_total{route="unmatched",status="404"}"#),
        1.0
    );
    assert_eq!(value("slotstream_prompt_tokens_total"), prompt as f64);
    assert_eq!(value("slotstream_generated_tokens_total"), generated as f64);
    assert_eq!(value("slotstream_time_to_first_token_seconds_count"), 3.0);
    assert_eq!(
        value("slotstream_time_per_output_token_seconds_count"),
        gaps as f64
    );
    assert_eq!(value("slotstream_queue_length"), 0.0);
    // A fixed pool of 24 slots: its size, and no resizes.
    assert_eq!(value("slotstream_pool_slots"), 24.0);
    assert_eq!(value("slotstream_pool_shrinks_total"), 0.0);
    assert_eq!(value("slotstream_pool_grows_total"), 0.0);
    assert_eq!(value("slotstream_pool_bytes_returned_total"), 0.0);
    assert!(text.trim_end().ends_with("# EOF"));
}

/// An image and a question sent in each dialect's shape (OpenAI's `image_url` data URL,
/// Anthropic's base64 image block, Ollama's `images`, the Responses API's `input_image`)
/// reach the same conversation: the same image bytes and the same ids (the image's
/// placeholder before the text); an http(s) URL and text that is not base64 are 400s.
#[test]
fn every_dialect_takes_an_image_to_the_same_ids() {
    use base64::Engine as _;
    let dir = fixture_with_template("qwen3_5-moe-vision", crate::vision::IMAGE_TEMPLATE);
    let engine = Engine::open(dir.path(), EngineOptions::default()).unwrap();
    let png = std::fs::read(fixture_dir("qwen3_5-moe-vision").join("image1.png")).unwrap();
    let b64 = base64::engine::general_purpose::STANDARD.encode(&png);
    let url = format!("data:image/png;base64,{b64}");
    let question = word();
    let defaults = Default::default();
    let openai = |url: &str| {
        let body = json!({ "messages": [{ "role": "user", "content": [
            { "type": "image_url", "image_url": { "url": url } }, { "type": "text", "text": question }] }] });
        ChatRequest::parse(body.to_string().as_bytes())
            .unwrap()
            .input()
    };
    let anthropic = |data: &str| {
        let body = json!({ "model": "m", "max_tokens": 4, "messages": [{ "role": "user", "content": [
            { "type": "image", "source": { "type": "base64", "media_type": "image/png", "data": data } },
            { "type": "text", "text": question }] }] });
        anthropic::conversation(body.to_string().as_bytes(), &defaults, false).map(|c| c.input)
    };
    let ollama = json!({ "model": "m", "messages": [{ "role": "user", "content": question, "images": [b64] }] });
    let ollama = ollama::chat_conversation(ollama.to_string().as_bytes(), &defaults)
        .unwrap()
        .unwrap()
        .input;
    let responses = json!({ "input": [{ "role": "user", "content": [
        { "type": "input_image", "image_url": url }, { "type": "input_text", "text": question }] }] });
    let responses = responses::translate(
        responses.to_string().as_bytes(),
        &defaults,
        &responses::Store::default(),
    )
    .unwrap()
    .conversation
    .input;
    let openai_input = openai(&url).unwrap();
    let want = ids(&engine, &openai_input);
    assert_eq!(
        want.iter().filter(|&&t| t == 507).count(),
        1,
        "one placeholder"
    );
    for (dialect, input) in [
        ("openai", &openai_input),
        ("anthropic", &anthropic(&b64).unwrap()),
        ("ollama", &ollama),
        ("responses", &responses),
    ] {
        assert_eq!(ids(&engine, input), want, "{dialect}");
        let Input::Chat(chat) = input else {
            panic!("{dialect}: not a chat")
        };
        let images: Vec<&[u8]> = chat.images().map(|i| &*i.bytes).collect();
        assert_eq!(images, [&png[..]], "{dialect}");
    }
    for bad in [
        "https://example.com/a.png",
        "data:image/png,abc",
        "file:///a.png",
    ] {
        let e = openai(bad).unwrap_err();
        assert_eq!(e.status.as_u16(), 400, "{bad}");
    }
    let e = anthropic("not base64!").unwrap_err();
    assert_eq!(e.status.as_u16(), 400);
}
