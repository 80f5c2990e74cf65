//! The charts: for a budget shape, calls admitted and refused per time bucket, one line per
//! algorithm; for `capacity_drop`, the account's limit against its capacity, and the upstream's
//! 429s, one line per limit.
//!
//! Drawn with `plotters` into an SVG string (its SVG backend only: no fonts or bitmaps to build),
//! in two panels over the same time axis. Algorithms whose counts are identical over the whole run
//! (token bucket, GCRA and the leaky bucket meter always decide alike) share one line, labelled
//! with all their names, so no line hides another.

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::simulate::capacity_drop::CapacityDrop;
use crate::simulate::{Run, ShapeReport, trimmed};

/// One colour per algorithm, in run order (the Tableau 10 palette: distinct, colour-blind aware).
const COLORS: [RGBColor; 7] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];

/// One line of a panel: its colour, its legend, and its points (milliseconds, value).
struct Line {
    color: RGBColor,
    label: String,
    points: Vec<(f64, f64)>,
}

/// One panel: what its values are, and its lines.
struct Panel {
    y_desc: String,
    lines: Vec<Line>,
}

/// The chart of `shape` as an SVG document.
pub(crate) fn svg(shape: &ShapeReport, tool: &str, cost: u64) -> Result<String, String> {
    let title = format!("{}: {tool} (cost {cost}), {}", shape.shape, shape.description);
    let per = trimmed(shape.bucket_ms as f64 / 1000.0);
    let panel = |what: &str, counts: fn(&Run) -> &[u32]| Panel {
        y_desc: format!("calls {what} per {per} s"),
        lines: counted_lines(shape, counts),
    };
    let admitted = panel("admitted", |run| &run.admitted_per_bucket);
    let refused = panel("refused", |run| &run.refused_per_bucket);
    two_panels(&title, shape.horizon_ms, [admitted, refused])
}

/// The chart of `capacity_drop`: each limit (the static cap, each learner) against the account's
/// capacity, and the upstream's 429s per second under each.
pub(crate) fn capacity_svg(drop: &CapacityDrop) -> Result<String, String> {
    let capacities: Vec<String> = drop.phases.iter().map(|p| p.capacity.to_string()).collect();
    let title = format!("capacity_drop: each limit against the account's capacity ({})", capacities.join(", then "));
    let seconds = |count: usize| count as f64 * 1000.0;
    let mut capacity = Vec::new();
    for phase in &drop.phases {
        capacity.extend([(phase.from_ms as f64, phase.capacity as f64), (phase.to_ms as f64, phase.capacity as f64)]);
    }
    let mut slots = vec![Line { color: BLACK, label: "the account's capacity".to_owned(), points: capacity }];
    let mut refused = Vec::new();
    for (i, run) in drop.runs.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut points = Vec::new();
        for &(at_ms, limit) in run.limit_over_time() {
            if let Some(&(_, before)) = points.last() {
                points.push((at_ms as f64, before));
            }
            points.push((at_ms as f64, limit as f64));
        }
        if let Some(&(_, last)) = points.last() {
            points.push((drop.horizon_ms as f64, last));
        }
        slots.push(Line { color, label: run.limit.clone(), points });
        let per_second = run.refused_per_second().iter().enumerate();
        let points = per_second.map(|(second, n)| (seconds(second), f64::from(*n))).collect();
        refused.push(Line { color, label: run.limit.clone(), points });
    }
    let slots = Panel { y_desc: "account slots".to_owned(), lines: slots };
    let refused = Panel { y_desc: "upstream 429s per second".to_owned(), lines: refused };
    two_panels(&title, drop.horizon_ms, [slots, refused])
}

/// A line per algorithm (or per group of algorithms with identical counts): `counts` per bucket,
/// bucket `k` centred on `k × bucket`.
fn counted_lines(shape: &ShapeReport, counts: fn(&Run) -> &[u32]) -> Vec<Line> {
    let mut lines: Vec<(RGBColor, Vec<&str>, &[u32])> = Vec::new();
    for (i, run) in shape.runs.iter().enumerate() {
        match lines.iter_mut().find(|(_, _, seen)| *seen == counts(run)) {
            Some((_, names, _)) => names.push(run.algorithm),
            None => lines.push((COLORS[i % COLORS.len()], vec![run.algorithm], counts(run))),
        }
    }
    let at = |k: usize| k as f64 * shape.bucket_ms as f64;
    lines
        .into_iter()
        .map(|(color, names, line)| Line {
            color,
            label: names.join(", "),
            points: line.iter().enumerate().map(|(k, n)| (at(k), f64::from(*n))).collect(),
        })
        .collect()
}

/// An SVG of two panels over the same time axis, `horizon_ms` long, under `title`.
fn two_panels(title: &str, horizon_ms: u64, [top, bottom]: [Panel; 2]) -> Result<String, String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (1000, 760)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let body = root.titled(title, ("sans-serif", 20)).map_err(|e| e.to_string())?;
        let (upper, lower) = body.split_vertically(350);
        panel(&upper, horizon_ms, top)?;
        panel(&lower, horizon_ms, bottom)?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// One panel: its lines over time, and the legend.
fn panel(area: &DrawingArea<SVGBackend<'_>, Shift>, horizon_ms: u64, panel: Panel) -> Result<(), String> {
    let (unit, unit_ms) = match horizon_ms {
        ms if ms >= 2 * 3_600_000 => ("h", 3_600_000.0),
        ms if ms >= 300_000 => ("min", 60_000.0),
        _ => ("s", 1000.0),
    };
    let highest = panel.lines.iter().flat_map(|line| line.points.iter().map(|(_, y)| *y)).fold(1.0, f64::max);
    // Headroom above the highest point for the legend, a line of it per line drawn.
    let top = highest * (1.15 + 0.1 * panel.lines.len() as f64);
    let mut chart = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..horizon_ms as f64 / unit_ms, 0.0..top)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .max_light_lines(0)
        .x_desc(format!("simulated time ({unit})"))
        .y_desc(panel.y_desc)
        .x_label_formatter(&|x| trimmed(*x))
        .y_label_formatter(&|y| trimmed(*y))
        .draw()
        .map_err(|e| e.to_string())?;
    for Line { color, label, points } in panel.lines {
        let points = points.into_iter().map(|(ms, y)| (ms / unit_ms, y));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}
