//! Script calls made at the same moment sent to Redis together: one write and one read for
//! all of them, not one of each per call.
//!
//! The redis crate's multiplexed connection pipelines what is queued when its driver runs, but
//! tokio runs a task woken by another right after it (its LIFO slot), so the driver wakes for
//! each command and writes each alone: on loopback, most of a round trip's cost is that write
//! and the wake-up of Redis it causes. [`Batcher`] is one task between the calls and the
//! connection: woken by the first call, it yields once, so every call that is ready runs up to
//! its own script call first, then sends all of them as one pipeline. Each script still runs on
//! its own in Redis, atomically, in the order the calls were queued; only the bytes travel
//! together, and each call gets its own reply, or its own error.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ::redis::aio::{ConnectionLike, ConnectionManager};
use ::redis::{Cmd, ErrorKind, RedisError, RedisResult, Script, ServerErrorKind, ToRedisArgs, Value};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::{mpsc, oneshot};

/// The most script calls one pipeline carries.
const MOST_AT_ONCE: usize = 64;

/// Calls waiting to be sent, at most: beyond it a call waits for room (the calls of one instance
/// are bounded by its requests in flight long before).
const QUEUED: usize = 4_096;

/// A script call being written: what [`Script::prepare_invoke`] builds, as a command that can be
/// sent in a pipeline (the redis crate keeps its invocation's command to itself).
pub(super) struct Invocation<'a> {
    script: &'a Script,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl<'a> Invocation<'a> {
    /// A call of `script`, with no keys or arguments yet.
    pub(super) fn of(script: &'a Script) -> Self {
        Self { script, keys: Vec::new(), args: Vec::new() }
    }

    /// Adds a key (`KEYS[n]`).
    pub(super) fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        key.write_redis_args(&mut self.keys);
        self
    }

    /// Adds an argument (`ARGV[n]`).
    pub(super) fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    /// The script the call runs.
    pub(super) fn script(&self) -> &Script {
        self.script
    }

    /// `EVALSHA <sha> <number of keys> <keys> <arguments>`.
    pub(super) fn command(&self) -> Cmd {
        let mut command = Cmd::with_capacity(3 + self.keys.len() + self.args.len(), 0);
        command.arg("EVALSHA").arg(self.script.get_hash()).arg(self.keys.len()).arg(&*self.keys).arg(&*self.args);
        command
    }
}

/// Whether `error` is Redis saying it does not have the script (restarted, failed over, or its
/// script cache flushed): the call loads it and is sent again.
pub(super) fn no_script(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

/// What went to Redis since the store connected: round trips (a pipeline is one) and the commands
/// they carried.
#[derive(Debug, Default)]
pub(super) struct Traffic {
    round_trips: AtomicU64,
    commands: AtomicU64,
}

impl Traffic {
    /// One round trip carrying `commands` commands.
    pub(super) fn sent(&self, commands: usize) {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        self.commands.fetch_add(u64::try_from(commands).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Round trips, and commands, so far.
    pub(super) fn so_far(&self) -> (u64, u64) {
        (self.round_trips.load(Ordering::Relaxed), self.commands.load(Ordering::Relaxed))
    }
}

/// A call waiting in the queue, and where its reply goes.
struct Queued {
    command: Cmd,
    reply: oneshot::Sender<RedisResult<Value>>,
}

/// The task that sends the calls queued at one moment as one pipeline; see the module.
#[derive(Clone)]
pub(super) struct Batcher {
    queue: mpsc::Sender<Queued>,
}

impl Batcher {
    /// Starts the task on `connection`, counting what it sends in `traffic`; it ends when the last
    /// clone of this is dropped.
    pub(super) fn start(connection: ConnectionManager, traffic: Arc<Traffic>) -> Self {
        let (queue, calls) = mpsc::channel(QUEUED);
        tokio::spawn(send_together(calls, connection, traffic));
        Self { queue }
    }

    /// Sends `command` with whatever else is queued now; its reply, or its own error (a server
    /// error answers this call only).
    pub(super) async fn send(&self, command: Cmd) -> RedisResult<Value> {
        let (reply, replied) = oneshot::channel();
        let gone = || RedisError::from((ErrorKind::Io, "the store's connection task has ended"));
        self.queue.send(Queued { command, reply }).await.map_err(|_| gone())?;
        replied.await.map_err(|_| gone())?
    }
}

/// The batcher's loop: a call arrives, every call ready to run is let run up to its own, and what
/// is queued then goes out as one pipeline. Batches are in flight side by side (a slow reply holds
/// up no later one), and each is handed to the connection before the next is made up, so the
/// commands reach Redis in the order they were queued.
async fn send_together(mut calls: mpsc::Receiver<Queued>, connection: ConnectionManager, traffic: Arc<Traffic>) {
    let mut in_flight = FuturesUnordered::new();
    loop {
        tokio::select! {
            biased;
            Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
            call = calls.recv() => {
                let Some(first) = call else { break };
                tokio::task::yield_now().await;
                let mut batch = vec![first];
                while batch.len() < MOST_AT_ONCE {
                    match calls.try_recv() {
                        Ok(call) => batch.push(call),
                        Err(_) => break,
                    }
                }
                traffic.sent(batch.len());
                // Polled first thing next turn, before another batch is made up.
                in_flight.push(send_batch(batch, connection.clone()));
            }
        }
    }
    while in_flight.next().await.is_some() {}
}

/// One batch's round trip: one command alone as itself, several as a pipeline whose replies go
/// back one to each (a server error to its own call; a failed exchange to all of them).
async fn send_batch(batch: Vec<Queued>, mut connection: ConnectionManager) {
    if let [_] = batch[..] {
        let Some(Queued { command, reply }) = batch.into_iter().next() else { return };
        let _ = reply.send(command.query_async(&mut connection).await);
        return;
    }
    let mut pipeline = ::redis::pipe();
    let mut replies = Vec::with_capacity(batch.len());
    for Queued { command, reply } in batch {
        pipeline.add_command(command);
        replies.push(reply);
    }
    match connection.req_packed_commands(&pipeline, 0, replies.len()).await {
        Ok(values) if values.len() == replies.len() => {
            for (reply, value) in replies.into_iter().zip(values) {
                let answer = match value {
                    Value::ServerError(error) => Err(error.into()),
                    value => Ok(value),
                };
                let _ = reply.send(answer);
            }
        }
        Ok(values) => {
            let why = format!("{} replies to a pipeline of {}", values.len(), replies.len());
            for reply in replies {
                let _ = reply.send(Err(RedisError::from((ErrorKind::UnexpectedReturnType, "pipeline", why.clone()))));
            }
        }
        Err(error) => {
            for reply in replies {
                let _ = reply.send(Err(error.clone()));
            }
        }
    }
}
