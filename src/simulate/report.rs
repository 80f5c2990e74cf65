//! What a simulation reports: the budget that binds, each run's numbers, and the report as
//! tables (`to_text`) or JSON.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::capacity_drop::CapacityDrop;
use super::identical_asks::IdenticalAsks;
use super::job_endings::JobEndings;
use super::many_instances::ManyInstances;
use super::result_loops::ResultLoops;
use super::{SimulateError, UpstreamShape, chart};
use crate::clock::{NANOS_PER_MS, NANOS_PER_SEC, Nanos};
use crate::limit::Limiter;

/// The budget that binds the simulated call: of the scopes it draws on, the one that sustains
/// the fewest calls per second. The shapes are paced from it.
#[derive(Debug, Clone, Serialize)]
pub struct Budget {
    /// The scope, e.g. `caller:tok:1f2e…`.
    pub scope: String,
    /// Units one call costs in it.
    pub units_per_call: u64,
    /// Calls it admits at once (its capacity over the cost).
    pub burst_calls: u64,
    /// Calls per second it sustains.
    pub calls_per_sec: f64,
    /// Its window in milliseconds: capacity / rate for a bucket, the window for a window.
    pub window_ms: u64,
    #[serde(skip)]
    window: Nanos,
    #[serde(skip)]
    call_period: Nanos,
}

impl Budget {
    /// The binding budget among `scopes` (scope, limiter, units per call); `None` if all are
    /// in-flight caps.
    pub(crate) fn binding<'a>(scopes: impl IntoIterator<Item = (&'a str, &'a Limiter, u64)>) -> Option<Budget> {
        scopes
            .into_iter()
            .filter_map(|(scope, limiter, units)| {
                let window = limiter.policy_window()?;
                let units = units.max(1);
                // Time the scope takes to give back one call's units.
                let call_period =
                    u64::try_from(u128::from(window.as_u64()) * u128::from(units) / u128::from(limiter.capacity()))
                        .map_or(Nanos::MAX, Nanos::new)
                        .max(Nanos::new(1));
                Some(Budget {
                    scope: scope.to_owned(),
                    units_per_call: units,
                    burst_calls: (limiter.capacity() / units).max(1),
                    calls_per_sec: NANOS_PER_SEC as f64 / call_period.as_u64() as f64,
                    window_ms: window.as_u64() / NANOS_PER_MS,
                    window,
                    call_period,
                })
            })
            .max_by_key(|budget| budget.call_period)
    }

    /// The window in nanoseconds.
    pub(crate) fn window(&self) -> Nanos {
        self.window.max(Nanos::new(1))
    }

    /// Nanoseconds the budget takes to give back one call.
    pub(crate) fn call_period(&self) -> Nanos {
        self.call_period
    }
}

/// One scope the simulated call draws on, as configured.
#[derive(Debug, Clone, Serialize)]
pub struct ScopeLine {
    /// The scope's name.
    pub scope: String,
    /// Its configured algorithm.
    pub algorithm: &'static str,
    /// Its parameters, as `check-config` prints them.
    pub parameters: String,
    /// Units one call costs in it.
    pub units_per_call: u64,
}

/// One shape against one algorithm.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// The algorithm every rate scope used.
    pub algorithm: &'static str,
    /// Calls the agent made.
    pub calls: u64,
    /// Calls admitted.
    pub allowed: u64,
    /// Calls refused.
    pub refused: u64,
    /// Refusals after a refusal, with no admission between: the first refusal tells the agent
    /// how long to wait, every further one is a call it could have saved.
    pub wasted: u64,
    /// Cost units admitted.
    pub spend: u64,
    /// The most admitted calls (what reached the upstream) in any one second.
    pub peak_per_second: u64,
    /// The most admitted calls in any 60 seconds.
    pub peak_per_minute: u64,
    #[serde(skip)]
    pub(crate) admitted_per_bucket: Vec<u32>,
    #[serde(skip)]
    pub(crate) refused_per_bucket: Vec<u32>,
}

/// An algorithm a shape was not run against, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    /// The algorithm.
    pub algorithm: &'static str,
    /// Why it cannot stand in for the budgets.
    pub reason: &'static str,
}

/// One shape against every algorithm.
#[derive(Debug, Clone, Serialize)]
pub struct ShapeReport {
    /// The shape's name.
    pub shape: &'static str,
    /// What the agent does, with this budget's numbers.
    pub description: String,
    /// How much agent time was replayed, in milliseconds.
    pub horizon_ms: u64,
    /// The chart's time bucket, in milliseconds; bucket `k` is centred on `k × bucket_ms`.
    pub bucket_ms: u64,
    /// One run per algorithm.
    pub runs: Vec<Run>,
    /// The algorithms not run, with the reason.
    pub not_simulated: Vec<Skipped>,
    /// Where its chart was written, once it was.
    pub chart: Option<PathBuf>,
}

/// Everything a simulation found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The seed of every random draw.
    pub seed: u64,
    /// The budget shapes, if any ran.
    #[serde(flatten)]
    pub budgets: Option<Budgets>,
    /// `capacity_drop`, if it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity_drop: Option<CapacityDrop>,
    /// `identical_asks`, if it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identical_asks: Option<IdenticalAsks>,
    /// `job_endings`, if it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_endings: Option<JobEndings>,
    /// `many_instances`, if it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub many_instances: Option<ManyInstances>,
    /// `paraphrasing_searcher` and `polling_with_progress`, if either ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_loops: Option<ResultLoops>,
}

/// The budget shapes: who calls what, the budgets each call draws on, and one table per shape.
#[derive(Debug, Clone, Serialize)]
pub struct Budgets {
    /// The tool the agent calls.
    pub tool: String,
    /// Its cost.
    pub cost: u64,
    /// Who the agent is.
    pub caller: String,
    /// The scopes each call draws on, as configured.
    pub scopes: Vec<ScopeLine>,
    /// The one that binds.
    pub binding: Budget,
    /// Whether loop detection was on (it never fires: every call has its own arguments).
    pub loop_detection: bool,
    /// Whether limits were enforced at all (`limits.enabled`).
    pub limits_enabled: bool,
    /// One entry per shape.
    pub shapes: Vec<ShapeReport>,
}

impl Report {
    /// The report as fixed-width tables, one per shape.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "mcp-ratelimit simulate (seed {})", self.seed);
        if let Some(budgets) = &self.budgets {
            budgets.write_text(&mut out);
        }
        if let Some(drop) = &self.capacity_drop {
            drop.write_text(&mut out);
        }
        if let Some(asks) = &self.identical_asks {
            asks.write_text(&mut out);
        }
        if let Some(endings) = &self.job_endings {
            endings.write_text(&mut out);
        }
        if let Some(instances) = &self.many_instances {
            instances.write_text(&mut out);
        }
        if let Some(loops) = &self.result_loops {
            loops.write_text(&mut out);
        }
        let budget_charts = self.budgets.iter().flat_map(|b| &b.shapes).filter_map(|s| s.chart.as_ref());
        let charts: Vec<String> = budget_charts
            .chain(self.capacity_drop.iter().filter_map(|d| d.chart.as_ref()))
            .map(|p| p.display().to_string())
            .collect();
        if !charts.is_empty() {
            let _ = writeln!(out);
            let _ = writeln!(out, "charts   {}", charts.join(" "));
        }
        out
    }

    /// Tool calls replayed in all, for the timing line.
    pub fn calls(&self) -> u64 {
        let budgets = self.budgets.iter().flat_map(|b| &b.shapes).flat_map(|s| &s.runs).map(|r| r.calls).sum::<u64>();
        let drop = self.capacity_drop.iter().flat_map(|d| &d.runs).map(|r| r.calls).sum::<u64>();
        budgets
            + drop
            + self.identical_asks.as_ref().map_or(0, IdenticalAsks::calls)
            + self.job_endings.as_ref().map_or(0, JobEndings::calls)
            + self.many_instances.as_ref().map_or(0, ManyInstances::calls)
            + self.result_loops.as_ref().map_or(0, ResultLoops::calls)
    }

    /// Draws one chart per budget shape, and one for `capacity_drop`, into `dir` (created if
    /// needed) as `<shape>.svg`.
    pub fn write_charts(&mut self, dir: &Path) -> Result<(), SimulateError> {
        let failed = |path: &Path, message: String| SimulateError::Chart { path: path.to_owned(), message };
        std::fs::create_dir_all(dir).map_err(|e| failed(dir, e.to_string()))?;
        let write = |name: &str, svg: Result<String, String>| -> Result<PathBuf, SimulateError> {
            let path = dir.join(format!("{name}.svg"));
            let svg = svg.map_err(|message| failed(&path, message))?;
            std::fs::write(&path, svg).map_err(|e| failed(&path, e.to_string()))?;
            Ok(path)
        };
        if let Some(budgets) = &mut self.budgets {
            for shape in &mut budgets.shapes {
                shape.chart = Some(write(shape.shape, chart::svg(shape, &budgets.tool, budgets.cost))?);
            }
        }
        if let Some(drop) = &mut self.capacity_drop {
            drop.chart = Some(write(UpstreamShape::CapacityDrop.name(), chart::capacity_svg(drop))?);
        }
        Ok(())
    }
}

impl Budgets {
    /// Who calls what and the budgets it draws on, then one table per shape.
    fn write_text(&self, out: &mut String) {
        let b = &self.binding;
        let _ = writeln!(out);
        let _ = writeln!(out, "tool     {} (cost {})", self.tool, self.cost);
        let _ = writeln!(out, "caller   {}", self.caller);
        let _ = writeln!(out, "budgets  each call draws on, as configured:");
        for s in &self.scopes {
            let units = if s.units_per_call == 1 { "unit" } else { "units" };
            let _ = writeln!(
                out,
                "           {:<44} {:<15} {:<28} {} {units} a call",
                s.scope, s.algorithm, s.parameters, s.units_per_call
            );
        }
        let _ = writeln!(
            out,
            "binding  {}: {} calls at once, then {} calls/s (a {} s window for the window algorithms)",
            b.scope,
            b.burst_calls,
            trimmed(b.calls_per_sec),
            trimmed(b.window_ms as f64 / 1000.0)
        );
        let _ = writeln!(out, "runs     each algorithm in place of every rate scope above, with its burst and rate;");
        let _ = writeln!(out, "         in-flight caps stay as they are. Virtual clock, the server's own guard.");
        let loops = if self.loop_detection { "on" } else { "off" };
        let _ = writeln!(out, "args     every call has new arguments: loop detection ({loops}) never stops one.");
        let _ = writeln!(
            out,
            "wasted   a refusal after a refusal: the first says how long to wait, the rest were avoidable."
        );
        let _ = writeln!(out, "peak     admitted calls (what the upstream saw) in any 1 s / any 60 s.");
        if !self.limits_enabled {
            let _ = writeln!(out, "note     limits.enabled = false: the guard admits everything.");
        }
        for shape in &self.shapes {
            let _ = writeln!(out);
            let _ = writeln!(out, "{} ({}): {}", shape.shape, span(shape.horizon_ms), shape.description);
            let _ = writeln!(
                out,
                "  {:<16} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9}",
                "algorithm", "calls", "allowed", "refused", "wasted", "spend", "peak/1s", "peak/60s"
            );
            for r in &shape.runs {
                let _ = writeln!(
                    out,
                    "  {:<16} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9}",
                    r.algorithm, r.calls, r.allowed, r.refused, r.wasted, r.spend, r.peak_per_second, r.peak_per_minute
                );
            }
            for s in &shape.not_simulated {
                let _ = writeln!(out, "  {:<16} not simulated: {}", s.algorithm, s.reason);
            }
        }
    }
}

/// `0.5`, `2`, `0.0083`: a rate or a length without trailing zeros.
pub(crate) fn trimmed(value: f64) -> String {
    let text = format!("{value:.4}");
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// `10 min`, `8 h`, `330 s`, `0 s`.
pub(crate) fn span(ms: u64) -> String {
    match ms {
        0 => "0 s".to_owned(),
        ms if ms.is_multiple_of(3_600_000) => format!("{} h", ms / 3_600_000),
        ms if ms.is_multiple_of(60_000) => format!("{} min", ms / 60_000),
        ms => format!("{} s", trimmed(ms as f64 / 1000.0)),
    }
}
