//! `--svg`: bandwidth and latency against the message size, drawn with plotters' SVG
//! backend into one self-contained file (no font files, images or scripts), so a run's
//! numbers can be looked at and put next to reference runs (`--compare`, e.g. perftest's
//! numbers in perf-vm.sh).
//!
//! Layout: the title and notes, then a bandwidth panel (linear GB/s) above a latency panel
//! (log us), both against the size on a log2 axis. This run's series is solid with filled
//! points and drawn last (on top); each reference series is dashed with hollow points. Each
//! panel's title line also states this run's headline number: the peak bandwidth, and the
//! latency of the smallest size.

use std::path::{Path, PathBuf};

use plotters::{
    coord::{combinators::WithKeyPoints, ranged1d::ValueFormatter, types::RangedCoordf64, Shift},
    element::ComposedElement,
    prelude::*,
    style::text_anchor::{HPos, Pos, VPos},
};

use crate::{
    report::{human, read_csv, Report, Row},
    Res,
};

/// One named line of the plot.
pub struct Series<'a> {
    pub label: &'a str,
    pub rows: Vec<Row>,
}

/// Series colours (the first is this run).
const COLORS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x6f, 0xb4),
    RGBColor(0xe8, 0x71, 0x0a),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x8c, 0x56, 0x4b),
];
const FONT: &str = "DejaVu Sans, Helvetica, Arial, sans-serif";
const WIDTH: u32 = 960;
/// Left of the plot frames (the y tick labels and the axis title go in it).
const MARGIN_L: i32 = 86;
const MARGIN_R: i32 = 30;
/// One panel: its title line, the frame and the x tick labels.
const PANEL_H: u32 = 360;
/// Space the panel's title line takes above its frame.
const PANEL_TITLE_H: u32 = 40;
/// Tick labels closer than this (pixels) would overlap.
const MIN_LABEL_GAP: f64 = 50.0;
/// Notes longer than this are cut (the plot does not wrap text).
const MAX_NOTE: usize = 140;

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
/// A point marker: two circles around one position.
type Marker<C, DB> = ComposedElement<C, DB, Circle<(i32, i32), i32>, Circle<(i32, i32), i32>>;
type Drawn = Result<(), DrawingAreaErrorKind<std::io::Error>>;

/// Which value of a row a panel shows.
#[derive(Clone, Copy)]
enum Metric {
    Bandwidth,
    Latency,
}

impl Metric {
    /// The value to plot; a latency of 0 has no place on a log axis.
    fn of(self, r: &Row) -> Option<f64> {
        match self {
            Metric::Bandwidth => r.gbps,
            Metric::Latency => r.lat_us.filter(|v| *v > 0.0),
        }
    }

    fn title(self) -> &'static str {
        match self {
            Metric::Bandwidth => "Bandwidth (higher is better)",
            Metric::Latency => "Latency (lower is better; log scale)",
        }
    }

    fn axis_title(self) -> &'static str {
        match self {
            Metric::Bandwidth => "bandwidth (GB/s)",
            Metric::Latency => "latency (round trip / 2)",
        }
    }

    /// A y tick label.
    fn tick(self, v: f64) -> String {
        match self {
            Metric::Bandwidth => short_num(v),
            Metric::Latency => time_label(v),
        }
    }

    /// This run's headline point and its words: the peak bandwidth, or the latency of the
    /// smallest size.
    fn callout(self, rows: &[Row]) -> Option<(Row, String)> {
        let plotted = rows.iter().filter(|r| r.size > 0 && self.of(r).is_some());
        let (r, v) = match self {
            Metric::Bandwidth => plotted
                .max_by(|a, b| a.gbps.unwrap_or(0.0).total_cmp(&b.gbps.unwrap_or(0.0)))
                .map(|r| (r, r.gbps)),
            Metric::Latency => plotted.min_by_key(|r| r.size).map(|r| (r, r.lat_us)),
        }?;
        let v = sig3(v.unwrap_or(0.0));
        let text = match self {
            Metric::Bandwidth => format!("peak {v} GB/s at {}", human(r.size)),
            Metric::Latency => format!("{v} us at {}", human(r.size)),
        };
        Some((*r, text))
    }
}

/// `v` with as few decimals as needed (at most 6), no trailing zeros.
fn short_num(v: f64) -> String {
    let s = format!("{v:.6}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".into()
    } else {
        s.into()
    }
}

/// A latency tick in microseconds, in us, ms or s.
fn time_label(us: f64) -> String {
    if us >= 1e6 {
        format!("{} s", short_num(us / 1e6))
    } else if us >= 1e3 {
        format!("{} ms", short_num(us / 1e3))
    } else {
        format!("{} us", short_num(us))
    }
}

/// Three significant digits.
fn sig3(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return "0".into();
    }
    let decimals = (2 - v.abs().log10().floor() as i32).clamp(0, 6) as usize;
    format!("{v:.decimals$}")
}

/// Every size of every series, sorted, once.
fn all_sizes(series: &[Series]) -> Vec<usize> {
    let mut v: Vec<usize> = series
        .iter()
        .flat_map(|s| s.rows.iter().map(|r| r.size))
        .filter(|s| *s > 0)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The x axis: whole powers of two around the sizes (at least two), with a margin of 0.3
/// of a power on each side so no point sits on the frame.
fn x_powers(sizes: &[usize]) -> (f64, f64) {
    let logs = sizes.iter().map(|s| (*s as f64).log2());
    let (lo, hi) = logs.fold((f64::MAX, f64::MIN), |(a, b), l| (a.min(l), b.max(l)));
    if lo > hi {
        return (3.0, 26.0);
    }
    let (lo, hi) = (lo.floor(), hi.ceil());
    if hi - lo < 2.0 {
        (lo - 1.0, hi + 1.0)
    } else {
        (lo, hi)
    }
}

/// The labelled x ticks: the measured sizes when there are few, thinned from the largest
/// down so that no two labels overlap (the largest size is the one most looked at); else
/// every k-th power of two from the smallest, k as small as leaves room.
fn x_labels(sizes: &[usize], lo: f64, hi: f64) -> Vec<f64> {
    let plot_width = f64::from(WIDTH) - f64::from(MARGIN_L + MARGIN_R);
    // The least distance between two labels, in powers of two.
    let min_gap = MIN_LABEL_GAP * (hi - lo + 0.6) / plot_width;
    if sizes.is_empty() || sizes.len() > 16 {
        let step = min_gap.ceil().max(1.0) as usize;
        return (lo as i32..=hi as i32)
            .step_by(step)
            .map(|p| 2f64.powi(p))
            .collect();
    }
    let mut kept: Vec<f64> = Vec::new();
    for v in sizes.iter().rev().map(|s| *s as f64) {
        if kept.last().is_none_or(|k| k.log2() - v.log2() >= min_gap) {
            kept.push(v);
        }
    }
    kept.reverse();
    kept
}

fn x_coord(sizes: &[usize]) -> WithKeyPoints<LogCoord<f64>> {
    let (lo, hi) = x_powers(sizes);
    (2f64.powf(lo - 0.3)..2f64.powf(hi + 0.3))
        .log_scale()
        .with_key_points(x_labels(sizes, lo, hi))
        .with_light_points((lo as i32..=hi as i32).map(|p| 2f64.powi(p)))
}

/// Linear from 0 to a little above the largest value; plotters picks round ticks.
fn bandwidth_coord(values: &[f64]) -> RangedCoordf64 {
    let max = values.iter().copied().fold(0.0, f64::max);
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    (0.0..max * 1.08).into()
}

/// Whole decades around the values; labels at each decade, and at 2x and 5x when there
/// are at most two decades (else the axis has too few labels to read).
fn latency_coord(values: &[f64]) -> WithKeyPoints<LogCoord<f64>> {
    let min = values.iter().copied().fold(f64::MAX, f64::min);
    let max = values.iter().copied().fold(0.0, f64::max);
    let (min, max) = if min > 0.0 && max >= min && max.is_finite() {
        (min, max)
    } else {
        (1.0, 10.0)
    };
    let lo = min.log10().floor() as i32;
    let hi = (max.log10().ceil() as i32).max(lo + 1);
    let (mut bold, mut light) = (Vec::new(), Vec::new());
    for d in lo..=hi {
        let p = 10f64.powi(d);
        bold.push(p);
        for m in (2..10).filter(|_| d < hi) {
            let labelled = hi - lo <= 2 && (m == 2 || m == 5);
            if labelled { &mut bold } else { &mut light }.push(f64::from(m) * p);
        }
    }
    (10f64.powi(lo)..10f64.powi(hi))
        .log_scale()
        .with_key_points(bold)
        .with_light_points(light)
}

/// A point: filled for this run; for a reference series a white disc in a coloured ring,
/// so it hides the dashed line under it.
fn marker<C, DB: DrawingBackend>(
    at: C,
    radius: i32,
    color: RGBColor,
    this_run: bool,
) -> Marker<C, DB> {
    let inner = if this_run {
        color.filled()
    } else {
        WHITE.filled()
    };
    EmptyElement::at(at)
        + Circle::new((0, 0), radius, inner)
        + Circle::new((0, 0), radius, color.stroke_width(2))
}

fn font(size: f64) -> TextStyle<'static> {
    styled(size, FontStyle::Normal, RGBColor(0x33, 0x33, 0x33))
}

/// Text of `size` pixels. plotters' SVG backend writes a font size of size / 1.24 (its
/// em-box heuristic), so the size asked for is scaled up by as much.
fn styled(size: f64, style: FontStyle, color: RGBColor) -> TextStyle<'static> {
    (FONT, size * 1.24).into_font().style(style).color(&color)
}

/// One panel: its title line, frame, grid, ticks, the series, the call-out and the legend.
fn panel<Y>(
    area: &Area,
    series: &[Series],
    metric: Metric,
    x: WithKeyPoints<LogCoord<f64>>,
    y: Y,
) -> Drawn
where
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let head = styled(15.0, FontStyle::Bold, RGBColor(0x22, 0x22, 0x22));
    area.draw(&Text::new(metric.title(), (MARGIN_L, 16), head))?;
    let callout = series
        .first()
        .and_then(|s| Some((s.label, metric.callout(&s.rows)?)));
    if let Some((label, (_, text))) = &callout {
        let style = styled(13.0, FontStyle::Bold, COLORS[0]).pos(Pos::new(HPos::Right, VPos::Top));
        let at = (WIDTH as i32 - MARGIN_R, 18);
        area.draw(&Text::new(format!("{label}: {text}"), at, style))?;
    }
    let mut chart = ChartBuilder::on(area)
        .margin_top(PANEL_TITLE_H)
        .margin_right(MARGIN_R)
        .margin_left(6)
        .x_label_area_size(50)
        .y_label_area_size(MARGIN_L - 6)
        .build_cartesian_2d(x, y)?;
    let size_label = |v: &f64| human(v.round() as usize);
    let y_label = |v: &f64| metric.tick(*v);
    chart
        .configure_mesh()
        .x_label_formatter(&size_label)
        .y_label_formatter(&y_label)
        .y_labels(6)
        .y_max_light_lines(0)
        .x_desc("message size (bytes, log2 scale)")
        .y_desc(metric.axis_title())
        .label_style(font(12.0))
        .axis_desc_style(font(13.0))
        .bold_line_style(RGBColor(0xdd, 0xdd, 0xdd))
        .light_line_style(RGBColor(0xf0, 0xf0, 0xf0))
        .axis_style(RGBColor(0x88, 0x88, 0x88))
        .draw()?;
    // The legend lists the series in their order: entries without points, registered
    // before any line is drawn (plotters lists them in drawing order).
    for (i, s) in series.iter().enumerate() {
        let (color, this_run) = (COLORS[i % COLORS.len()], i == 0);
        let line = color.stroke_width(2);
        // Dashes for a reference series, as its line.
        let gap = if this_run { 0 } else { 3 };
        let seg = move |a: i32, b: i32| PathElement::new(vec![(a, 0), (b, 0)], line);
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
            .label(s.label)
            .legend(move |at| {
                EmptyElement::at(at)
                    + seg(0, 9 - gap)
                    + seg(9, 18 - gap)
                    + seg(18, 24)
                    + marker((12, 0), 3, color, this_run)
            });
    }
    // Reference series first, this run on top.
    for (i, s) in series.iter().enumerate().rev() {
        let (color, this_run) = (COLORS[i % COLORS.len()], i == 0);
        let points: Vec<(f64, f64)> = s
            .rows
            .iter()
            .filter(|r| r.size > 0)
            .filter_map(|r| metric.of(r).map(|v| (r.size as f64, v)))
            .collect();
        let line = color.stroke_width(if this_run { 3 } else { 2 });
        if this_run {
            chart.draw_series(LineSeries::new(points.iter().copied(), line))?;
        } else {
            chart.draw_series(DashedLineSeries::new(points.iter().copied(), 7, 4, line))?;
        }
        chart.draw_series(points.iter().map(|p| marker(*p, 4, color, this_run)))?;
    }
    if let Some((_, (r, _))) = &callout {
        if let Some(v) = metric.of(r) {
            let ring = COLORS[0].mix(0.7).stroke_width(1);
            chart.draw_series(std::iter::once(Circle::new((r.size as f64, v), 8, ring)))?;
        }
    }
    // Top left: small sizes have low bandwidth and low latency, so it stays clear of lines.
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(font(12.0))
        .background_style(WHITE.mix(0.9))
        .border_style(RGBColor(0xcc, 0xcc, 0xcc))
        .draw()
}

/// The whole picture as SVG text.
pub fn render_svg(title: &str, notes: &[String], series: &[Series]) -> Res<String> {
    let mut svg = String::with_capacity(64 << 10);
    draw(&mut svg, title, notes, series).map_err(|e| format!("drawing the plot: {e}"))?;
    Ok(svg)
}

fn draw(svg: &mut String, title: &str, notes: &[String], series: &[Series]) -> Drawn {
    let head_h = 56 + 17 * notes.len() as u32;
    let root = SVGBackend::with_string(svg, (WIDTH, head_h + 2 * PANEL_H)).into_drawing_area();
    root.fill(&WHITE)?;
    let (head, body) = root.split_vertically(head_h);
    let title_style = styled(20.0, FontStyle::Bold, RGBColor(0x11, 0x11, 0x11));
    head.draw(&Text::new(title, (MARGIN_L, 16), title_style))?;
    for (i, n) in notes.iter().enumerate() {
        let n: String = if n.chars().count() > MAX_NOTE {
            n.chars().take(MAX_NOTE - 3).chain("...".chars()).collect()
        } else {
            n.clone()
        };
        let at = (MARGIN_L, 46 + 17 * i as i32);
        head.draw(&Text::new(
            n,
            at,
            styled(12.5, FontStyle::Normal, RGBColor(0x55, 0x55, 0x55)),
        ))?;
    }
    let values = |m: Metric| -> Vec<f64> {
        series
            .iter()
            .flat_map(|s| {
                s.rows
                    .iter()
                    .filter(|r| r.size > 0)
                    .filter_map(move |r| m.of(r))
            })
            .collect()
    };
    let sizes = all_sizes(series);
    let (top, bottom) = body.split_vertically(PANEL_H);
    let bandwidth = bandwidth_coord(&values(Metric::Bandwidth));
    panel(&top, series, Metric::Bandwidth, x_coord(&sizes), bandwidth)?;
    let latency = latency_coord(&values(Metric::Latency));
    panel(&bottom, series, Metric::Latency, x_coord(&sizes), latency)?;
    root.present()
}

/// Writes the report (and the `--compare` series) as an SVG plot.
pub fn write_svg(report: &Report, compare: &[(PathBuf, String)], path: &Path) -> Res<()> {
    let mut series = vec![Series {
        label: &report.label,
        rows: report.rows.clone(),
    }];
    for (file, label) in compare {
        series.push(Series {
            label,
            rows: read_csv(file)?,
        });
    }
    let svg = render_svg(&report.title, &report.notes, &series)?;
    std::fs::write(path, svg).map_err(|e| format!("writing {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use plotters::coord::ranged1d::Ranged;

    use super::*;
    use crate::args::default_sizes;

    #[test]
    fn numbers_and_ticks_read_well() {
        assert_eq!(short_num(0.30000000000000004), "0.3");
        assert_eq!(short_num(2.0), "2");
        assert_eq!(time_label(0.5), "0.5 us");
        assert_eq!(time_label(2000.0), "2 ms");
        assert_eq!(time_label(3e6), "3 s");
        assert_eq!(sig3(1.98163), "1.98");
        assert_eq!(sig3(110.194), "110");
        // Four decades: a label per decade only.
        let y = latency_coord(&[11.9, 25463.0]);
        assert_eq!(y.bold_points(), &[10.0, 100.0, 1e3, 1e4, 1e5]);
        assert_eq!(y.range(), 10.0..1e5);
        assert_eq!(y.light_points().len(), 4 * 8);
        // Two decades: 2x and 5x labelled too.
        let y = latency_coord(&[5.0, 40.0]);
        assert_eq!(y.bold_points(), &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]);
        assert_eq!(bandwidth_coord(&[]).range(), 0.0..1.08);
    }

    #[test]
    fn x_labels_never_overlap() {
        let sizes = default_sizes();
        assert_eq!(x_powers(&sizes), (3.0, 26.0));
        assert_eq!(x_powers(&[4096]), (11.0, 13.0));
        let labels = x_labels(&sizes, 3.0, 26.0);
        assert_eq!(labels.first(), Some(&8.0));
        assert_eq!(labels.last(), Some(&f64::from(64 << 20)));
        assert!(
            !labels.contains(&f64::from(32 << 20)),
            "32 MiB is one power of two from 64 MiB, too close for a label"
        );
        assert_eq!(labels.len(), sizes.len() - 1);
        let many: Vec<usize> = (3..27).map(|p| 1usize << p).collect();
        let labels = x_labels(&many, 3.0, 26.0);
        assert_eq!(labels.first(), Some(&8.0));
        assert!(labels.len() < many.len() && labels.len() > 6);
    }

    fn rows() -> Vec<Row> {
        vec![
            Row {
                size: 8,
                gbps: Some(0.001),
                lat_us: Some(12.0),
            },
            Row {
                size: 1 << 20,
                gbps: Some(2.5),
                lat_us: Some(400.0),
            },
        ]
    }

    #[test]
    fn svg_is_self_contained_and_escaped() {
        let reference: Vec<Row> = rows()
            .iter()
            .map(|r| Row {
                gbps: r.gbps.map(|v| v * 2.0),
                lat_us: None,
                ..*r
            })
            .collect();
        let series = [
            Series {
                label: "plugin <tcp>",
                rows: rows(),
            },
            Series {
                label: "ib_write_bw & lat",
                rows: reference,
            },
        ];
        let svg = render_svg("a \"title\"", &["note".into()], &series).unwrap();
        assert!(svg.starts_with("<svg "));
        assert!(svg.trim_end().ends_with("</svg>"));
        // Every text as plotters writes it: its own line between the tags.
        let text = |t: &str| svg.contains(&format!(">\n{t}\n</text>"));
        assert!(text("a &quot;title&quot;") && text("note"));
        assert!(text("plugin &lt;tcp&gt;") && text("ib_write_bw &amp; lat"));
        assert!(
            text("8 B") && text("1 MiB"),
            "x ticks at the measured sizes"
        );
        assert!(text("plugin &lt;tcp&gt;: peak 2.50 GB/s at 1 MiB"));
        assert!(text("plugin &lt;tcp&gt;: 12.0 us at 8 B"));
        assert!(text("10 us") && text("1 ms"), "latency ticks");
        assert!(!svg.contains("href"), "no external references");
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
        // This run's line (solid, in both panels) and the reference's (dashed, bandwidth
        // only: it has no latency), each in its colour.
        let polylines = |color: &str| {
            svg.lines()
                .filter(|l| l.starts_with("<polyline") && l.contains(color))
                .count()
        };
        assert_eq!(polylines("stroke=\"#1F6FB4\" stroke-width=\"3\""), 2);
        assert!(polylines("stroke=\"#E8710A\" stroke-width=\"2\"") > 2);
        // Without any data the axes still draw.
        let empty = [Series {
            label: "x",
            rows: vec![],
        }];
        assert!(render_svg("t", &[], &empty).unwrap().contains("</svg>"));
    }

    #[test]
    fn write_svg_adds_the_compare_series() {
        let dir = std::env::temp_dir();
        let csv = dir.join(format!("nccl-net-bench-plot-{}.csv", std::process::id()));
        let svg = csv.with_extension("svg");
        let report = Report {
            rows: rows(),
            title: "t".into(),
            notes: vec![],
            label: "run".into(),
        };
        crate::report::write_csv(&report, &csv).unwrap();
        write_svg(&report, &[(csv.clone(), "again".into())], &svg).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.contains(">\nrun\n</text>") && text.contains(">\nagain\n</text>"));
        let missing = [(dir.join("no-such-file.csv"), "x".to_string())];
        assert!(write_svg(&report, &missing, &svg)
            .unwrap_err()
            .contains("reading "));
        let _ = std::fs::remove_file(&csv);
        let _ = std::fs::remove_file(&svg);
    }
}
