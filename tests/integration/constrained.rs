//! Log-probabilities and constrained decoding on the random-weight fixture: the
//! log-probabilities equal the log-softmax of `score`'s logits for the same ids, in
//! OpenAI's and Ollama's shapes, streamed or not; replies constrained by JSON schemas
//! (fresh seeds, at temperature 1, validated with the `jsonschema` crate), regexes, Lark
//! grammars and Ollama's `format` match them; grammars llguidance refuses get a 400 (the
//! CLI exits 1).

use futures::StreamExt;
use rand::Rng;
use serde_json::{json, Value};
use slotstream::engine::{Event, Input, Request};
use slotstream::sampling::SamplingOptions;

use crate::common::*;
use crate::dialects::ndjson;
use crate::serve::{start, NAME};

/// The log-softmax of one row of logits.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum::<f64>()
            .ln();
    row.iter().map(|&v| v as f64 - lse).collect()
}

/// Each generated token's log-probability (sampled at temperature 1 with a fresh seed)
/// equals the log-softmax of `score`'s logits at its position within 1e-4, and its top
/// five are the five most probable ids of that row, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_equal_the_scored_log_softmax() {
    let s = start(4, 0, None).await;
    let prompt = reference(NAME).prompt_ids;
    let seed: u64 = rand::random();
    let mut events = s.engine.generate(Request {
        input: Input::Ids(prompt.clone()),
        max_tokens: 12,
        sampling: SamplingOptions {
            temperature: 1.0,
            seed,
            ..Default::default()
        },
        logprobs: Some(5),
        constraint: None,
    });
    let mut steps = Vec::new();
    while let Some(e) = events.next().await {
        if let Event::Token { id, logprobs, .. } = e.unwrap() {
            steps.push((id, logprobs.expect("asked for")));
        }
    }
    assert!(!steps.is_empty());
    let mut ids = prompt.clone();
    ids.extend(steps.iter().map(|s| s.0));
    let score = s.engine.score(ids).await.unwrap();
    let v = score.vocab;
    for (i, (id, lp)) in steps.iter().enumerate() {
        let row = log_softmax(&score.logits[(prompt.len() - 1 + i) * v..][..v]);
        assert!(
            (lp.logprob as f64 - row[*id as usize]).abs() < 1e-4,
            "seed {seed} step {i}: {} vs {}",
            lp.logprob,
            row[*id as usize]
        );
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        assert_eq!(lp.top.len(), 5);
        for (k, &(top_id, top_lp)) in lp.top.iter().enumerate() {
            assert!((top_lp as f64 - row[top_id as usize]).abs() < 1e-4);
            // The k-th most probable (up to ties within rounding).
            assert!(
                (row[top_id as usize] - row[order[k]]).abs() < 1e-5,
                "seed {seed}"
            );
        }
    }
}

/// Chat's `logprobs` + `top_logprobs`, streamed and not, and completions' integer
/// `logprobs` and Ollama's, in their shapes; a greedy reply's tokens are each step's most
/// probable, the top lists sorted, every token accounted for, the streamed values equal
/// to the whole response's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_in_openai_and_ollama_shapes() {
    let s = start(4, 0, None).await;
    let chat = json!({
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 3,
    });
    let (status, whole) = s.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{whole}");
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        content.len() as u64,
        whole["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for entry in &content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        let values: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(values.windows(2).all(|w| w[0] >= w[1]), "{values:?}");
        // Greedy: the chosen token is the most probable.
        assert_eq!(entry["token"], top[0]["token"]);
        assert_eq!(entry["logprob"], top[0]["logprob"]);
        let bytes: Vec<u8> = serde_json::from_value(entry["bytes"].clone()).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            entry["token"].as_str().unwrap()
        );
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
    }
    let mut streamed_body = chat.clone();
    streamed_body["stream"] = json!(true);
    let (_, _, chunks) = s.stream("/v1/chat/completions", &streamed_body).await;
    let streamed: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(streamed, content);
    // Every chunk with text carries its tokens' entries.
    for c in &chunks {
        if c["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            assert!(
                !c["choices"][0]["logprobs"]["content"]
                    .as_array()
                    .unwrap()
                    .is_empty(),
                "{c}"
            );
        }
    }

    let completion = json!({"prompt": "hello", "max_tokens": 6, "temperature": 0, "logprobs": 2});
    let (status, v) = s.post("/v1/completions", &completion).await;
    assert_eq!(status, 200, "{v}");
    let l = &v["choices"][0]["logprobs"];
    let tokens = l["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 6);
    assert_eq!(l["token_logprobs"].as_array().unwrap().len(), 6);
    let offsets: Vec<u64> = serde_json::from_value(l["text_offset"].clone()).unwrap();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    for (top, lp) in l["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(l["token_logprobs"].as_array().unwrap())
    {
        let top = top.as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 2);
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert_eq!(best, lp.as_f64().unwrap());
    }

    // Ollama: a list of {token, logprob, bytes, top_logprobs} over the lines.
    let body = json!({
        "model": NAME, "messages": [{"role": "user", "content": "hi"}],
        "logprobs": true, "top_logprobs": 3,
        "options": {"temperature": 0, "num_predict": 8},
    });
    let lines = ndjson(&s, "/api/chat", &body).await;
    let entries: Vec<Value> = lines
        .iter()
        .filter_map(|l| l["logprobs"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(entries, content, "Ollama's entries are OpenAI chat's");
    let mut whole_body = body.clone();
    whole_body["stream"] = json!(false);
    let (_, v) = s.post("/api/chat", &whole_body).await;
    assert_eq!(v["logprobs"].as_array().unwrap(), &content);

    for (path, body, field) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 6}),
            "logprobs",
        ),
    ] {
        let (status, v) = s.post(path, &body).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], field, "{v}");
    }
}

/// Schemas whose instances are short, for a random model at temperature 1: every string
/// bounded (maxLength, enum, pattern, format), every object closed.
fn schemas() -> Vec<Value> {
    let closed = |properties: Value, required: Value| json!({"type": "object", "properties": properties, "required": required, "additionalProperties": false});
    vec![
        closed(
            json!({"name": {"type": "string", "maxLength": 6}}),
            json!(["name"]),
        ),
        closed(
            json!({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
            json!(["age"]),
        ),
        closed(
            json!({"t": {"type": "number", "minimum": -1.5, "maximum": 2.5}}),
            json!(["t"]),
        ),
        closed(
            json!({"ok": {"type": "boolean"}, "n": {"type": "null"}}),
            json!(["ok", "n"]),
        ),
        closed(
            json!({"color": {"enum": ["red", "green", "blue"]}}),
            json!(["color"]),
        ),
        closed(json!({"k": {"const": "fixed"}}), json!(["k"])),
        closed(
            json!({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4}}),
            json!(["tags"]),
        ),
        closed(
            json!({"xs": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 3}}),
            json!(["xs"]),
        ),
        closed(
            json!({"inner": {"type": "object", "properties": {"deep": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["v"], "additionalProperties": false}}, "required": ["deep"], "additionalProperties": false}}),
            json!(["inner"]),
        ),
        closed(
            json!({"a": {"type": "integer", "minimum": 0, "maximum": 5}, "b": {"type": "string", "maxLength": 3}}),
            json!(["a"]),
        ),
        closed(
            json!({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}}),
            json!(["v"]),
        ),
        closed(
            json!({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
            json!(["code"]),
        ),
        closed(
            json!({"day": {"type": "string", "format": "date"}}),
            json!(["day"]),
        ),
        closed(
            json!({"id": {"type": "string", "format": "uuid"}}),
            json!(["id"]),
        ),
        closed(
            json!({"ip": {"type": "string", "format": "ipv4"}}),
            json!(["ip"]),
        ),
        json!({
            "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"], "additionalProperties": false}},
            "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
            "required": ["from", "to"], "additionalProperties": false,
        }),
        json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3}),
        json!({"enum": ["yes", "no", 1, null]}),
        json!({"type": "integer", "minimum": 10, "maximum": 20}),
        json!({"type": "string", "maxLength": 4}),
        closed(
            json!({"shape": {"oneOf": [
                {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["kind", "r"], "additionalProperties": false},
                {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["kind", "side"], "additionalProperties": false},
            ]}}),
            json!(["shape"]),
        ),
        closed(
            json!({"people": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {"n": {"type": "string", "maxLength": 3}, "k": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["n", "k"], "additionalProperties": false}}}),
            json!(["people"]),
        ),
        closed(
            json!({"p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4}, "q": {"type": "number", "minimum": 0, "maximum": 1}, "r": {"enum": [true, false]}}),
            json!(["p", "q"]),
        ),
    ]
}

/// Each schema of the suite, through `response_format` json_schema (strict) at temperature
/// 1 with a fresh seed: the reply parses, validates (formats too) and ends by the
/// grammar's own end (finish reason stop).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_replies_validate() {
    let s = start(4, 0, None).await;
    let mut rng = rand::rng();
    let schemas = schemas();
    assert!(schemas.len() >= 20);
    for (i, schema) in schemas.iter().enumerate() {
        let seed: u64 = rng.random_range(0..1 << 53);
        let body = json!({
            "messages": [{"role": "user", "content": "give me JSON"}],
            "max_tokens": 400, "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}},
        });
        let (status, v) = s.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "schema {i}: {v}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(
            v["choices"][0]["finish_reason"], "stop",
            "schema {i} seed {seed}: {text}"
        );
        let instance: Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("schema {i} seed {seed}: {e}: {text}"));
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .build(schema)
            .unwrap();
        assert!(
            validator.is_valid(&instance),
            "schema {i} seed {seed}: {text} against {schema}"
        );
    }
}

/// `json_object`, vLLM's `guided_regex` and `guided_grammar` on completions, Ollama's
/// `format` ("json" and a schema), streamed or not; a constrained reply cut by
/// `max_tokens` ends with `length`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regexes_grammars_json_objects_and_ollama_formats() {
    let s = start(4, 0, None).await;
    let seed = || rand::random::<u32>();
    let (_, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 40, "temperature": 1.0, "seed": seed(), "guided_regex": "[a-c]{2,5}-(yes|no)"}),
        )
        .await;
    let text = v["choices"][0]["text"].as_str().unwrap();
    let (head, tail) = text.split_once('-').unwrap_or_else(|| panic!("{v}"));
    assert!(
        (2..=5).contains(&head.len()) && head.chars().all(|c| "abc".contains(c)),
        "{text}"
    );
    assert!(["yes", "no"].contains(&tail), "{text}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let lark = "start: item (\",\" item)*\nitem: \"ab\" | \"cd\" | NUM\nNUM: /[0-9]/\n";
    let body = json!({"prompt": "x", "max_tokens": 60, "temperature": 1.0, "seed": seed(), "guided_grammar": lark, "stream": true});
    let (text, finish, _) = s.stream("/v1/completions", &body).await;
    if finish == "stop" {
        assert!(
            text.split(',').all(|i| ["ab", "cd"].contains(&i)
                || (i.len() == 1 && i.chars().all(|c| c.is_ascii_digit()))),
            "{text}"
        );
    } else {
        assert_eq!(finish, "length");
    }

    // json_object: any object; a random model may ramble inside one, so only what it
    // wrote when it stopped by itself is parsed.
    let (_, v) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 300, "temperature": 0.7, "seed": seed(), "response_format": {"type": "json_object"}}),
        )
        .await;
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.starts_with('{'), "{text}");
    if v["choices"][0]["finish_reason"] == "stop" {
        // JSON's numbers have no range (RFC 8259, section 6) and a random model writes
        // 1e999: the syntax is checked without converting them, as `Value` would.
        let parsed = serde_json::from_str::<serde::de::IgnoredAny>(text);
        assert!(parsed.is_ok() && text.ends_with('}'), "{text}: {parsed:?}");
    }

    // Out of tokens mid-object: finish reason length, the text a prefix.
    let schema = json!({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]{20}$"}}, "required": ["code"], "additionalProperties": false});
    let (_, v) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "guided_json": schema}),
        )
        .await;
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    let opening = "{\"code\": \"";
    assert!(
        text.starts_with(opening) || opening.starts_with(text),
        "{text}"
    );

    // Ollama's format: a schema, streamed, and "json".
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}, "w": {"enum": ["x", "y"]}}, "required": ["n", "w"], "additionalProperties": false});
    let lines = ndjson(
        &s,
        "/api/chat",
        &json!({"model": NAME, "messages": [{"role": "user", "content": "x"}], "format": schema, "options": {"temperature": 1.0, "seed": seed(), "num_predict": 100}}),
    )
    .await;
    let text: String = lines
        .iter()
        .filter_map(|l| l["message"]["content"].as_str())
        .collect();
    let instance: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(jsonschema::is_valid(&schema, &instance), "{text}");
    assert_eq!(lines.last().unwrap()["done_reason"], "stop");
    let (_, v) = s
        .post(
            "/api/generate",
            &json!({"model": NAME, "prompt": "x", "format": "json", "stream": false, "options": {"temperature": 0, "num_predict": 50}}),
        )
        .await;
    assert!(v["response"].as_str().unwrap().starts_with('{'), "{v}");
}

/// Grammars llguidance refuses get a 400 naming the field with its message, in every
/// place a request gives one, and the CLI exits 1 with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_grammars_get_400_and_the_cli_exits_1() {
    let s = start(4, 0, None).await;
    let bad_schema = json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]});
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    for (path, body, field) in [
        (
            "/v1/chat/completions",
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}}}),
            ),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}})),
            "guided_json",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"guided_grammar": "start: undefined_rule"})),
            "guided_grammar",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"guided_regex": "(unclosed"})),
            "guided_regex",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})),
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "xml"}})),
            "response_format.type",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"guided_regex": "a", "guided_grammar": "start: \"a\""})),
            "guided_grammar",
        ),
        (
            "/api/chat",
            json!({"model": NAME, "messages": [{"role": "user", "content": "x"}], "format": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}),
            "format",
        ),
    ] {
        let (status, v) = s.post(path, &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        let message = v["error"]["message"]
            .as_str()
            .or(v["error"].as_str())
            .unwrap();
        assert!(message.starts_with(field), "{field}: {v}");
    }
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("schema.json");
    std::fs::write(&schema, bad_schema.to_string()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .args([
            "generate",
            "--model",
            fixture_dir(NAME).to_str().unwrap(),
            "--device",
            "cpu",
            "--json-schema",
        ])
        .arg(&schema)
        .arg("hi")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--json-schema") && stderr.contains("missing"),
        "{stderr}"
    );
}

/// `generate --json-schema` and `--grammar`: the output matches; the masks' time is in the
/// stats.
#[test]
fn cli_generate_takes_a_schema_and_a_grammar() {
    let dir = tempfile::tempdir().unwrap();
    let schema_path = dir.path().join("schema.json");
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50}, "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": false});
    std::fs::write(&schema_path, schema.to_string()).unwrap();
    let seed = rand::random::<u32>().to_string();
    let v = crate::serve::cli_generate(&[
        "--json-schema",
        schema_path.to_str().unwrap(),
        "--temp",
        "1",
        "--seed",
        &seed,
        "-n",
        "100",
        "hi",
    ]);
    let instance: Value = serde_json::from_str(v["text"].as_str().unwrap()).unwrap();
    assert!(jsonschema::is_valid(&schema, &instance), "{v}");
    // The masks' time is counted, and what the forward pass did not hide is part of decode.
    let stat = |v: &Value, key: &str| v["stats"][key].as_f64().unwrap();
    assert!(stat(&v, "mask_seconds") > 0.0, "{v}");
    assert!(stat(&v, "mask_wait_seconds") > 0.0, "{v}");
    assert!(
        stat(&v, "mask_wait_seconds") <= stat(&v, "decode_seconds"),
        "{v}"
    );
    let plain = crate::serve::cli_generate(&["-n", "4", "hi"]);
    assert_eq!(stat(&plain, "mask_seconds"), 0.0);
    assert_eq!(stat(&plain, "mask_wait_seconds"), 0.0);
    let grammar = dir.path().join("g.lark");
    std::fs::write(&grammar, "start: (\"yes\" | \"no\") \"!\"\n").unwrap();
    let v = crate::serve::cli_generate(&["--grammar", grammar.to_str().unwrap(), "-n", "10", "hi"]);
    assert!(
        ["yes!", "no!"].contains(&v["text"].as_str().unwrap()),
        "{v}"
    );
}

/// A required or named call, in Qwen3's JSON format and Qwen3-Coder's XML format, through
/// OpenAI's chat, Anthropic's `tool_choice` any/tool and the Responses API: the random
/// model's reply (temperature 1, fresh seed) is one whole call whose arguments validate
/// against the tool's parameters. Responses' `text.format` json_schema validates too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_calls_parse_and_validate_in_both_formats() {
    let parameters = json!({"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": false});
    let time = json!({"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": false});
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": parameters}},
        {"type": "function", "function": {"name": "get_time", "parameters": time}},
    ]);
    let coder =
        std::fs::read_to_string(fixture_dir("qwen3-chat").join("qwen3_coder.jinja")).unwrap();
    for template in [qwen3_template(), coder] {
        let dir = fixture_with_template(NAME, &template);
        let s = crate::serve::start_on(dir.path(), 4096, 4, 0, None, true).await;
        for choice in [
            json!("required"),
            json!({"type": "function", "function": {"name": "get_time"}}),
        ] {
            let seed: u32 = rand::random();
            let body = json!({
                "messages": [{"role": "user", "content": "weather?"}], "tools": tools, "tool_choice": choice,
                "max_tokens": 200, "temperature": 1.0, "seed": seed, "chat_template_kwargs": {"enable_thinking": false},
            });
            let (status, v) = s.post("/v1/chat/completions", &body).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(
                v["choices"][0]["finish_reason"], "tool_calls",
                "seed {seed}: {v}"
            );
            let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1, "{v}");
            let name = calls[0]["function"]["name"].as_str().unwrap();
            if choice != "required" {
                assert_eq!(name, "get_time");
            }
            let schema = if name == "get_weather" {
                &parameters
            } else {
                &time
            };
            let args: Value =
                serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
            assert!(
                jsonschema::is_valid(schema, &args),
                "seed {seed}: {args} against {schema}"
            );
        }
        // Anthropic's `any`: a tool_use block whose input validates.
        let body = json!({
            "model": NAME, "max_tokens": 200, "temperature": 1.0,
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"name": "get_weather", "input_schema": parameters}],
            "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"},
        });
        let (status, v) = s.post("/v1/messages", &body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["stop_reason"], "tool_use", "{v}");
        let block = v["content"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["type"] == "tool_use")
            .unwrap();
        assert!(jsonschema::is_valid(&parameters, &block["input"]), "{v}");
    }
    // The Responses API's text.format.
    let s = start(4, 0, None).await;
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": false});
    let (status, v) = s
        .post(
            "/v1/responses",
            &json!({"input": "x", "max_output_tokens": 100, "temperature": 1.0,
                    "text": {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": true}}}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let text = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["type"] == "message")
        .unwrap()["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let instance: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert!(jsonschema::is_valid(&schema, &instance), "{text}");
    assert_eq!(v["text"]["format"]["type"], "json_schema");
}
