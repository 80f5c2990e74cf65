//! The tools: thin wrappers over the paid API, each with a schema that states its limits.
//!
//! Each tool is declared once, in [`TOOLS`]: its name, what it reaches (the paid API, a job of
//! which class, or only the caller's own state), whether asking again can be a loop, its arguments
//! type and its `#[tool]` method. That one entry builds what `tools/list` shows ([`listed`]), the
//! [`catalogue`] the limits are checked against, the argument checks and the refusals before
//! anything is charged ([`validate_arguments`], `before_charging`), the loop exemption
//! (`loop_exempt`) and the call of its method with what the call was admitted with.
//!
//! Tools never check budgets themselves: the one guarded call ([`crate::guard::call`], under
//! [`PaidTools`](super::server::PaidTools)' rules) has already validated their arguments and
//! charged the caller before a tool body runs. A tool only turns upstream answers into results,
//! and upstream failures into refusals that carry the wait. Its method is handed what the call was
//! admitted with as a typed value ([`Admitted`]): the caller, and for a job tool the admission
//! (its in-flight slots and price) and its queue place, which it hands to the job, which gives
//! them back when the job is final.

use answers::BREAKER_OPEN;
use args::parse;

use std::future::Future;
use std::pin::Pin;
use std::sync::LazyLock;

use rmcp::ErrorData;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, JsonObject, Tool};
use serde::de::DeserializeOwned;

use crate::config::Catalogue;
use crate::guard::{Admitted, Refusal};
use crate::identity::Caller;
use crate::mcp::McpServer;
use crate::state::PaidApi;
use crate::upstream::classes::{ClassId, IMAGE, VIDEO};
use crate::upstream::gate;
use crate::upstream::queue::QueuePlace;

/// What a tool reaches, as the limits and the checks before charging must know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// One request to the paid API, answered when it returns: refused before anything is charged
    /// while the API's circuit breaker is open.
    Upstream,
    /// A job of this class on the paid API: refused before anything is charged while the breaker
    /// is open or the account's queue has no place for it; the call holds the caller's in-flight
    /// slots until the job is final.
    Job(ClassId),
    /// Only the caller's own state (its jobs, its budgets): two callers asking the same get
    /// different answers.
    Caller,
}

/// Whether asking the same again can be a loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repeats {
    /// The same call again counts towards a loop.
    Loop,
    /// Never a loop: asking again is how it is meant to be used, and its answer changes with time.
    Never,
    /// Never a loop while the job its `predict_id` names is pending: a poll is answered with the
    /// wait left, however often it comes. Re-reading a final job is a loop: its answer will not
    /// change.
    WhileJobPending,
}

/// One tool of ours, declared once: everything the router, the catalogue, the checks before
/// charging and loop detection read of it.
pub struct Declaration {
    /// Its name: the name of its `#[tool]` method.
    pub name: &'static str,
    /// What it reaches.
    pub reach: Reach,
    /// Whether asking the same again can be a loop.
    pub repeats: Repeats,
    /// Its arguments checked before anything is charged (their schema, and the limits the
    /// schema cannot say), answered in canonical form: `parse::<T>` of the arguments type `T`
    /// its method takes, or `Err` with what is wrong.
    pub check: fn(Option<&JsonObject>) -> Result<serde_json::Value, String>,
    /// Its `#[tool]` method's description, schemas and annotations, as `tools/list` shows them.
    pub tool: fn() -> Tool,
    /// Its `#[tool]` method, called with what its call was admitted with and its arguments as
    /// `check` answered them.
    pub work: Work,
}

/// A tool's method, as its declaration calls it.
pub type Work = for<'a> fn(&'a McpServer, Admitted<Option<QueuePlace>>, serde_json::Value) -> Working<'a>;

/// A tool's method at work: what it answers, in time (its answer as the guard reads it is core's
/// `Answer`, a tool result).
pub type Working<'a> = Pin<Box<dyn Future<Output = Result<CallToolResult, ErrorData>> + Send + 'a>>;

impl std::fmt::Debug for Declaration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Declaration")
            .field("name", &self.name)
            .field("reach", &self.reach)
            .field("repeats", &self.repeats)
            .finish_non_exhaustive()
    }
}

/// Our tools, each declared once. A tool added is an entry here, its arguments type (`args.rs`) and
/// its `#[tool]` method (`methods.rs`) — and a `[tools.NAME]` price in `config.toml`.
pub static TOOLS: &[Declaration] = &[
    Declaration {
        name: "list_articles",
        reach: Reach::Upstream,
        repeats: Repeats::Loop,
        check: parse::<ListArticlesArgs>,
        tool: McpServer::list_articles_tool_attr,
        work: |server, _, args| Box::pin(async move { server.list_articles(arguments(args)?).await }),
    },
    Declaration {
        name: "save_article",
        reach: Reach::Upstream,
        repeats: Repeats::Loop,
        check: parse::<SaveArticleArgs>,
        tool: McpServer::save_article_tool_attr,
        work: |server, _, args| Box::pin(async move { server.save_article(arguments(args)?).await }),
    },
    Declaration {
        name: "generate_image",
        reach: Reach::Job(IMAGE),
        repeats: Repeats::Loop,
        check: parse::<GenerateImageArgs>,
        tool: McpServer::generate_image_tool_attr,
        work: |server, admitted, args| Box::pin(async move { server.generate_image(arguments(args)?, admitted).await }),
    },
    Declaration {
        name: "generate_image_to_video",
        reach: Reach::Job(VIDEO),
        repeats: Repeats::Loop,
        check: parse::<GenerateVideoArgs>,
        tool: McpServer::generate_image_to_video_tool_attr,
        work: |server, admitted, args| {
            Box::pin(async move { server.generate_image_to_video(arguments(args)?, admitted).await })
        },
    },
    Declaration {
        name: "get_prediction",
        reach: Reach::Caller,
        repeats: Repeats::WhileJobPending,
        check: parse::<PredictionArgs>,
        tool: McpServer::get_prediction_tool_attr,
        work: |server, admitted, args| {
            Box::pin(async move { server.get_prediction(arguments(args)?, admitted.caller).await })
        },
    },
    Declaration {
        name: "cancel_prediction",
        reach: Reach::Caller,
        repeats: Repeats::Loop,
        check: parse::<PredictionArgs>,
        tool: McpServer::cancel_prediction_tool_attr,
        work: |server, admitted, args| {
            Box::pin(async move { server.cancel_prediction(arguments(args)?, admitted.caller).await })
        },
    },
    Declaration {
        name: "rate_limit_status",
        reach: Reach::Caller,
        repeats: Repeats::Never,
        check: parse::<NoArgs>,
        tool: McpServer::rate_limit_status_tool_attr,
        work: |server, admitted, args| {
            Box::pin(async move { server.rate_limit_status(arguments(args)?, admitted.caller).await })
        },
    },
];

/// The declaration of `tool`, if it is one of ours.
pub(crate) fn declared(tool: &str) -> Option<&'static Declaration> {
    TOOLS.iter().find(|d| d.name == tool)
}

/// Our tools as `tools/list` shows them (before their prices are added), built once from their
/// declarations ([`TOOLS`]), in their order.
pub fn listed() -> &'static [Tool] {
    static LISTED: LazyLock<Vec<Tool>> = LazyLock::new(|| TOOLS.iter().map(|d| (d.tool)()).collect());
    &LISTED
}

/// A method's arguments, from the canonical form `check` answered (so they read as it read them).
fn arguments<T: DeserializeOwned>(args: serde_json::Value) -> Result<Parameters<T>, ErrorData> {
    serde_json::from_value(args).map(Parameters).map_err(|e| ErrorData::invalid_params(e.to_string(), None))
}

/// The tools this server offers, as its limits must know them, from their declarations
/// ([`TOOLS`]): a tool declared is in the catalogue (and needs a cost in the config).
pub fn catalogue() -> Catalogue {
    TOOLS.iter().zip(listed()).fold(Catalogue::new(), |catalogue, (tool, listed)| {
        // A price formula may read only the arguments a tool takes.
        let arguments: Vec<String> = listed
            .input_schema
            .get("properties")
            .and_then(|p| p.as_object())
            .map(|p| p.keys().cloned().collect())
            .unwrap_or_default();
        let catalogue = catalogue.arguments(tool.name, arguments);
        match tool.reach {
            Reach::Upstream => catalogue.tool(tool.name),
            Reach::Job(_) => catalogue.job(tool.name),
            Reach::Caller => catalogue.own_answer(tool.name),
        }
    })
}

/// Whether `tool` starts a job that holds in-flight slots until it is final.
pub fn starts_job(tool: &str) -> bool {
    job_class(tool).is_some()
}

/// The class of the jobs `tool` starts, if it starts any.
pub(crate) fn job_class(tool: &str) -> Option<ClassId> {
    match declared(tool)?.reach {
        Reach::Job(class) => Some(class),
        Reach::Upstream | Reach::Caller => None,
    }
}

/// What must hold before `tool` is charged, with what it must carry to the tool body: the
/// upstream must not be known down (circuit breaker open), and a job needs a place in the queue
/// for the upstream account, in case it has to wait for a slot.
pub(crate) fn before_charging(own: &PaidApi, tool: &str, caller: &Caller) -> Result<Option<QueuePlace>, Refusal> {
    let Some(declared) = declared(tool) else { return Ok(None) };
    if declared.reach != Reach::Caller {
        gate::up(tool, own.upstream.open_for(), BREAKER_OPEN)?;
    }
    let Reach::Job(class) = declared.reach else { return Ok(None) };
    gate::place(tool, caller, own.jobs.queue(), class, || own.jobs.place_frees_in()).map(Some)
}

/// Whether this call can never be a loop, as its tool's declaration says ([`Repeats`]): asking
/// again is how it is meant to be used and its answer changes with time.
pub(crate) fn loop_exempt(own: &PaidApi, tool: &str, args: &serde_json::Value, caller: &Caller) -> bool {
    match declared(tool).map(|d| d.repeats) {
        Some(Repeats::Never) => true,
        Some(Repeats::WhileJobPending) => {
            args["predict_id"].as_str().is_some_and(|id| own.jobs.is_pending(caller.id(), id))
        }
        Some(Repeats::Loop) | None => false,
    }
}

/// A busy refusal for a job tool, made specific: the caller's jobs and when to look again.
pub(crate) fn explain_busy(own: &PaidApi, tool: &str, refusal: Refusal, caller: &Caller) -> Refusal {
    let jobs = &own.jobs;
    let mine = jobs.pending_of(caller.id()).into_iter().map(|v| v.prediction.id).collect();
    let advice = "Poll get_prediction for them (or stop one with cancel_prediction) before starting another.";
    refusal.with_jobs_in_flight(tool, mine, advice, jobs.soonest_news(caller.id(), caller.tenant()))
}

mod answers;
mod args;
mod methods;
mod payloads;

pub(crate) use answers::report;
pub use args::{
    GenerateImageArgs, GenerateVideoArgs, ListArticlesArgs, MAX_PROMPT_CHARS, NoArgs, PredictionArgs, SaveArticleArgs,
    validate_arguments,
};
pub use payloads::{JobInFlight, PredictionReport, QueueStatus, StatusReport, Submitted, TierShare, UnverifiedShare};
#[cfg(test)]
mod tests;
