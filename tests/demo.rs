//! The built-in demo runs end to end (the README's first command): it writes the
//! synthetic model, streams its experts through a pool that holds a third of them, and
//! its statistics show both misses and hits.

#[test]
fn demo_runs_and_streams_through_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slotstream"))
        .args(["demo", "--max-tokens", "6", "--device", "cpu", "--dir"])
        .arg(dir.path().join("demo"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let start = err.find('{').expect("pool statistics JSON on stderr");
    let end = err.rfind('}').unwrap();
    let stats: serde_json::Value = serde_json::from_str(&err[start..=end]).unwrap();
    assert!(stats["misses"].as_u64().unwrap() > 0, "{stats}");
    assert!(stats["hits"].as_u64().unwrap() > 0, "{stats}");
    assert!(err.contains("decode"), "{err}");
}
