//! A stdio child's pipes, shared by rmcp's client and the relay lane: each line the child writes is
//! read to its JSON-RPC envelope; an answer to one of the lane's requests (an id `mcp-rl-N`) or the
//! progress of one of its calls goes to the lane, anything else on to rmcp's client as it came.
//! What rmcp's client and the lane write reach the child's stdin a whole line at a time.
//!
//! The child lives as long as rmcp's session over it: when rmcp's client lets go of its end the
//! child is killed, and when the child's stdout ends (it exited) rmcp's client hears its end, and
//! the session is reconnected — a new child, a new tap ([`super::link`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::body::Bytes;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader, DuplexStream};
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::sync::{mpsc, oneshot};

use super::lane::Envelope;

/// The longest line either side may write: as long as a stdio line of the server's own.
const LONGEST: usize = 16 * 1024 * 1024;
/// Room on rmcp's side of the pipe pair.
const PIPE: usize = 64 * 1024;

/// The lane's side of a child's pipes.
#[derive(Default)]
pub struct Tap {
    /// Lines to the child's stdin, while it runs.
    lines: Mutex<Option<mpsc::Sender<Vec<u8>>>>,
    /// The lane's requests waiting for their answer, by id.
    waiting: Mutex<HashMap<String, oneshot::Sender<Vec<u8>>>>,
    /// The lane's calls' progress tokens (as JSON, each the lane's own) → their callers' streams,
    /// and the token each caller gave (its progress is told under it).
    progress: Mutex<HashMap<String, (mpsc::Sender<Bytes>, serde_json::Value)>>,
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap").field("waiting", &lock(&self.waiting).len()).finish()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl Tap {
    /// Taps `child` (spawned with its stdin and stdout piped, killed when dropped): the end rmcp's
    /// client speaks over, and the tap.
    pub fn over(mut child: Child) -> std::io::Result<(DuplexStream, Arc<Tap>)> {
        let missing = || std::io::Error::other("the child's stdin or stdout is not piped");
        let stdin = child.stdin.take().ok_or_else(missing)?;
        let stdout = child.stdout.take().ok_or_else(missing)?;
        let (rmcps, ours) = tokio::io::duplex(PIPE);
        let (from_rmcp, to_rmcp) = tokio::io::split(ours);
        let (lines, lane) = mpsc::channel(64);
        let tap = Arc::new(Tap { lines: Mutex::new(Some(lines)), ..Tap::default() });
        tokio::spawn(to_child(child, stdin, from_rmcp, lane));
        tokio::spawn(tap.clone().from_child(stdout, to_rmcp));
        Ok((rmcps, tap))
    }

    /// Writes `line` (a JSON-RPC message, no newline) to the child; `false` when it is gone.
    pub async fn send(&self, line: Vec<u8>) -> bool {
        let lines = lock(&self.lines).clone();
        match lines {
            Some(lines) => lines.send(line).await.is_ok(),
            None => false,
        }
    }

    /// The answer to the lane's request `id`, when it comes, until the returned guard is dropped.
    pub fn await_answer(self: &Arc<Self>, id: &str) -> (Waiting, oneshot::Receiver<Vec<u8>>) {
        let (sender, answer) = oneshot::channel();
        lock(&self.waiting).insert(id.to_owned(), sender);
        (Waiting { tap: self.clone(), id: id.to_owned(), progress: None }, answer)
    }

    /// Also sends the progress of progress token `token` (as JSON; the lane's own) to `to`, told
    /// under `theirs` (the caller's token), until the guard of [`Tap::await_answer`] is dropped.
    pub fn hear_progress(
        &self,
        waiting: &mut Waiting,
        token: String,
        to: mpsc::Sender<Bytes>,
        theirs: serde_json::Value,
    ) {
        lock(&self.progress).insert(token.clone(), (to, theirs));
        waiting.progress = Some(token);
    }

    /// Reads the child's lines until its stdout ends: the lane's to the lane, the rest to rmcp.
    async fn from_child(self: Arc<Self>, stdout: ChildStdout, mut to_rmcp: tokio::io::WriteHalf<DuplexStream>) {
        let mut stdout = BufReader::new(stdout);
        while let Some(line) = read_line(&mut stdout).await {
            if self.diverted(&line).await {
                continue;
            }
            if to_rmcp.write_all(&line).await.is_err() || to_rmcp.write_all(b"\n").await.is_err() {
                break;
            }
        }
        // The child is gone: the lane's requests get no answer, its stdin no more lines.
        lock(&self.waiting).clear();
        lock(&self.lines).take();
        let _ = to_rmcp.shutdown().await;
    }

    /// Whether `line` was the lane's, and went to it.
    async fn diverted(&self, line: &[u8]) -> bool {
        let Some(envelope) = Envelope::read(line) else { return false };
        match (envelope.method.as_deref(), envelope.id) {
            (None, Some(id)) => {
                let Ok(id) = serde_json::from_str::<&str>(id.get()) else { return false };
                let Some(waiting) = lock(&self.waiting).remove(id) else { return false };
                let _ = waiting.send(line.to_vec());
                true
            }
            (Some("notifications/progress"), None) => {
                let token = envelope.params.and_then(|params| progress_token(params.get()));
                let to = token.and_then(|token| lock(&self.progress).get(&token).cloned());
                let Some((to, theirs)) = to else { return false };
                // Told under the caller's own token, which the child never saw.
                let Ok(mut told) = serde_json::from_slice::<serde_json::Value>(line) else { return true };
                if let Some(token) = told.pointer_mut("/params/progressToken") {
                    *token = theirs;
                }
                let _ = to.send(Bytes::from(told.to_string())).await;
                true
            }
            _ => false,
        }
    }
}

/// The progress token of a progress notification's params, as JSON.
fn progress_token(params: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Progress<'a> {
        #[serde(rename = "progressToken", borrow)]
        token: &'a serde_json::value::RawValue,
    }
    serde_json::from_str::<Progress<'_>>(params).ok().map(|p| p.token.get().to_owned())
}

/// A lane request's wait for its answer; given up when dropped.
pub struct Waiting {
    tap: Arc<Tap>,
    id: String,
    progress: Option<String>,
}

impl std::fmt::Debug for Waiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiting").field("id", &self.id).finish()
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        lock(&self.tap.waiting).remove(&self.id);
        if let Some(token) = self.progress.take() {
            lock(&self.tap.progress).remove(&token);
        }
    }
}

/// Writes rmcp's lines and the lane's to the child's stdin, a whole line at a time, until rmcp
/// lets go of its end (then the child is killed) or the child's stdin is closed. rmcp's lines go
/// first when both are ready: what the lane writes after rmcp's handshake reaches the child after
/// it (its `notifications/initialized`, before which a server may not know its tools yet).
async fn to_child(
    mut child: Child,
    mut stdin: ChildStdin,
    from_rmcp: tokio::io::ReadHalf<DuplexStream>,
    mut lane: mpsc::Receiver<Vec<u8>>,
) {
    let mut from_rmcp = BufReader::new(from_rmcp);
    // rmcp's line so far: kept across the select, so a lane line written meanwhile loses none of it.
    let mut rmcps = Vec::new();
    loop {
        let line = tokio::select! {
            biased;
            read = from_rmcp.read_until(b'\n', &mut rmcps) => match read {
                Ok(0) | Err(_) => break,
                Ok(_) if rmcps.ends_with(b"\n") => std::mem::take(&mut rmcps),
                Ok(_) => continue,
            },
            Some(mut line) = lane.recv() => {
                line.push(b'\n');
                line
            }
        };
        if stdin.write_all(&line).await.is_err() {
            break;
        }
    }
    let _ = child.start_kill();
    let _ = child.wait().await;
}

/// The next line of `from` (without its newline), at most [`LONGEST`] bytes; `None` at its end, or
/// past that length (the writer is broken: nothing after it can be framed).
async fn read_line<R: AsyncRead + Unpin>(from: &mut BufReader<R>) -> Option<Vec<u8>> {
    let mut line = Vec::new();
    loop {
        line.clear();
        let read = (&mut *from).take(LONGEST as u64 + 1).read_until(b'\n', &mut line).await.ok()?;
        if read == 0 || (line.len() > LONGEST && line.last() != Some(&b'\n')) {
            return None;
        }
        while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            line.pop();
        }
        if !line.is_empty() {
            return Some(line);
        }
    }
}
