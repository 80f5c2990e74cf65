//! The command line. All the work is in the library; this only parses flags and starts it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::builder::PossibleValuesParser;
use clap::{Parser, Subcommand, ValueEnum};
use mcp_ratelimit::clock::SystemClock;
use mcp_ratelimit::config::{Catalogue, ConfigError};
use mcp_ratelimit::limit::ALGORITHMS;
use mcp_ratelimit::mcp::tools::catalogue;
use mcp_ratelimit::mock_upstream::MockUpstream;
use mcp_ratelimit::proxy::Target;
use mcp_ratelimit::simulate::{self, Plan, Shape, UpstreamShape};
use mcp_ratelimit::telemetry::Telemetry;
use mcp_ratelimit::telemetry::bounded::TraceQueue;
use mcp_ratelimit::{App, Config};
use tokio::net::TcpListener;

/// An MCP request allocates many small, short-lived buffers (JSON, SSE frames, channel
/// messages); mimalloc serves them measurably faster than the system allocator
/// (see scripts/load.sh). Only the binary sets it; the library leaves the choice to embedders.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(name = "mcp-ratelimit", version, about = "An MCP server that keeps AI agents from running up a bill")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve MCP over streamable HTTP at /mcp.
    Serve {
        /// Config file (default: ./config.toml if present, else the built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Listen address, overriding server.listen.
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Serve MCP over stdin/stdout (Claude Desktop, Inspector --transport stdio). Logs go to stderr.
    Stdio {
        /// Config file.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Every limit in front of another MCP server (any language): reached over streamable HTTP
    /// (--upstream URL) or started as a supervised stdio child (-- COMMAND ARGS…), served over
    /// streamable HTTP at /mcp (or stdio with --stdio).
    Proxy {
        /// Config file (default: ./config.toml if present, else the built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Listen address, overriding server.listen.
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Serve MCP over stdin/stdout instead (Claude Desktop in front of a local server).
        #[arg(long, conflicts_with = "listen")]
        stdio: bool,
        /// The proxied server's streamable HTTP endpoint, overriding proxy.upstream_url.
        #[arg(long, conflicts_with = "command")]
        upstream: Option<String>,
        /// The proxied server as a command and its arguments, after `--`, overriding proxy.command.
        #[arg(last = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// Run the mock paid API on its own, so several servers can share it.
    MockUpstream {
        /// Config file (for the [mock_upstream] knobs, and the header and body deadlines of [server]).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Listen address, overriding mock_upstream.listen.
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Validate a config and print the effective limits.
    CheckConfig {
        /// The file to check (default: ./config.toml if present).
        file: Option<PathBuf>,
        /// Check it as `proxy` reads it: its tools are the proxied server's, learnt at run time.
        #[arg(long)]
        proxy: bool,
    },
    /// Replay agent traffic shapes against the configured budgets on a virtual clock, one run per
    /// algorithm: a table per shape, and an SVG chart per shape.
    Simulate {
        /// Config file (default: ./config.toml if present, else the built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Shapes to replay (repeat, or comma-separate); default: all.
        #[arg(long = "shape", value_delimiter = ',', value_parser = PossibleValuesParser::new(simulate::shape_names()))]
        shapes: Vec<String>,
        /// Algorithms to compare (repeat, or comma-separate); default: all.
        #[arg(long = "algorithm", value_delimiter = ',', value_parser = PossibleValuesParser::new(ALGORITHMS))]
        algorithms: Vec<String>,
        /// The tool the agent calls; default: the costliest tool that answers at once.
        #[arg(long)]
        tool: Option<String>,
        /// Seed of every random draw (fan-out timing, round trips, turns).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Where the charts go, one `<shape>.svg` each.
        #[arg(long, default_value = "simulate-out")]
        out: PathBuf,
        /// `text` (tables) or `json`.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
}

/// How `simulate` prints its report.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    /// Fixed-width tables, one per shape.
    Text,
    /// One JSON document.
    Json,
}

/// Logs go to stderr: `RUST_LOG` if set, else `info` (`warn` when MCP itself is on stdio, so a
/// client that shows the server's stderr shows only what matters), rmcp's own at `warn` and its
/// per-response errors not at all; colours only on a terminal. With `telemetry` (`[telemetry]`
/// set), the request path's spans also go to its exporter, through a layer of their own: each
/// layer has its own filter, so the log never shows those spans and, with no exporter, nothing
/// wants them and they are never made ([`mcp_ratelimit::telemetry`]).
fn init_logging(quiet: bool, telemetry: Option<&Telemetry>) {
    use std::io::IsTerminal;
    use tracing_subscriber::prelude::*;
    // rmcp logs every JSON-RPC error it answers (a refused ping, say) as a WARN; the guard's own
    // rate-limited line already says what was refused, and why.
    let default = if quiet { "warn,rmcp::service=error" } else { "info,rmcp=warn,rmcp::service=error" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let log = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .with_filter(mcp_ratelimit::telemetry::log_filter(filter));
    tracing_subscriber::registry().with(log).with(telemetry.map(Telemetry::layer)).init();
}

/// The config a command that runs a server reads (`None` for the others), loaded once, before
/// logging starts: `[telemetry]` says where its spans go.
fn config_of(command: &Command) -> Result<Option<Config>, ConfigError> {
    match command {
        Command::Serve { config, .. } | Command::Stdio { config } | Command::MockUpstream { config, .. } => {
            Config::load(config.as_deref(), &catalogue()).map(Some)
        }
        Command::Proxy { config, .. } => Config::load(config.as_deref(), &Catalogue::learned()).map(Some),
        Command::CheckConfig { .. } | Command::Simulate { .. } => Ok(None),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::CheckConfig { file, proxy } = &cli.command {
        let tools = if *proxy { Catalogue::learned() } else { catalogue() };
        return match Config::load(file.as_deref(), &tools) {
            Ok(config) => {
                println!("config OK\n\n{}", config.limits_table());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(2)
            }
        };
    }
    if let Command::Simulate { config, shapes, algorithms, tool, seed, out, format } = cli.command {
        return run_simulation(config.as_deref(), shapes, algorithms, tool, seed, &out, format);
    }
    let config = match config_of(&cli.command) {
        Ok(Some(config)) => config,
        Ok(None) => unreachable!("check-config and simulate are handled above"),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let telemetry = match config.telemetry.as_ref().map(Telemetry::start).transpose() {
        Ok(telemetry) => telemetry,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    init_logging(matches!(cli.command, Command::Stdio { .. } | Command::Proxy { stdio: true, .. }), telemetry.as_ref());
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let traces = telemetry.as_ref().map(Telemetry::queue);
    let ran = runtime.block_on(run(cli.command, config, traces));
    drop(runtime);
    // The last spans are sent, outside the runtime: the exporter's client blocks.
    if let Some(Err(e)) = telemetry.map(Telemetry::shutdown) {
        eprintln!("{e}");
    }
    match ran {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `command`; `traces`, the trace exporter's queue with `[telemetry]` on, is shown in the
/// server's `/metrics`.
async fn run(command: Command, config: Config, traces: Option<Arc<TraceQueue>>) -> anyhow::Result<()> {
    let watch = |app: &App| {
        if let Some(traces) = &traces {
            app.state().watch_traces(traces.clone());
        }
    };
    match command {
        Command::Serve { config: file, listen } => {
            let addr = listen.unwrap_or(config.server.listen);
            let app = App::start(config.serving_at(addr)?, SystemClock::shared()).await?;
            watch(&app);
            app.reload_on_change(config_file(file));
            serve_http(&app, addr).await?;
        }
        Command::Proxy { config: file, listen, stdio, upstream, command } => {
            let target = Target::of(&config.proxy, upstream, command).map_err(anyhow::Error::msg)?;
            let addr = listen.unwrap_or(config.server.listen);
            let config = if stdio { config } else { config.serving_at(addr)? };
            let app = App::start_proxy(config, target, SystemClock::shared()).await?;
            watch(&app);
            app.reload_on_change(config_file(file));
            if stdio {
                tracing::info!(upstream = %app.upstream_url(), "proxying MCP on stdio");
                app.serve_stdio().await?;
                app.state().limits.give_back_held().await;
            } else {
                serve_http(&app, addr).await?;
            }
        }
        Command::Stdio { config: file } => {
            let app = App::start(config, SystemClock::shared()).await?;
            watch(&app);
            app.reload_on_change(config_file(file));
            tracing::info!(upstream = %mcp_ratelimit::redact::url(app.upstream_url()), "serving MCP on stdio");
            app.serve_stdio().await?;
            app.state().limits.give_back_held().await;
        }
        Command::MockUpstream { listen, .. } => {
            let addr = listen.unwrap_or(config.mock_upstream.listen);
            let listener = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
            let deadlines = mcp_ratelimit::http::serve::Deadlines::of(&config.server);
            let mock = MockUpstream::start(config.mock_upstream, deadlines, SystemClock::shared(), listener).await?;
            tracing::info!(url = %mock.url, "mock upstream serving");
            shutdown_signal().await;
        }
        Command::CheckConfig { .. } | Command::Simulate { .. } => unreachable!("handled before the runtime starts"),
    }
    Ok(())
}

/// Serves `/mcp` on `addr`, and the admin API when a key is configured, until a shutdown signal.
async fn serve_http(app: &App, addr: SocketAddr) -> anyhow::Result<()> {
    let admin = &app.state().config.admin;
    if admin.key_sha256.is_none() {
        // Said before anything listens, so whoever sees the port open can read it.
        tracing::info!("admin API off: no admin.key configured");
    }
    let listener = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    tracing::info!(
        mcp = %format!("http://{addr}/mcp"),
        dashboard = %format!("http://{addr}/dashboard"),
        metrics = %format!("http://{addr}/metrics"),
        upstream = %mcp_ratelimit::redact::url(app.upstream_url()),
        "serving"
    );
    if admin.key_sha256.is_some() {
        let at = admin.listen;
        let listener = TcpListener::bind(at).await.with_context(|| format!("cannot listen on {at} (admin.listen)"))?;
        if let Some(serving) = app.serve_admin(listener) {
            tracing::info!(admin = %format!("http://{at}/admin/openapi.json"), "admin API on");
            tokio::spawn(serving);
        }
    }
    tokio::select! {
        served = app.serve_http(listener) => served?,
        () = shutdown_signal() => {
            tracing::info!("shutting down");
            app.stop();
        }
    }
    app.state().limits.give_back_held().await;
    Ok(())
}

/// The file a server's config came from and is reloaded from: `--config`, else `./config.toml`
/// when there is one (as [`Config::load`] reads it).
fn config_file(given: Option<PathBuf>) -> Option<PathBuf> {
    given.or_else(|| {
        let local = PathBuf::from("config.toml");
        local.exists().then_some(local)
    })
}

/// `simulate`: no logging (the guard logs every refusal, and a simulation refuses thousands), no
/// async runtime, and exit code 2 for anything the command line or the config got wrong.
fn run_simulation(
    config: Option<&std::path::Path>,
    shapes: Vec<String>,
    algorithms: Vec<String>,
    tool: Option<String>,
    seed: u64,
    out: &std::path::Path,
    format: Format,
) -> ExitCode {
    let config = match Config::load(config, &catalogue()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mut plan = Plan::everything(seed);
    if !shapes.is_empty() {
        // Clap has checked every name against the shapes' own lists.
        plan.shapes = shapes.iter().filter_map(|name| Shape::from_name(name)).collect();
        plan.upstream = shapes.iter().filter_map(|name| UpstreamShape::from_name(name)).collect();
    }
    if !algorithms.is_empty() {
        plan.algorithms = algorithms;
    }
    plan.tool = tool;
    let started = std::time::Instant::now();
    let simulated = simulate::run(&config, &plan).and_then(|mut report| {
        report.write_charts(out)?;
        Ok(report)
    });
    match simulated {
        Ok(report) => {
            eprintln!("simulated {} tool calls in {:.0?}", report.calls(), started.elapsed());
            match format {
                Format::Text => print!("{}", report.to_text()),
                Format::Json => match serde_json::to_string_pretty(&report) {
                    Ok(json) => println!("{json}"),
                    Err(e) => {
                        eprintln!("cannot write the report as JSON: {e}");
                        return ExitCode::FAILURE;
                    }
                },
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            if e.is_usage() { ExitCode::from(2) } else { ExitCode::FAILURE }
        }
    }
}

/// Ctrl-C, or SIGTERM (what containers and service managers send to stop a process).
async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}
