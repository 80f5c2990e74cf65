//! The admin routes: each reads its input strictly (a bad field is a 400 naming it, never a
//! panic), names its target as the server shows callers and tenants, asks the guard or the job
//! book, and answers JSON.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::operator::{OperatorError, Target};
use crate::state::AppState;

/// The longest block: 30 days.
const MAX_BLOCK_MS: u64 = 30 * 86_400 * 1_000;

/// A refusal of the admin API: its status and a JSON body naming what to fix.
#[derive(Debug)]
pub(super) struct Problem {
    status: StatusCode,
    code: &'static str,
    message: String,
    field: Option<String>,
}

impl Problem {
    fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            code: "invalid_request",
            message: message.into(),
            field: Some(field.into()),
        }
    }

    fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self { status: StatusCode::NOT_FOUND, code, message: message.into(), field: None }
    }
}

impl From<OperatorError> for Problem {
    fn from(error: OperatorError) -> Self {
        match error {
            OperatorError::Invalid { field, message } => Problem::invalid(field, message),
            OperatorError::Store(error) => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                code: "store_unavailable",
                message: format!("the limiter store cannot act right now: {error}"),
                field: None,
            },
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut error = json!({"code": self.code, "message": self.message});
        if let Some(field) = self.field {
            error["field"] = json!(field);
        }
        (self.status, Json(json!({ "error": error }))).into_response()
    }
}

type RouteResult = Result<Json<Value>, Problem>;

/// The JSON object of a request body (an empty body is an empty object), refusing fields the
/// route does not take.
fn body_object(body: &Bytes, fields: &[&str]) -> Result<Map<String, Value>, Problem> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(body) else {
        return Err(Problem::invalid("body", "must be a JSON object"));
    };
    if let Some(unknown) = object.keys().find(|k| !fields.contains(&k.as_str())) {
        let message = format!("unknown field; this route takes {}", fields.join(", "));
        return Err(Problem::invalid(unknown.as_str(), message));
    }
    Ok(object)
}

/// A whole number in `min..=max` under `field`.
fn whole(object: &Map<String, Value>, field: &'static str, min: u64, max: u64) -> Result<Option<u64>, Problem> {
    let Some(value) = object.get(field) else { return Ok(None) };
    match value.as_u64() {
        Some(n) if (min..=max).contains(&n) => Ok(Some(n)),
        _ => Err(Problem::invalid(field, format!("must be a whole number from {min} to {max} (got {value})"))),
    }
}

/// A string under `field`.
fn text<'a>(object: &'a Map<String, Value>, field: &'static str) -> Result<Option<&'a str>, Problem> {
    match object.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(Problem::invalid(field, format!("must be a string (got {other})"))),
    }
}

/// The caller an operator names in the path (and, for a made-up key, `from` in the query).
fn caller_target(app: &AppState, id: &str, query: &HashMap<String, String>) -> Result<Target, Problem> {
    use crate::identity::UnknownCaller;
    let identifier = app.limits.identifier().load();
    let named = if id.starts_with("sub:") {
        // A token's subject: its id says nothing of the tenant, tier and client its budgets are
        // kept under, so the operator names them as the dashboard and rate_limit_status show them.
        let field = |name: &str| query.get(name).map(String::as_str);
        identifier.subject_by_id(id, field("tenant"), field("tier"), field("client"))
    } else {
        identifier.by_id(id, query.get("from").map(String::as_str))
    };
    match named {
        Ok(caller) => Ok(Target::Caller(caller)),
        Err(e @ UnknownCaller::Malformed(_)) => Err(Problem::invalid("caller", e.to_string())),
        Err(e @ UnknownCaller::BadAddress(_)) => Err(Problem::invalid("from", e.to_string())),
        Err(e @ UnknownCaller::UnknownTier(_)) => Err(Problem::invalid("tier", e.to_string())),
        Err(e @ UnknownCaller::NeedsAddress(_)) => Err(Problem::not_found("unknown_caller", e.to_string())),
    }
}

/// The tenant named in the path: one a configured key belongs to.
fn tenant_target(app: &AppState, tenant: &str) -> Result<Target, Problem> {
    app.limits
        .identifier()
        .load()
        .member_of(tenant)
        .map(Target::Tenant)
        .ok_or_else(|| Problem::not_found("unknown_tenant", format!("no configured key belongs to tenant `{tenant}`")))
}

pub(super) async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], super::openapi()).into_response()
}

pub(super) async fn no_such_route() -> Problem {
    Problem::not_found("no_such_route", "no such admin route; GET /admin/openapi.json lists them")
}

/// Every configured key's caller id, tenant and tier — never the key.
pub(super) async fn keys(State(app): State<Arc<AppState>>) -> RouteResult {
    tracing::info!(action = "list_keys", "admin action");
    let keys: Vec<Value> = app
        .config
        .limiting
        .auth
        .keys
        .iter()
        .enumerate()
        .filter_map(|(i, key)| {
            let caller = app.limits.identifier().load().configured(&key.sha256)?;
            Some(json!({"config": format!("auth.keys[{i}]"), "caller": caller.id(), "tenant": caller.tenant(),
                        "tier": caller.tier()}))
        })
        .collect();
    Ok(Json(json!({ "keys": keys })))
}

async fn inspect(app: &AppState, target: Target) -> RouteResult {
    tracing::info!(action = "inspect", target = %target.label(), "admin action");
    let budgets = app.limits.guard().budgets(&target).await?;
    let blocks = app.limits.guard().blocks(&target).await?;
    let mut answer = json!({"budgets": budgets, "blocks": blocks});
    match &target {
        Target::Caller(caller) => {
            answer["caller"] = json!(caller.id());
            answer["tenant"] = json!(caller.tenant());
            answer["tier"] = json!(caller.tier());
        }
        Target::Tenant(member) => {
            let tenant = member.tenant().unwrap_or_default();
            let callers: Vec<String> = app
                .config
                .limiting
                .auth
                .keys
                .iter()
                .filter(|k| k.tenant.as_deref() == Some(tenant))
                .filter_map(|k| Some(app.limits.identifier().load().configured(&k.sha256)?.id().to_owned()))
                .collect();
            answer["tenant"] = json!(tenant);
            answer["callers"] = json!(callers);
        }
    }
    Ok(Json(answer))
}

async fn reset(app: &AppState, target: Target, body: &Bytes) -> RouteResult {
    let body = body_object(body, &["scope"])?;
    let scopes = app.limits.guard().reset(&target, text(&body, "scope")?).await?;
    Ok(Json(json!({ "reset": scopes })))
}

async fn refund(app: &AppState, target: Target, body: &Bytes) -> RouteResult {
    let body = body_object(body, &["units", "scope"])?;
    let units = whole(&body, "units", 1, u64::from(u32::MAX))?
        .ok_or_else(|| Problem::invalid("units", "required: how many units to give back"))?;
    let budget = app.limits.guard().refund(&target, text(&body, "scope")?, units).await?;
    Ok(Json(json!({ "refunded": units, "budget": budget })))
}

async fn block(app: &AppState, target: Target, body: &Bytes) -> RouteResult {
    let body = body_object(body, &["duration_ms"])?;
    let ms = whole(&body, "duration_ms", 1, MAX_BLOCK_MS)?
        .ok_or_else(|| Problem::invalid("duration_ms", "required: how long the block holds, in milliseconds"))?;
    let blocked = app.limits.guard().block(&target, Duration::from_millis(ms)).await?;
    Ok(Json(json!({ "blocked": blocked })))
}

async fn unblock(app: &AppState, target: Target) -> RouteResult {
    let lifted = app.limits.guard().unblock(&target).await?;
    Ok(Json(json!({ "lifted": lifted })))
}

pub(super) async fn inspect_caller(
    State(app): State<Arc<AppState>>,
    Path(caller): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> RouteResult {
    let target = caller_target(&app, &caller, &query)?;
    inspect(&app, target).await
}

pub(super) async fn reset_caller(
    State(app): State<Arc<AppState>>,
    Path(caller): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    body: Bytes,
) -> RouteResult {
    let target = caller_target(&app, &caller, &query)?;
    reset(&app, target, &body).await
}

pub(super) async fn refund_caller(
    State(app): State<Arc<AppState>>,
    Path(caller): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    body: Bytes,
) -> RouteResult {
    let target = caller_target(&app, &caller, &query)?;
    refund(&app, target, &body).await
}

pub(super) async fn block_caller(
    State(app): State<Arc<AppState>>,
    Path(caller): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    body: Bytes,
) -> RouteResult {
    let target = caller_target(&app, &caller, &query)?;
    block(&app, target, &body).await
}

pub(super) async fn unblock_caller(
    State(app): State<Arc<AppState>>,
    Path(caller): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> RouteResult {
    let target = caller_target(&app, &caller, &query)?;
    unblock(&app, target).await
}

pub(super) async fn inspect_tenant(State(app): State<Arc<AppState>>, Path(tenant): Path<String>) -> RouteResult {
    let target = tenant_target(&app, &tenant)?;
    inspect(&app, target).await
}

pub(super) async fn reset_tenant(
    State(app): State<Arc<AppState>>,
    Path(tenant): Path<String>,
    body: Bytes,
) -> RouteResult {
    let target = tenant_target(&app, &tenant)?;
    reset(&app, target, &body).await
}

pub(super) async fn refund_tenant(
    State(app): State<Arc<AppState>>,
    Path(tenant): Path<String>,
    body: Bytes,
) -> RouteResult {
    let target = tenant_target(&app, &tenant)?;
    refund(&app, target, &body).await
}

pub(super) async fn block_tenant(
    State(app): State<Arc<AppState>>,
    Path(tenant): Path<String>,
    body: Bytes,
) -> RouteResult {
    let target = tenant_target(&app, &tenant)?;
    block(&app, target, &body).await
}

pub(super) async fn unblock_tenant(State(app): State<Arc<AppState>>, Path(tenant): Path<String>) -> RouteResult {
    let target = tenant_target(&app, &tenant)?;
    unblock(&app, target).await
}

/// Jobs not yet final: all, a caller's (`caller=`) or a tenant's (`tenant=`).
pub(super) async fn jobs(
    State(app): State<Arc<AppState>>,
    Query(query): Query<HashMap<String, String>>,
) -> RouteResult {
    if let Some(unknown) = query.keys().find(|k| !matches!(k.as_str(), "caller" | "tenant" | "from")) {
        return Err(Problem::invalid(unknown.as_str(), "unknown parameter; this route takes caller, tenant"));
    }
    let caller = match query.get("caller") {
        // A made-up key's jobs are found by its id alone: its address is not needed for that.
        Some(id) => match caller_target(&app, id, &query) {
            Ok(_) | Err(Problem { code: "unknown_caller", .. }) => Some(id.clone()),
            Err(problem) => return Err(problem),
        },
        None => None,
    };
    let tenant = match query.get("tenant") {
        Some(tenant) => Some(tenant_target(&app, tenant).map(|_| tenant.clone())?),
        None => None,
    };
    let jobs = match app.behind.jobs() {
        Some(jobs) => jobs.in_flight_of(caller.as_deref(), tenant.as_deref()).await,
        // A proxy runs no jobs of its own.
        None => Vec::new(),
    };
    tracing::info!(
        action = "list_jobs",
        caller = caller.as_deref(),
        tenant = tenant.as_deref(),
        count = jobs.len(),
        "admin action"
    );
    Ok(Json(json!({ "jobs": jobs })))
}

/// Cancels a job, whoever's it is, on whichever instance holds it.
pub(super) async fn cancel_job(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> RouteResult {
    let unknown = || Problem::not_found("unknown_job", format!("no job `{id}` is known"));
    let jobs = app.behind.jobs().ok_or_else(unknown)?;
    let owner = jobs.owner_of(&id).await.ok_or_else(unknown)?;
    match jobs.cancel(&owner, &id).await {
        Ok(Some(view)) => {
            tracing::info!(action = "cancel_job", predict_id = %id, caller = %owner, "admin action");
            Ok(Json(json!({"predict_id": id, "caller": owner, "status": view.prediction.status})))
        }
        Ok(None) => Err(unknown()),
        Err(error) => Err(Problem {
            status: StatusCode::BAD_GATEWAY,
            code: "upstream_unavailable",
            message: format!("the job could not be cancelled upstream: {error}"),
            field: None,
        }),
    }
}
