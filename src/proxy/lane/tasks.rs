//! 2025-11-25's tasks through the relay lane: a session's `tasks/get`, `tasks/result`,
//! `tasks/list` and `tasks/cancel`, passed to a 2025-11-25 server as they came (rmcp knows only
//! 2026-07-28's tasks). Each is charged to the caller's `limits.method.other` first; a task that is
//! not the caller's own — another caller's, or one no call of ours made — is unknown, and the
//! proxied server never hears of it; `tasks/list` lists the caller's own only.

use std::sync::Arc;

use axum::response::Response;
use rmcp::ErrorData;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::envelope::{self, Params};
use super::send::{Reply, request_within};
use super::{LaneState, json};
use crate::guard::MethodGroup;
use crate::identity::Caller;
use crate::proxy::scopes;
use crate::proxy::seat::Seat;

/// The methods this part of the lane takes.
pub(super) const TAKEN: [&str; 4] = ["tasks/get", "tasks/result", "tasks/list", "tasks/cancel"];

impl LaneState {
    /// A 2025-11-25 session's task request.
    pub(super) async fn task(
        &self,
        seat: Arc<Seat>,
        caller: Caller,
        method: &str,
        id: &RawValue,
        params: &Params<'_>,
        meta: Map<String, Value>,
    ) -> Response {
        let answer = self.task_answer(&seat, &caller, method, params, meta).await;
        json(match answer {
            Ok(result) => envelope::result(id, &result),
            Err(error) => envelope::error(id, &error),
        })
    }

    async fn task_answer(
        &self,
        seat: &Seat,
        caller: &Caller,
        method: &str,
        params: &Params<'_>,
        meta: Map<String, Value>,
    ) -> Result<String, ErrorData> {
        let refused = |refusal: crate::guard::Refusal| crate::mcp::results::method_error(&refusal);
        self.limits.guard().admit_method(caller, MethodGroup::of(method), method).await.map_err(refused)?;
        let upstream = seat
            .upstream(&self.proxied, &self.limits, caller, method)
            .await
            .map_err(|unopened| refused(self.proxied.unopened_refusal(method, unopened)))?;
        let scope = seat.scope(&self.proxied, caller);
        let owned = |task: &str| self.proxied.tasks.is_owned_by(&scopes::task_key(scope.as_deref(), task), caller.id());
        if method != "tasks/list" {
            let task: String = envelope::member(params, "taskId")
                .and_then(Result::ok)
                .ok_or_else(|| ErrorData::invalid_params("taskId is required", None))?;
            if !owned(&task) {
                return Err(ErrorData::invalid_params(format!("unknown task: {task}"), None));
            }
        }
        // `tasks/result` waits for the task to end, as long as a call may take.
        let within = self.proxied.timeout;
        match request_within(&upstream, method, &envelope::owned(params), meta, within).await {
            Reply::Result(result) if method == "tasks/list" => Ok(own_tasks(&result, owned)),
            Reply::Result(result) => Ok(result),
            Reply::Error(error) => Err(error),
            Reply::Failed(detail) => Err(refused(self.proxied.unavailable_refusal(method, &detail))),
        }
    }
}

/// A `tasks/list` result (`{"tasks": [...], ...}`) with only the tasks `owned` says are the
/// caller's; the rest of it as it came.
fn own_tasks(result: &str, owned: impl Fn(&str) -> bool) -> String {
    let Ok(mut listed) = serde_json::from_str::<Map<String, Value>>(result) else {
        return r#"{"tasks":[]}"#.to_owned();
    };
    if let Some(Value::Array(tasks)) = listed.get_mut("tasks") {
        tasks.retain(|task| task.get("taskId").and_then(Value::as_str).is_some_and(&owned));
    } else {
        listed.insert("tasks".to_owned(), Value::Array(Vec::new()));
    }
    serde_json::to_string(&listed).unwrap_or_else(|_| r#"{"tasks":[]}"#.to_owned())
}
