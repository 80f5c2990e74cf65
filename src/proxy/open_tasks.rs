//! A task created through the proxy by a `holds_slot` tool, held until it is final: its caller's
//! admission (in-flight slots, the reserved price) and its place among `proxy.max_in_flight` stay
//! taken while the proxied server works on it, not only until its handle came back.

use std::sync::Arc;

use rmcp::model::{ClientRequest, GetTaskParams, GetTaskRequest, RequestMetaObject, ServerResult, TaskPayload};
use rmcp::service::{PeerRequestOptions, ServiceError};
use serde::Deserialize;

use super::lane::{self, Reply};
use super::scopes::Upstream;
use super::{Proxied, link, tasks};
use crate::clock::Nanos;
use crate::guard::{Held, Used};
use crate::mcp::raw::{RawResult, TaskMade};

/// A task created through the proxy, until it is final: what it holds (its caller's admission —
/// in-flight slots, the reserved price — and its place among `proxy.max_in_flight`), and the
/// caller's `_meta` its `tasks/get` goes with (the tasks extension it declared).
pub(super) struct OpenTask {
    pub(super) task: TaskMade,
    pub(super) held: Held,
    pub(super) meta: RequestMetaObject,
    /// The session it was made on, kept open meanwhile.
    pub(super) upstream: Arc<Upstream>,
}

/// How often a task is asked after when it does not say (`pollInterval`), and the least.
const TASK_POLL: Nanos = Nanos::from_secs(1);
const TASK_POLL_AT_LEAST: Nanos = Nanos::from_millis(100);

/// Where a task stands, as the proxied server says when asked.
enum Standing {
    /// Still at work (or waiting for its caller's input).
    Working,
    /// Final, having used this.
    Final(Used),
    /// Not reached, or no answer in time: asked again at the next turn.
    Unknown,
}

impl Proxied {
    /// Keeps what `open` holds until its task is final — completed, failed or cancelled, as the
    /// proxied server says when asked (`tasks/get`, at the task's `pollInterval`), or past its
    /// `ttl` (a day at most), or unknown to the server — then settles its price: to the
    /// `_meta.usage.units` a completed result reports where the tool settles by usage, else as
    /// reserved.
    pub(super) async fn hold_until_final(self: Arc<Self>, open: OpenTask) {
        let OpenTask { task, held, meta, upstream } = open;
        let kept_open = upstream.hold(&self.clock);
        let every = task.poll_ms.map_or(TASK_POLL, Nanos::from_millis).max(TASK_POLL_AT_LEAST);
        let ttl = task.ttl_ms.map_or(tasks::LONGEST, Nanos::from_millis).min(tasks::LONGEST);
        let until = self.clock.now() + ttl;
        let used = loop {
            self.clock.sleep_until((self.clock.now() + every).min(until)).await;
            if self.clock.now() >= until {
                break Used::Unreported;
            }
            let standing = if task.legacy {
                legacy_standing(&upstream, &task.id).await
            } else {
                standing(&upstream, &task.id, &meta).await
            };
            match standing {
                Standing::Final(used) => break used,
                Standing::Working | Standing::Unknown => {}
            }
        };
        // Its slots (and the session) go back now; the price settles behind them.
        let settling = held.finish(used);
        drop(kept_open);
        settling.await;
    }
}

/// A 2026-07-28 task's standing (SEP-2663 `tasks/get`, through rmcp's client, with its caller's
/// `_meta`: the tasks extension it declared).
async fn standing(upstream: &Upstream, id: &str, meta: &RequestMetaObject) -> Standing {
    let Some(peer) = upstream.link().peer() else { return Standing::Unknown };
    let request = ClientRequest::GetTaskRequest(GetTaskRequest::new(GetTaskParams::new(id.to_owned())));
    let mut options = PeerRequestOptions::no_options();
    options.meta = Some(upstream.upstream_meta(meta.clone()));
    let asked = async { peer.send_request_with_option(request, options).await?.await_response().await };
    match tokio::time::timeout(link::ANSWER_WITHIN, asked).await {
        Ok(Ok(ServerResult::GetTaskResult(got))) => match got.task.payload {
            TaskPayload::Working | TaskPayload::InputRequired { .. } => Standing::Working,
            TaskPayload::Completed { result } => {
                let result = serde_json::from_value::<rmcp::model::CallToolResult>(result.into()).ok();
                let units = result.as_ref().and_then(crate::mcp::results::usage_in_meta);
                Standing::Final(units.map_or(Used::Unreported, Used::Reported))
            }
            _ => Standing::Final(Used::Unreported),
        },
        // It no longer knows the task: it is over, whatever it came to.
        Ok(Err(ServiceError::McpError(_))) => Standing::Final(Used::Unreported),
        Ok(Ok(_) | Err(_)) | Err(_) => Standing::Unknown,
    }
}

/// A 2025-11-25 task's standing: that era's `tasks/get` (the task itself, its `status`), and once
/// it is `completed`, its `tasks/result` for the usage it reports; both through the relay lane
/// (rmcp's client knows neither).
async fn legacy_standing(upstream: &Upstream, id: &str) -> Standing {
    #[derive(Deserialize)]
    struct Status {
        status: String,
    }
    let params = serde_json::json!({ "taskId": id });
    match lane::request(upstream, "tasks/get", &params).await {
        Reply::Result(json) => match serde_json::from_str::<Status>(&json).map(|s| s.status) {
            Ok(status) if status == "working" || status == "input_required" => Standing::Working,
            Ok(status) if status == "completed" => {
                let used = match lane::request(upstream, "tasks/result", &params).await {
                    Reply::Result(json) => RawResult::read(&json).ok().and_then(|r| r.usage_in_meta()),
                    Reply::Error(_) | Reply::Failed(_) => None,
                };
                Standing::Final(used.map_or(Used::Unreported, Used::Reported))
            }
            Ok(_) => Standing::Final(Used::Unreported),
            Err(_) => Standing::Unknown,
        },
        Reply::Error(_) => Standing::Final(Used::Unreported),
        Reply::Failed(_) => Standing::Unknown,
    }
}
