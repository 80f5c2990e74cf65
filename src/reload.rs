//! Hot reload: new limits on a running server, without a restart and without forgetting anyone's
//! usage.
//!
//! `serve` and `stdio` reload their config file on `SIGHUP` and when the file changes on disk (a
//! watcher on its directory, as editors replace files by renaming). The new file goes through the
//! same loading and validation as at start-up; a config that does not validate is refused —
//! logged with the key at fault and counted (`mcp_ratelimit_config_reloads_total{outcome}`) —
//! and the running one stays.
//!
//! What a reload changes: every budget and its algorithm, costs, tool budgets and `fail` modes,
//! tiers, keys and tenants, spend caps, shadow modes and overrides — everything the guard and the
//! identity of callers read per request. Counters live in the store under scope keys that do not
//! depend on a limit's numbers, so they carry over: a caller mid-burst keeps what it spent, a
//! tighter limit applies at once, a looser one lets it continue. (A scope whose algorithm changes
//! starts afresh: the old state means nothing to the new algorithm.) Listen addresses, the store
//! backend, the upstream and the loop detector's settings are read once at start-up: a reload
//! that changes them says so in the log, and they take effect at the next restart.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// How long file events are gathered before one reload: an editor's save is several events.
const SETTLE: Duration = Duration::from_millis(200);

/// Calls `reload` with `file` on every `SIGHUP` and whenever the file changes, until `stop`.
/// `file` is the one the server started with (`--config`, else `./config.toml` when present);
/// without one only `SIGHUP` reloads (the environment may have changed nothing, but that is the
/// operator's call). What a reload does is the caller's: `App` passes `AppState::reload_from`.
pub async fn watch<F>(file: Option<PathBuf>, stop: CancellationToken, reload: F)
where
    F: Fn(Option<&Path>) + Send + 'static,
{
    let (changed_tx, mut changed) = tokio::sync::mpsc::channel::<()>(16);
    // Kept alive for as long as this task runs; dropping it stops the watching.
    let _watcher = file.as_deref().and_then(|file| watch_file(file, changed_tx));
    let mut hangups = hangups();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            Some(()) = changed.recv() => {
                // Gather the rest of this save's events, then read the file once.
                tokio::time::sleep(SETTLE).await;
                while changed.try_recv().is_ok() {}
                tracing::info!("config file changed: reloading");
                reload(file.as_deref());
            }
            Some(()) = next_hangup(&mut hangups) => {
                tracing::info!("SIGHUP: reloading the config");
                reload(file.as_deref());
            }
        }
    }
}

/// Watches `file`'s directory for changes to `file` (created, written, renamed over).
fn watch_file(file: &Path, changed: tokio::sync::mpsc::Sender<()>) -> Option<notify::RecommendedWatcher> {
    use notify::Watcher;
    let name = file.file_name()?.to_owned();
    let dir = match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
        _ => PathBuf::from("."),
    };
    let handler = move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        let ours = event.paths.iter().any(|p| p.file_name() == Some(name.as_os_str()));
        if ours && (event.kind.is_create() || event.kind.is_modify()) {
            // Full: a reload is already coming.
            let _ = changed.try_send(());
        }
    };
    let mut watcher = match notify::recommended_watcher(handler) {
        Ok(watcher) => watcher,
        Err(error) => {
            tracing::warn!(%error, "cannot watch the config file; SIGHUP still reloads it");
            return None;
        }
    };
    if let Err(error) = watcher.watch(&dir, notify::RecursiveMode::NonRecursive) {
        tracing::warn!(%error, dir = %dir.display(), "cannot watch the config file's directory; SIGHUP still reloads");
        return None;
    }
    Some(watcher)
}

#[cfg(unix)]
type Hangups = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangups = ();

#[cfg(unix)]
fn hangups() -> Hangups {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(|error| tracing::warn!(%error, "cannot listen for SIGHUP"))
        .ok()
}

#[cfg(not(unix))]
fn hangups() -> Hangups {}

#[cfg(unix)]
async fn next_hangup(hangups: &mut Hangups) -> Option<()> {
    match hangups {
        Some(signal) => signal.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(not(unix))]
async fn next_hangup(_: &mut Hangups) -> Option<()> {
    std::future::pending().await
}
