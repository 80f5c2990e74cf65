//! The chart of one shape: calls admitted and refused per time bucket, one line per algorithm.
//!
//! Drawn with `plotters` into an SVG string (its SVG backend only: no fonts or bitmaps to build),
//! in two panels over the same time axis: what got through to the upstream, and what was turned
//! away. Algorithms whose counts are identical over the whole run (token bucket, GCRA and the
//! leaky bucket meter always decide alike) share one line, labelled with all their names, so no
//! line hides another.

use plotters::coord::Shift;
use plotters::prelude::*;

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

/// The chart of `shape` as an SVG document.
pub(crate) fn svg(shape: &ShapeReport, tool: &str, cost: u64) -> Result<String, String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (1000, 760)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let title = format!("{}: {tool} (cost {cost}), {}", shape.shape, shape.description);
        let body = root.titled(&title, ("sans-serif", 20)).map_err(|e| e.to_string())?;
        let (top, bottom) = body.split_vertically(350);
        panel(&top, "admitted", shape, |run| &run.admitted_per_bucket)?;
        panel(&bottom, "refused", shape, |run| &run.refused_per_bucket)?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// One panel: `what` calls per bucket over time, a line per algorithm (or per group of
/// algorithms with identical counts), and the legend.
fn panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    what: &str,
    shape: &ShapeReport,
    counts: impl Fn(&Run) -> &[u32],
) -> Result<(), String> {
    let (unit, unit_ms) = if shape.horizon_ms >= 2 * 3_600_000 { ("h", 3_600_000.0) } else { ("min", 60_000.0) };
    // Group the runs whose counts are identical: (colour of the first, names, counts).
    let mut lines: Vec<(RGBColor, Vec<&str>, &[u32])> = Vec::new();
    for (i, run) in shape.runs.iter().enumerate() {
        match lines.iter_mut().find(|(_, _, seen)| *seen == counts(run)) {
            Some((_, names, _)) => names.push(run.algorithm),
            None => lines.push((COLORS[i % COLORS.len()], vec![run.algorithm], counts(run))),
        }
    }
    let highest = shape.runs.iter().flat_map(|run| counts(run).iter().copied()).max().unwrap_or(0).max(1);
    // Headroom above the highest point for the legend, a line of it per line drawn.
    let top = f64::from(highest) * (1.15 + 0.1 * lines.len() as f64);
    let mut chart = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..shape.horizon_ms as f64 / unit_ms, 0.0..top)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .max_light_lines(0)
        .x_desc(format!("simulated time ({unit})"))
        .y_desc(format!("calls {what} per {} s", trimmed(shape.bucket_ms as f64 / 1000.0)))
        .x_label_formatter(&|x| trimmed(*x))
        .y_label_formatter(&|y| trimmed(*y))
        .draw()
        .map_err(|e| e.to_string())?;
    for (color, names, line) in lines {
        // Bucket k is centred on k × bucket.
        let at = |k: usize| k as f64 * shape.bucket_ms as f64 / unit_ms;
        let points = line.iter().enumerate().map(|(k, n)| (at(k), f64::from(*n)));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(names.join(", "))
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
