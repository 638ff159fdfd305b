//! `bench --plot` and `cachesim --plot`: the charts are written, parse as SVG (XML with an
//! `svg` root), and hold each series: its legend, and a line per series whose points are
//! as many as the rows measured.

use std::path::Path;
use std::process::Command;

use crate::common::fixture_dir;

fn slotstream() -> Command {
    Command::new(env!("CARGO_BIN_EXE_slotstream"))
}

fn run(command: &mut Command) -> String {
    let out = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The chart at `path` parsed: its root element's name, its text, and the number of
/// points of each `polyline` (plotters draws a line series as one).
fn parse_svg(path: &Path) -> (String, String, Vec<usize>) {
    use xml::reader::{EventReader, XmlEvent};
    let file = std::fs::File::open(path).unwrap();
    let (mut root, mut text, mut lines) = (None, String::new(), Vec::new());
    for event in EventReader::new(std::io::BufReader::new(file)) {
        match event.unwrap_or_else(|e| panic!("{} is not XML: {e}", path.display())) {
            XmlEvent::StartElement {
                name, attributes, ..
            } => {
                root.get_or_insert(name.local_name.clone());
                if name.local_name == "polyline" {
                    let points = attributes
                        .iter()
                        .find(|a| a.name.local_name == "points")
                        .map_or(0, |a| a.value.split_whitespace().count());
                    lines.push(points);
                }
            }
            XmlEvent::Characters(t) => {
                text += t.trim();
                text.push('\n');
            }
            _ => {}
        }
    }
    (root.unwrap(), text, lines)
}

#[test]
fn bench_and_cachesim_charts_are_svg_with_every_series() {
    let dir = tempfile::tempdir().unwrap();
    let chart = dir.path().join("bench.svg");
    let model = fixture_dir("qwen3-next-bf16");
    run(slotstream()
        .args(["bench", "--model"])
        .arg(&model)
        .args([
            "--device",
            "cpu",
            "--budgets",
            "floor,50%,all",
            "--lookahead",
            "on,off",
        ])
        .args([
            "--tokens",
            "6",
            "--warmup",
            "2",
            "--prompt-len",
            "4",
            "--plot",
        ])
        .arg(&chart));
    let (root, text, lines) = parse_svg(&chart);
    assert_eq!(root, "svg");
    for series in [
        "decode tok/s, lookahead on",
        "decode tok/s, lookahead off",
        "hit rate, lookahead on",
        "hit rate, lookahead off",
        "limit tok/s",
        "pool memory (MiB)",
    ] {
        assert!(text.contains(series), "{series} missing from:\n{text}");
    }
    // Decode, limit and hit rate for each lookahead setting, one point per budget.
    assert!(lines.iter().filter(|&&n| n == 3).count() >= 4, "{lines:?}");

    // cachesim over a trace of the demo's routing model, at four pool sizes.
    let trace = dir.path().join("t.csv");
    run(slotstream()
        .args([
            "routing-calibration",
            "--preset",
            "demo",
            "--steps",
            "30",
            "--trace",
        ])
        .arg(&trace));
    let chart = dir.path().join("cachesim.svg");
    let table = run(slotstream()
        .args(["cachesim", "--trace"])
        .arg(&trace)
        .args(["--slots", "16,32,64,128", "--plot"])
        .arg(&chart));
    let (root, text, lines) = parse_svg(&chart);
    assert_eq!(root, "svg");
    for policy in ["CLOCK", "LRU", "Belady"] {
        assert!(table.contains(policy) && text.contains(policy), "{policy}");
    }
    // (The mesh and the legend's marks are lines of two points.)
    let series: Vec<usize> = lines.into_iter().filter(|&n| n > 2).collect();
    assert_eq!(series, vec![4, 4, 4], "a line of four points per policy");

    // A PNG is refused with the reason, and nothing is written.
    let png = dir.path().join("cachesim.png");
    let out = slotstream()
        .args(["cachesim", "--trace"])
        .arg(&trace)
        .args(["--slots", "16", "--plot"])
        .arg(&png)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("SVG only"));
    assert!(!png.exists());
}
