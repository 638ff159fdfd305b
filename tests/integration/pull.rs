//! `slotstream pull` against a stand-in hub on 127.0.0.1 that answers as the Hugging Face
//! hub does: a paginated tree listing with LFS sha256s, resolve URLs that redirect (302) to
//! a CDN path, byte ranges, a connection dropped mid-file on the first attempt, a file
//! whose listed hash is wrong. Then `--model ORG/NAME` finds the download.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use rand::RngCore;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use slotstream::tools::pull::{Hub, PullError};

use crate::common::*;

const TOKEN: &str = "hf_test_token";

#[derive(Default)]
struct Hub0 {
    /// Path in the repository -> content.
    files: BTreeMap<String, Vec<u8>>,
    /// Files listed with a wrong sha256.
    wrong_hash: Vec<String>,
    /// Files whose first download stops after half their bytes.
    drop_once: Vec<String>,
    /// (path, Range header) of every CDN request, in order.
    log: Mutex<Vec<(String, Option<String>)>>,
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The tree listing, two files a page (the second page through a `Link` header, as the
/// hub paginates); only with the bearer token.
async fn tree(State(hub): State<Arc<Hub0>>, headers: HeaderMap, uri: Uri) -> Response {
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if auth != Some(format!("Bearer {TOKEN}").as_str()) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let page: usize = uri
        .query()
        .and_then(|q| q.split('&').find_map(|p| p.strip_prefix("cursor=")))
        .map_or(0, |c| c.parse().unwrap());
    let entries: Vec<Value> = hub
        .files
        .iter()
        .map(|(path, bytes)| {
            let mut sha = sha256(bytes);
            if hub.wrong_hash.contains(path) {
                sha = sha256(b"something else");
            }
            // JSON files are plain git blobs on the hub, the rest LFS.
            let lfs = (!path.ends_with(".json"))
                .then(|| json!({ "oid": sha, "size": bytes.len(), "pointerSize": 134 }));
            json!({ "type": "file", "oid": "0".repeat(40), "size": bytes.len(), "path": path, "lfs": lfs })
        })
        .chain([json!({ "type": "directory", "oid": "1".repeat(40), "size": 0, "path": "sub" })])
        .collect();
    let chunk: Vec<Value> = entries.chunks(2).nth(page).unwrap_or(&[]).to_vec();
    let mut response = axum::Json(chunk).into_response();
    if (page + 1) * 2 < entries.len() {
        let next = format!(
            "<{}?recursive=true&cursor={}>; rel=\"next\"",
            uri.path(),
            page + 1
        );
        response
            .headers_mut()
            .insert(header::LINK, next.parse().unwrap());
    }
    response
}

async fn resolve(
    UrlPath((_org, _name, _rev, path)): UrlPath<(String, String, String, String)>,
) -> Response {
    (
        StatusCode::FOUND,
        [(header::LOCATION, format!("/cdn/{path}"))],
    )
        .into_response()
}

/// The CDN: ranges as `bytes=N-`, and a dropped connection the first time for `drop_once`.
async fn cdn(
    State(hub): State<Arc<Hub0>>,
    UrlPath(path): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    let Some(bytes) = hub.files.get(&path) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let range = headers
        .get(header::RANGE)
        .map(|v| v.to_str().unwrap().to_string());
    let first = {
        let mut log = hub.log.lock().unwrap();
        log.push((path.clone(), range.clone()));
        log.iter().filter(|(p, _)| *p == path).count() == 1
    };
    let start: usize = range.as_deref().map_or(0, |r| {
        r.strip_prefix("bytes=")
            .unwrap()
            .trim_end_matches('-')
            .parse()
            .unwrap()
    });
    let body = bytes[start..].to_vec();
    let len = body.len();
    let status = if range.is_some() {
        StatusCode::PARTIAL_CONTENT
    } else {
        StatusCode::OK
    };
    let stream_body = if first && hub.drop_once.contains(&path) {
        // Half the bytes, then an error: the server closes the connection short of the
        // Content-Length.
        let half = Bytes::from(body[..len / 2].to_vec());
        Body::from_stream(futures::stream::iter([
            Ok(half),
            Err(std::io::Error::other("dropped")),
        ]))
    } else {
        Body::from(body)
    };
    Response::builder()
        .status(status)
        .header(header::CONTENT_LENGTH, len)
        .body(stream_body)
        .unwrap()
}

/// Starts the stand-in hub on `rt`; its endpoint.
fn start(rt: &tokio::runtime::Runtime, hub: Arc<Hub0>) -> String {
    let app = Router::new()
        .route("/api/models/{org}/{name}/tree/{rev}", get(tree))
        .route("/{org}/{name}/resolve/{rev}/{*path}", get(resolve))
        .route("/cdn/{*path}", get(cdn))
        .with_state(hub);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(async move { axum::serve(listener, app).await.unwrap() });
    endpoint
}

fn random_bytes(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rng().fill_bytes(&mut v);
    v
}

/// Every file of `dir` (relative path -> bytes).
fn read_tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_str().unwrap().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// A fixture served as `test-org/tiny-model`: `pull` downloads it byte for byte, resuming
/// the shard whose connection dropped with a Range request from where it stopped, leaves no
/// part files, skips everything when run again; `generate --model test-org/tiny-model`
/// then reads it and gives mlx-lm's greedy ids.
#[test]
fn pull_resumes_a_dropped_file_and_model_finds_it_by_id() {
    let name = FIXTURES[0];
    let fixture = fixture_dir(name);
    let mut files = read_tree(&fixture);
    // A nested path, as some repositories have.
    files.insert("sub/extra.bin".into(), random_bytes(10_000));
    let hub = Arc::new(Hub0 {
        files: files.clone(),
        drop_once: vec!["model.safetensors".into()],
        ..Default::default()
    });
    let rt = runtime();
    let endpoint = start(&rt, hub.clone());
    let cache = tempfile::tempdir().unwrap();
    let slotstream = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_slotstream"));
        c.env("HF_ENDPOINT", &endpoint)
            .env("HF_TOKEN", TOKEN)
            .env("XDG_CACHE_HOME", cache.path());
        c
    };
    let out = slotstream()
        .args(["pull", "test-org/tiny-model"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let dir = cache.path().join("slotstream/models/test-org--tiny-model");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        dir.to_str().unwrap()
    );
    assert_eq!(
        read_tree(&dir),
        files,
        "the downloaded bytes are the served ones"
    );
    let shard = files["model.safetensors"].len();
    let shard_requests: Vec<Option<String>> = hub
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, _)| p == "model.safetensors")
        .map(|(_, r)| r.clone())
        .collect();
    assert_eq!(
        shard_requests,
        [None, Some(format!("bytes={}-", shard / 2))],
        "the second request resumes from the half the first delivered"
    );

    // Again: nothing to download.
    let requests = hub.log.lock().unwrap().len();
    let out = slotstream()
        .args(["pull", "test-org/tiny-model"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{} files ({} already complete), 0 bytes",
            files.len(),
            files.len()
        )),
        "{stderr}"
    );
    assert_eq!(hub.log.lock().unwrap().len(), requests);

    let r = reference(name);
    let prompt: Vec<String> = r.prompt_ids.iter().map(|i| i.to_string()).collect();
    let out = slotstream()
        .args([
            "generate",
            "--model",
            "test-org/tiny-model",
            "--prompt-ids",
            &prompt.join(","),
            "--max-tokens",
            "3",
            "--json",
            "--device",
            "cpu",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
    assert_eq!(ids[..], r.greedy_ids[..ids.len()]);
    assert!(!ids.is_empty());
}

/// A file whose bytes do not match the listed sha256 fails the pull with an error naming
/// it, and leaves neither it nor its part file; the other files arrive whole: one already
/// complete is skipped, one with a part from an earlier run resumes from the part's length.
#[test]
fn a_wrong_hash_fails_naming_the_file_and_leaves_nothing() {
    let files: BTreeMap<String, Vec<u8>> = [
        ("config.json".to_string(), b"{}".to_vec()),
        (
            "model-00001-of-00002.safetensors".to_string(),
            random_bytes(50_000),
        ),
        (
            "model-00002-of-00002.safetensors".to_string(),
            random_bytes(70_000),
        ),
    ]
    .into();
    let hub = Arc::new(Hub0 {
        files: files.clone(),
        wrong_hash: vec!["model-00002-of-00002.safetensors".into()],
        ..Default::default()
    });
    let rt = runtime();
    let endpoint = start(&rt, hub.clone());
    let dir = tempfile::tempdir().unwrap();
    // What an earlier, interrupted run left: config.json complete, a part of the first shard.
    let first = "model-00001-of-00002.safetensors";
    std::fs::write(dir.path().join("config.json"), &files["config.json"]).unwrap();
    let left = 1 + rand::random::<u64>() as usize % (files[first].len() - 1);
    std::fs::write(
        dir.path().join(format!("{first}.part")),
        &files[first][..left],
    )
    .unwrap();
    let client = Hub::new(&endpoint, Some(TOKEN.into())).unwrap();
    let bar = indicatif::ProgressBar::hidden();
    let err = rt
        .block_on(async {
            let listed = client.list("test-org/m", "main").await?;
            assert_eq!(listed.len(), 3);
            client
                .pull("test-org/m", "main", &listed, dir.path(), 1, &bar)
                .await
        })
        .unwrap_err();
    match &err {
        PullError::Checksum { file, .. } => assert_eq!(file, "model-00002-of-00002.safetensors"),
        other => panic!("expected a checksum error, got {other}"),
    }
    assert!(
        err.to_string().contains("model-00002-of-00002.safetensors"),
        "{err}"
    );
    assert!(!dir.path().join("model-00002-of-00002.safetensors").exists());
    assert!(!dir
        .path()
        .join("model-00002-of-00002.safetensors.part")
        .exists());
    // One file at a time, in the listing's order: the ones before the bad one are in place,
    // config.json left as it was (not requested), the shard resumed from its part's length.
    for good in ["config.json", first] {
        assert_eq!(std::fs::read(dir.path().join(good)).unwrap(), files[good]);
    }
    let requests: Vec<(String, Option<String>)> = hub.log.lock().unwrap().clone();
    assert_eq!(
        requests[..2],
        [
            (first.to_string(), Some(format!("bytes={left}-"))),
            ("model-00002-of-00002.safetensors".to_string(), None),
        ],
        "{requests:?}"
    );

    // Without the token the hub refuses, and the error says what to set.
    let anonymous = Hub::new(&endpoint, None).unwrap();
    let err = rt
        .block_on(anonymous.list("test-org/m", "main"))
        .unwrap_err();
    assert!(err.to_string().contains("HF_TOKEN"), "{err}");
}
