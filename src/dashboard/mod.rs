//! The live dashboard: `GET /dashboard`, a page served by the server itself, and
//! `GET /dashboard/data`, the JSON it polls once a second.
//!
//! The page is plain HTML, CSS and JavaScript compiled into the binary (`include_str!`): no build
//! step, no CDN, nothing fetched from anywhere but this server, so it works with no network. It
//! shows which tool is refused, for whom (a hashed caller and its bucket) and why, the busiest
//! budgets with their level, the jobs in flight per tenant, the upstream account's queue, the
//! circuit breaker and the limiter store. The data comes from [`Activity`](crate::ops::activity) (the
//! last ten minutes of refusals and sampled levels) and from live state read when it is asked
//! for, like the gauges of `/metrics`.
//!
//! Like `/metrics` it is never limited; like `/mcp` it sits behind the DNS-rebinding protection
//! (a foreign `Host` or `Origin` gets 403), so a web page elsewhere cannot read it through the
//! user's browser. It is read-only and names nobody: callers and addresses only hashed. The page
//! runs under a Content-Security-Policy that allows nothing but this server's own script, style
//! and data, and it writes every value into the DOM as text.
//!
//! Tenants are named, and refusal messages say what each tenant does. So with `auth.required`
//! the data is no longer public: `/dashboard/data` needs a key, like `/mcp` (401 with
//! `WWW-Authenticate: Bearer` otherwise), and shows a configured key the rows of its own tenant
//! (a key without a tenant: its own), the admin key everything ([`Audience`]). The counts per
//! tool, the totals and the account's queue name nobody and are shown to both. The page itself
//! stays public: it asks for the key, keeps it in the tab's `sessionStorage` and sends it as a
//! Bearer header.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{HeaderMap, HeaderValue, header};
use serde::Serialize;

use crate::breaker::BreakerState;
use crate::clock::NANOS_PER_MS;
use crate::config::Backend;
use crate::guard::reuse::Saved;
use crate::http::identify::Denied;
use crate::identity::Caller;
use crate::ops::activity::{Activity, Audience, Snapshot};
use crate::state::AppState;

const PAGE: &str = include_str!("dashboard.html");
const SCRIPT: &str = include_str!("dashboard.js");
const STYLE: &str = include_str!("dashboard.css");

/// Only this server's own script, style and data; no inline code, no framing, no forms.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; \
                   base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The dashboard's routes (the caller puts the DNS-rebinding protection in front).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/dashboard", get(|| async { guarded("text/html; charset=utf-8", PAGE) }))
        .route("/dashboard/dashboard.js", get(|| async { guarded("text/javascript; charset=utf-8", SCRIPT) }))
        .route("/dashboard/dashboard.css", get(|| async { guarded("text/css; charset=utf-8", STYLE) }))
        .route("/dashboard/data", get(data))
}

/// A response with the headers every dashboard answer carries: no sniffing, no caching (the page
/// and its data change with the binary and with every second), no framing, no referrer.
fn guarded(content_type: &'static str, body: impl IntoResponse) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_TYPE, content_type),
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::CACHE_CONTROL, "no-store"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// Who asks for the data: anyone (no key required), the operator (the admin key), or a
/// configured key's caller.
enum Viewer {
    Anyone,
    Operator,
    Key(Caller),
}

impl Viewer {
    /// The viewer `headers` prove, or why they prove none while `auth.required` is on (read from
    /// the live identifier, so a reload that turns it on closes the data at once).
    async fn of(app: &AppState, headers: &HeaderMap) -> Result<Self, Denied> {
        if !app.limits.identifier().load().required() {
            return Ok(Viewer::Anyone);
        }
        if app.config.admin.key_sha256.is_some_and(|key| crate::admin::presents_key(headers, &key)) {
            return Ok(Viewer::Operator);
        }
        // With auth required, only a configured key or a valid access token names a caller.
        app.limits.callers().name(headers, None).await.map(Viewer::Key)
    }

    fn audience(&self) -> Audience<'_> {
        match self {
            Viewer::Anyone | Viewer::Operator => Audience::Everyone,
            Viewer::Key(caller) => Audience::Of(caller),
        }
    }

    /// Whose rows the data holds, for the page to say.
    fn describe(&self, app: &AppState) -> String {
        match self {
            Viewer::Anyone => "everyone".to_owned(),
            Viewer::Operator => "everyone (admin key)".to_owned(),
            Viewer::Key(caller) => match caller.tenant() {
                Some(tenant) => format!("tenant {tenant}"),
                None => format!("caller {}", app.limits.guard().activity().hashed(caller.id())),
            },
        }
    }
}

async fn data(State(app): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let viewer = match Viewer::of(&app, &headers).await {
        Ok(viewer) => viewer,
        Err(denied) => {
            tracing::debug!(message = %denied.message, "dashboard data refused");
            let body = serde_json::json!({"error": {"code": "unauthorized",
                "message": format!("{}: auth.required is on, so the dashboard's data needs \
                                    `Authorization: Bearer <a configured key, an access token or the admin key>`",
                                   denied.message)}});
            let mut response = guarded("application/json", (denied.status, body.to_string()));
            response.headers_mut().insert(header::WWW_AUTHENTICATE, denied.challenge.clone());
            return response;
        }
    };
    match serde_json::to_string(&DashboardData::read(&app, &viewer).await) {
        Ok(json) => guarded("application/json", json),
        Err(error) => {
            tracing::warn!(%error, "cannot encode the dashboard's data");
            guarded("application/json", (http::StatusCode::INTERNAL_SERVER_ERROR, "{}"))
        }
    }
}

/// Everything the page shows, read at one instant of the server's clock.
#[derive(Debug, Serialize)]
struct DashboardData {
    /// The server's clock, in milliseconds since it started.
    now_ms: u64,
    /// Whether limits are enforced at all (`limits.enabled`).
    limits_enabled: bool,
    /// Whose refusals, budgets and jobs are listed: `everyone`, `tenant acme`, `caller #3fa2c1`.
    showing: String,
    #[serde(flatten)]
    activity: Snapshot,
    jobs: JobsNow,
    /// Tool calls answered without an upstream request of their own, since start, everyone's.
    saved: Saved,
    breaker: BreakerNow,
    store: StoreNow,
}

/// Jobs in flight and the upstream account's queue.
#[derive(Debug, Serialize)]
struct JobsNow {
    /// Jobs not final yet, everyone's.
    in_flight: usize,
    /// Per tenant (or hashed caller without one) the viewer may see: running and waiting jobs,
    /// most first.
    per_owner: Vec<OwnerJobs>,
    /// The upstream account's slots in use, and how many it has.
    account_in_use: usize,
    account_max: usize,
    /// The static cap: `account_max` is learnt when it differs (`[upstream.adaptive]`).
    account_ceiling: usize,
    /// This instance's jobs' slots: `busy` before their expected end, `held_idle` past it and not
    /// yet known final (most likely ended, the server yet to learn it); and the account's free
    /// slots.
    account_busy: usize,
    account_held_idle: usize,
    account_free: usize,
    /// Whether job ends come by webhook (`upstream.webhook_url`), else by polls only; `None` in
    /// front of a proxied server (no jobs of ours).
    webhooks: Option<bool>,
    /// Jobs waiting for an account slot, and the most that may.
    queue_waiting: usize,
    queue_max: usize,
    /// Videos among them, and the most that may wait.
    videos_waiting: usize,
    videos_max: usize,
    /// Per tier with a reserved share or a rank (`[upstream.reserved]`, `[upstream.priority]`).
    tiers: Vec<TierNow>,
}

/// One tier's share of the account and the queue.
#[derive(Debug, Serialize)]
struct TierNow {
    tier: String,
    /// Its rank when the account is full.
    rank: i64,
    /// Slots its jobs hold, and the slots reserved for it.
    in_use: usize,
    reserved_slots: usize,
    /// Its jobs waiting, and the places reserved for it.
    waiting: usize,
    reserved_places: usize,
}

#[derive(Debug, Serialize)]
struct OwnerJobs {
    /// `tenant acme`, or `caller #3fa2c1` for a caller without a tenant.
    owner: String,
    running: usize,
    waiting: usize,
}

#[derive(Debug, Serialize)]
struct BreakerNow {
    /// `closed`, `half_open` or `open`.
    state: &'static str,
    /// While open: milliseconds until one probe may go.
    open_for_ms: Option<u64>,
    /// Consecutive failures that open it.
    failures_to_open: u32,
}

#[derive(Debug, Serialize)]
struct StoreNow {
    /// `memory` or `redis`.
    backend: &'static str,
    /// Whether the last decision on it succeeded.
    up: bool,
    /// Budget slices this instance holds of Redis's: the keys, and the units in them.
    slice_keys: u64,
    slice_units: u64,
}

impl JobsNow {
    /// The jobs and the account as `audience` may see them (a caller without a tenant by its hash).
    fn read(app: &AppState, audience: &Audience<'_>, activity: &Activity) -> Self {
        let mut per_owner: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        let pending = app.behind.jobs().map(|jobs| jobs.pending_owners()).unwrap_or_default();
        let in_flight = pending.len();
        for (owner, started) in pending {
            if !audience.sees_job(&owner.caller, owner.tenant.as_deref()) {
                continue;
            }
            let name = match &owner.tenant {
                Some(tenant) => format!("tenant {tenant}"),
                None => format!("caller {}", activity.hashed(&owner.caller)),
            };
            let counts = per_owner.entry(name).or_default();
            if started {
                counts.0 += 1;
            } else {
                counts.1 += 1;
            }
        }
        let mut per_owner: Vec<OwnerJobs> =
            per_owner.into_iter().map(|(owner, (running, waiting))| OwnerJobs { owner, running, waiting }).collect();
        per_owner.sort_by_key(|o| std::cmp::Reverse(o.running + o.waiting));
        let occupancy = app.behind.occupancy();
        let jobs = app.behind.jobs();
        let slots = jobs.map(|jobs| jobs.account_slots());
        let upstream = &app.config.upstream;
        JobsNow {
            in_flight,
            per_owner,
            account_in_use: occupancy.in_flight,
            account_max: app.behind.slots(),
            account_ceiling: app.behind.ceiling(),
            account_busy: slots.map_or(0, |s| s.busy),
            account_held_idle: slots.map_or(0, |s| s.held_idle),
            account_free: slots.map_or_else(|| app.behind.slots().saturating_sub(occupancy.in_flight), |s| s.free),
            webhooks: jobs.map(|jobs| jobs.cadence().webhooks()),
            queue_waiting: occupancy.waiting,
            queue_max: upstream.queue_max,
            videos_waiting: occupancy.waiting_of(crate::upstream::classes::VIDEO),
            videos_max: upstream.video_queue_max,
            tiers: occupancy
                .per_tier
                .iter()
                .map(|t| TierNow {
                    tier: t.tier.clone(),
                    rank: t.rank,
                    in_use: t.in_flight,
                    reserved_slots: t.reserved_slots,
                    waiting: t.waiting,
                    reserved_places: t.reserved_places,
                })
                .collect(),
        }
    }
}

impl DashboardData {
    async fn read(app: &AppState, viewer: &Viewer) -> Self {
        let now = app.clock.now();
        let guard = app.limits.guard();
        let activity = guard.activity();
        let audience = viewer.audience();
        let mut recent = activity.snapshot_for(now, audience);
        guard.current_levels(&mut recent.scopes).await;
        // The account's learnt limit as every instance shares it, not as this one last heard.
        app.behind.queue().refresh_learnt().await;
        let upstream = &app.config.upstream;
        let breaker = match app.behind.breaker().state(now) {
            BreakerState::Closed => "closed",
            BreakerState::HalfOpen => "half_open",
            BreakerState::Open => "open",
        };
        let (slice_keys, slice_units) = guard.store().slices_held();
        Self {
            now_ms: now.as_u64() / NANOS_PER_MS,
            limits_enabled: app.limits.guard().enabled(),
            showing: viewer.describe(app),
            activity: recent,
            jobs: JobsNow::read(app, &audience, activity),
            saved: app.limits.reuse().saved(),
            breaker: BreakerNow {
                state: breaker,
                open_for_ms: app.behind.breaker().open_for(now).map(crate::clock::ceil_ms),
                failures_to_open: upstream.breaker_failures,
            },
            store: StoreNow {
                backend: match app.config.limiting.store.backend {
                    Backend::Memory => "memory",
                    Backend::Redis => "redis",
                },
                up: app.limits.guard().store_up(),
                slice_keys,
                slice_units,
            },
        }
    }
}
