//! Charts of the benchmarks as SVG files (`plotters`' SVG backend): `slotstream bench
//! --plot` ([`bench`]: decode tok/s and hit rate against the pool's memory, with the
//! disk's or memory's limit), `slotstream cachesim --plot` and the I/O sweep's chart
//! (`cargo bench --bench io_sweep`), both through [`lines`].
//!
//! SVG only: plotters' bitmap backend needs a font to draw text (fontconfig and freetype
//! through its `ttf` feature, or a font file compiled in), which the SVG backend leaves to
//! the viewer. A `.png` path is refused with that reason (convert the SVG, for example
//! with `rsvg-convert`).

use std::io::Write;
use std::path::Path;

use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::bench::BenchReport;
use crate::atomic_file::AtomicFile;
use crate::error::{Error, Result};

/// Chart size in pixels (the SVG's width and height).
const SIZE: (u32, u32) = (900, 540);

/// Colours of the series, in order (Tableau's ten, readable on white).
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// One line of a chart: its legend and its points (x, y).
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed (a limit or a reference beside the measured lines).
    pub dashed: bool,
}

/// A chart's axes: its title and the axes' descriptions.
#[derive(Clone, Copy, Debug)]
pub struct Axes<'a> {
    pub title: &'a str,
    pub x: &'a str,
    pub y: &'a str,
    /// The x axis in powers of two (queue depths, slots).
    pub log2_x: bool,
}

/// Writes `series` as a line chart to `path` (an `.svg`), whole or not at all.
/// Errors: a path that does not end in `.svg` (a `.png` says why it is not built), no
/// point at all, a non-finite point, the file not written.
pub fn lines(path: &Path, axes: Axes, series: &[Series]) -> Result<()> {
    check_svg_path(path)?;
    let points = || series.iter().flat_map(|s| s.points.iter().copied());
    let (x, y) = ranges(points(), axes.log2_x)?;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(axes.title, ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64);
        // The two scales are two coordinate types: one generic body draws either.
        fn fill<'a, X: Ranged<ValueType = f64> + ValueFormatter<f64>>(
            mut chart: ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, RangedCoordf64>>,
            axes: &Axes,
            series: &[Series],
        ) -> Result<()> {
            chart
                .configure_mesh()
                .x_desc(axes.x)
                .y_desc(axes.y)
                .draw()
                .map_err(draw_error)?;
            draw_lines(&mut chart, series)?;
            legend(&mut chart)
        }
        if axes.log2_x {
            let x = (x.0..x.1).log_scale().base(2.0);
            fill(
                builder
                    .build_cartesian_2d(x, y.0..y.1)
                    .map_err(draw_error)?,
                &axes,
                series,
            )?;
        } else {
            fill(
                builder
                    .build_cartesian_2d(x.0..x.1, y.0..y.1)
                    .map_err(draw_error)?,
                &axes,
                series,
            )?;
        }
        root.present().map_err(draw_error)?;
    }
    write(path, &svg)
}

/// `slotstream bench`'s chart: decode tok/s (left axis) and hit rate (right axis, dotted
/// markers) against the pool's memory in GiB, one line each per lookahead setting, and
/// each row's limit (reads at the raw disk rate, or with every record resident the copy
/// bandwidth) as a dashed line. Errors: as [`lines`]; a report without rows.
pub fn bench(path: &Path, report: &BenchReport) -> Result<()> {
    check_svg_path(path)?;
    // GiB, or MiB for a small model's pools.
    let largest = report.rows.iter().map(|r| r.pool_bytes).max().unwrap_or(0);
    let (unit, unit_name) = if largest >= 1 << 30 {
        ((1u64 << 30) as f64, "GiB")
    } else {
        ((1u64 << 20) as f64, "MiB")
    };
    let gib = |b: u64| b as f64 / unit;
    let mut speed = Vec::new();
    let mut hits = Vec::new();
    for lookahead in [true, false] {
        let rows: Vec<_> = report
            .rows
            .iter()
            .filter(|r| r.lookahead == lookahead)
            .collect();
        if rows.is_empty() {
            continue;
        }
        let on = if lookahead { "on" } else { "off" };
        let point = |f: fn(&super::bench::BenchRow) -> f64| {
            let mut p: Vec<(f64, f64)> = rows.iter().map(|r| (gib(r.pool_bytes), f(r))).collect();
            p.sort_by(|a, b| a.0.total_cmp(&b.0));
            p
        };
        speed.push(Series {
            name: format!("decode tok/s, lookahead {on}"),
            points: point(|r| r.decode_tps),
            dashed: false,
        });
        let mut limit = Vec::new();
        for r in &rows {
            if let Some(tps) = r.limit_tps {
                limit.push((gib(r.pool_bytes), tps));
            }
        }
        limit.sort_by(|a, b| a.0.total_cmp(&b.0));
        if !limit.is_empty() {
            speed.push(Series {
                name: format!(
                    "limit tok/s (reads at the disk's rate; all resident: memory), lookahead {on}"
                ),
                points: limit,
                dashed: true,
            });
        }
        hits.push(Series {
            name: format!("hit rate, lookahead {on}"),
            points: point(|r| r.hit_rate),
            dashed: false,
        });
    }
    let (x, _) = ranges(speed.iter().flat_map(|s| s.points.iter().copied()), false)?;
    // Tokens per second on a log scale: the limits are often ten times the measured rates.
    let positive = speed
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .filter(|&v| v > 0.0);
    let (lo, hi) = positive.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !(lo.is_finite() && hi > 0.0) {
        return Err(Error::InvalidInput(
            "a bench chart with no positive rate".into(),
        ));
    }
    for s in &mut speed {
        s.points.retain(|p| p.1 > 0.0);
    }
    let title = format!(
        "{} on {}: decode against the pool's memory (raw reads {:.2} GB/s)",
        report.model,
        report.backend,
        report.raw_read_bytes_per_second / 1e9
    );
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&title, ("sans-serif", 18))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .right_y_label_area_size(64)
            .build_cartesian_2d(x.0..x.1, (lo / 1.5..hi * 1.5).log_scale())
            .map_err(draw_error)?
            .set_secondary_coord(x.0..x.1, 0.0..1.05);
        let x_desc = format!("pool memory ({unit_name})");
        chart
            .configure_mesh()
            .x_desc(&x_desc)
            .y_desc("tokens per second (log scale)")
            .draw()
            .map_err(draw_error)?;
        chart
            .configure_secondary_axes()
            .y_desc("hit rate")
            .draw()
            .map_err(draw_error)?;
        draw_lines(&mut chart, &speed)?;
        for (i, s) in hits.iter().enumerate() {
            let color = PALETTE[(speed.len() + i) % PALETTE.len()];
            chart
                .draw_secondary_series(LineSeries::new(s.points.clone(), color.stroke_width(2)))
                .map_err(draw_error)?
                .label(&s.name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            chart
                .draw_secondary_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(draw_error)?;
        }
        legend(&mut chart)?;
        root.present().map_err(draw_error)?;
    }
    write(path, &svg)
}

/// Draws `series` on `chart` (dashed ones as dashes), with their legends.
fn draw_lines<'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    series: &[Series],
) -> Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    for (i, s) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let style = color.stroke_width(2);
        let drawn = if s.dashed {
            chart.draw_series(DashedLineSeries::new(s.points.clone(), 8, 5, style))
        } else {
            chart.draw_series(LineSeries::new(s.points.clone(), style))
        };
        drawn
            .map_err(draw_error)?
            .label(&s.name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(draw_error)?;
    }
    Ok(())
}

/// Draws the legend of every series drawn on `chart`.
fn legend<'a, X, Y>(chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>) -> Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(draw_error)
}

/// The x and y ranges of `points` with a margin; y from 0. Errors: no point, or one that
/// is not finite (or not positive on a log2 axis).
fn ranges(
    points: impl Iterator<Item = (f64, f64)>,
    log2_x: bool,
) -> Result<((f64, f64), (f64, f64))> {
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
    let mut any = false;
    for (x, y) in points {
        if !x.is_finite() || !y.is_finite() || (log2_x && x <= 0.0) {
            return Err(Error::InvalidInput(format!(
                "a chart's point ({x}, {y}) cannot be drawn"
            )));
        }
        any = true;
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if !any {
        return Err(Error::InvalidInput("a chart with no point".into()));
    }
    let x = if log2_x {
        (x0 / 1.25, x1 * 1.25)
    } else if x1 > x0 {
        let pad = (x1 - x0) * 0.05;
        ((x0 - pad).max(0.0), x1 + pad)
    } else {
        (0.0, if x1 > 0.0 { 2.0 * x1 } else { 1.0 })
    };
    Ok((x, (0.0, if y1 > 0.0 { y1 * 1.1 } else { 1.0 })))
}

/// Refuses a path that is not an SVG file's.
fn check_svg_path(path: &Path) -> Result<()> {
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match extension.as_deref() {
        Some("svg") => Ok(()),
        Some("png") => Err(Error::InvalidInput(format!(
            "{}: charts are written as SVG only (a PNG needs a font, fontconfig and freetype, to draw text); give a .svg path and convert it (rsvg-convert -o out.png in.svg)",
            path.display()
        ))),
        _ => Err(Error::InvalidInput(format!(
            "{}: a chart's path ends in .svg",
            path.display()
        ))),
    }
}

fn draw_error<E: std::fmt::Debug>(e: E) -> Error {
    Error::Internal(format!("drawing a chart: {e:?}"))
}

/// Writes `svg` to `path`, whole or not at all.
fn write(path: &Path, svg: &str) -> Result<()> {
    let file = AtomicFile::create(path)?;
    let mut out = file.file();
    out.write_all(svg.as_bytes())
        .map_err(|e| Error::io(path, e))?;
    file.commit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_written_with_their_legends_and_a_png_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.svg");
        let series = [
            Series {
                name: "CLOCK".into(),
                points: vec![(64.0, 0.2), (128.0, 0.4), (256.0, 0.7)],
                dashed: false,
            },
            Series {
                name: "Belady".into(),
                points: vec![(64.0, 0.5), (128.0, 0.7), (256.0, 0.9)],
                dashed: true,
            },
        ];
        let axes = Axes {
            title: "hit rate against slots",
            x: "slots",
            y: "hit rate",
            log2_x: true,
        };
        lines(&path, axes, &series).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        for name in ["CLOCK", "Belady", "hit rate against slots", "slots"] {
            assert!(svg.contains(name), "{name}");
        }
        let png = dir.path().join("c.png");
        let e = lines(&png, axes, &series).unwrap_err().to_string();
        assert!(e.contains("SVG only"), "{e}");
        assert!(!png.exists());
        let nan = [Series {
            points: vec![(1.0, f64::NAN)],
            ..series[0].clone()
        }];
        assert!(lines(&path, axes, &nan).is_err());
        assert!(lines(&path, axes, &[]).is_err());
    }
}
