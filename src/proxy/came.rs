//! What came back from the proxied server for a call, whichever way it was sent (rmcp's client,
//! or the relay lane), as the proxy reads it: a result (in rmcp's types, or as the server sent
//! it), the server's own JSON-RPC error, or no answer.

use rmcp::ErrorData;
use rmcp::model::{CallToolResponse, ServerResult};
use rmcp::service::ServiceError;

use super::server::Complete;
use crate::mcp::limited::{Said, ToolAnswer};
use crate::mcp::raw::{RawKind, TaskMade};

/// What came back for a call.
#[derive(Debug)]
pub(crate) enum Came {
    /// Its result.
    Result(Said),
    /// Its own JSON-RPC error: it is up, and the error is the caller's to read.
    Error(ErrorData),
    /// No answer: it could not be reached, or its answer could not be read (the transport's
    /// words, any password in a URL taken out).
    Failed(String),
}

impl Came {
    /// What rmcp's client came back with.
    pub(crate) fn of_rmcp(answer: Result<ServerResult, ServiceError>) -> Self {
        let typed = |response| Came::Result(Said::Typed(Ok(response)));
        match answer {
            Ok(ServerResult::CallToolResult(done)) => typed(CallToolResponse::Complete(done)),
            Ok(ServerResult::CreateTaskResult(task)) => typed(CallToolResponse::Task(task)),
            Ok(ServerResult::InputRequiredResult(input)) => typed(CallToolResponse::InputRequired(input)),
            Ok(_) => Came::Error(ErrorData::internal_error(
                "the proxied server answered tools/call with another kind of result",
                None,
            )),
            Err(ServiceError::McpError(error)) => Came::Error(error),
            Err(error) => Came::Failed(crate::redact::url(&error.to_string())),
        }
    }
}

/// The task a result made, if it is one.
pub(crate) fn task_of(said: &Said) -> Option<TaskMade> {
    match said {
        Said::Typed(Ok(CallToolResponse::Task(task))) => Some(TaskMade {
            id: task.task.task_id.clone(),
            ttl_ms: task.task.ttl_ms,
            poll_ms: task.task.poll_interval_ms,
            legacy: false,
        }),
        Said::Raw(raw) => match raw.kind() {
            RawKind::Task(made) => Some(made.clone()),
            _ => None,
        },
        Said::Typed(_) => None,
    }
}

/// A result as the proxy passes it on: another server's, relayed. One in rmcp's types is made
/// valid for a caller of either era and loses any key of ours its server put in its `_meta`
/// (one as it came is, on its way out: [`crate::mcp::results::Editing::of`]).
pub(crate) fn relayed(said: Said) -> ToolAnswer {
    match said {
        Said::Typed(Ok(CallToolResponse::Complete(done))) => {
            let done = crate::mcp::results::without_ours(Complete::complete(done));
            ToolAnswer::relayed(Ok(CallToolResponse::Complete(done)))
        }
        Said::Typed(response) => ToolAnswer::relayed(response),
        Said::Raw(raw) => ToolAnswer::relayed_raw(raw),
    }
}
