//! The tools' `#[tool]` methods: each is called by its entry in [`TOOLS`](super::TOOLS), with what
//! its call was admitted with.

use super::answers::{articles_found, output_schema, report, success, unknown_prediction, upstream_refusal, wait_secs};
use super::args::{GenerateImageArgs, GenerateVideoArgs, ListArticlesArgs, NoArgs, PredictionArgs, SaveArticleArgs};
use super::payloads::{JobInFlight, PredictionReport, QueueStatus, StatusReport, TierShare, UnverifiedShare};
use std::collections::BTreeMap;

use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::{ErrorData, tool};

use crate::guard::{Admitted, Refusal};
use crate::identity::Caller;
use crate::mcp::McpServer;
use crate::mcp::results;
use crate::upstream::api::{NewArticle, NewPrediction, PredictionKind};
use crate::upstream::classes::VIDEO;
use crate::upstream::queue::QueuePlace;

/// The tools' methods: each is called by its entry in [`TOOLS`](super::TOOLS).
impl McpServer {
    /// Lists articles from the upstream, a page at a time.
    #[tool(
        description = "List articles whose titles match a query. Pages with `cursor`.",
        output_schema = output_schema::<crate::upstream::api::ArticlePage>(),
        annotations(read_only_hint = true, open_world_hint = true)
    )]
    pub(super) async fn list_articles(
        &self,
        Parameters(args): Parameters<ListArticlesArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let query = Some(args.query.as_str()).filter(|q| !q.is_empty());
        let cursor = Some(args.cursor.as_str()).filter(|c| !c.is_empty());
        match self.observe("list_articles", self.own.upstream.list_articles(query, args.limit, cursor).await) {
            Ok(page) => {
                let text = articles_found(query, &page);
                success(text, page)
            }
            Err(e) => Ok(upstream_refusal("list_articles", e)),
        }
    }

    /// Saves an article upstream.
    #[tool(
        description = "Save an article (title, body).",
        output_schema = output_schema::<crate::upstream::api::SavedArticle>(),
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = true)
    )]
    pub(super) async fn save_article(
        &self,
        Parameters(args): Parameters<SaveArticleArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let article = NewArticle { title: args.title, body: args.body };
        match self.observe("save_article", self.own.upstream.save_article(&article).await) {
            Ok(saved) => success(format!("Saved article {} \"{}\".", saved.id, saved.title), saved),
            Err(e) => Ok(upstream_refusal("save_article", e)),
        }
    }

    /// Submits an image job.
    #[tool(
        description = "Generate an image from a prompt (at most 4000 characters). Returns at once \
                       with a predict_id; poll get_prediction after next_poll_in_seconds. Each job \
                       holds one of your in-flight slots until it is final.",
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = true)
    )]
    pub(super) async fn generate_image(
        &self,
        Parameters(args): Parameters<GenerateImageArgs>,
        admitted: Admitted<Option<QueuePlace>>,
    ) -> Result<CallToolResult, ErrorData> {
        let job = NewPrediction { kind: PredictionKind::Image, prompt: args.prompt, ..NewPrediction::default() };
        self.start_job("generate_image", job, admitted).await
    }

    /// Accepts a video job into the fair queue, where videos are spaced.
    #[tool(
        description = "Generate a video of `seconds` (1-30, default 5) from an image URL and a prompt. \
                       Returns at once with a predict_id: the job waits its turn in a queue that spaces \
                       submissions to the upstream, and next_poll_in_seconds covers that wait. Each job \
                       holds one of your in-flight slots until it is final. Its price follows its length: \
                       reserved when accepted, settled to what the upstream billed once final.",
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = true)
    )]
    pub(super) async fn generate_image_to_video(
        &self,
        Parameters(args): Parameters<GenerateVideoArgs>,
        admitted: Admitted<Option<QueuePlace>>,
    ) -> Result<CallToolResult, ErrorData> {
        let job = NewPrediction {
            kind: PredictionKind::Video,
            prompt: args.prompt,
            image_url: Some(args.image_url),
            seconds: Some(args.seconds),
            ..NewPrediction::default()
        };
        self.start_job("generate_image_to_video", job, admitted).await
    }

    /// Reads a job's status.
    #[tool(
        description = "Status of an image or video job: starting (perhaps still queued for submission), \
                       processing, succeeded (with output URL), failed (with the reason) or canceled. While \
                       pending it says when to poll next; earlier polls are answered with the wait left.",
        output_schema = output_schema::<PredictionReport>(),
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    pub(super) async fn get_prediction(
        &self,
        Parameters(args): Parameters<PredictionArgs>,
        caller: Caller,
    ) -> Result<CallToolResult, ErrorData> {
        match self.own.jobs.poll(caller.id(), &args.predict_id).await {
            Some(view) => report(view),
            None => Ok(unknown_prediction("get_prediction")),
        }
    }

    /// Cancels one of the caller's jobs.
    #[tool(
        description = "Cancel one of your image or video jobs, upstream too; its in-flight slot is free at \
                       once. A job that already finished keeps its result.",
        output_schema = output_schema::<PredictionReport>(),
        annotations(read_only_hint = false, destructive_hint = true, idempotent_hint = true, open_world_hint = true)
    )]
    pub(super) async fn cancel_prediction(
        &self,
        Parameters(args): Parameters<PredictionArgs>,
        caller: Caller,
    ) -> Result<CallToolResult, ErrorData> {
        match self.own.jobs.cancel(caller.id(), &args.predict_id).await {
            Ok(Some(view)) => report(view),
            Ok(None) => Ok(unknown_prediction("cancel_prediction")),
            Err(e) => Ok(upstream_refusal("cancel_prediction", e)),
        }
    }

    /// The caller's own budgets.
    #[tool(
        description = "Your own budgets: for each scope its algorithm, limit, what remains and when it is full \
                       again (your jobs in flight among them), your jobs in flight, the video submission queue, \
                       and what each tool costs. Free; use it to plan instead of hitting limits.",
        output_schema = output_schema::<StatusReport>(),
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    pub(super) async fn rate_limit_status(
        &self,
        Parameters(_): Parameters<NoArgs>,
        caller: Caller,
    ) -> Result<CallToolResult, ErrorData> {
        let Some(budgets) = self
            .app
            .limits
            .guard()
            .status(&caller, self.transport == crate::mcp::Transport::Http, "rate_limit_status")
            .await
        else {
            return Ok(results::tool_result(&Refusal::limiter_unavailable("rate_limit_status", 1_000)));
        };
        let mut lines: Vec<String> = budgets
            .iter()
            .map(|b| {
                format!(
                    "{}: {} of {} left, full in {} s",
                    b.scope,
                    b.remaining,
                    b.limit,
                    b.reset_after_ms.div_ceil(1000)
                )
            })
            .collect();
        let jobs_in_flight: Vec<JobInFlight> = self
            .own
            .jobs
            .pending_of(caller.id())
            .into_iter()
            .map(|v| JobInFlight {
                next_poll_in_seconds: wait_secs(v.wait.unwrap_or(crate::clock::Nanos::ZERO)),
                queue_position: v.queue_ahead.map(|ahead| ahead + 1),
                predict_id: v.prediction.id,
                kind: v.prediction.kind,
                status: v.prediction.status,
            })
            .collect();
        if !jobs_in_flight.is_empty() {
            let ids: Vec<&str> = jobs_in_flight.iter().map(|j| j.predict_id.as_str()).collect();
            lines.push(format!("jobs in flight: {}", ids.join(", ")));
        }
        let queue = self.own.jobs.queue();
        // The learnt limit another instance may have moved since this one last heard.
        queue.refresh_learnt().await;
        let rules = queue.rules_now();
        let occupancy = self.own.jobs.occupancy();
        let videos = rules.classes.get(VIDEO);
        let upstream_queue = QueueStatus {
            account_in_flight: occupancy.in_flight,
            account_max_in_flight: rules.max_in_flight,
            account_adaptive: queue.is_adaptive(),
            account_ceiling: queue.rules().max_in_flight,
            waiting: occupancy.waiting,
            max_waiting: rules.max_waiting,
            videos_waiting: occupancy.waiting_of(VIDEO),
            max_videos_waiting: videos.and_then(|c| c.queue_max).unwrap_or(0),
            video_min_gap_ms: videos.and_then(|c| c.min_gap).unwrap_or_default().as_u64() / crate::clock::NANOS_PER_MS,
            unverified_share: caller.unverified_from().map(|_| UnverifiedShare {
                in_flight: occupancy.unverified_in_flight,
                max_in_flight: rules.unverified_slots,
                waiting: occupancy.unverified_waiting,
                max_waiting: rules.unverified_places,
            }),
            tier: occupancy.per_tier.into_iter().find(|t| t.tier == caller.tier()).map(|t| TierShare {
                draws_on_reservation: caller.unverified_from().is_none() && t.reserved_slots + t.reserved_places > 0,
                tier: t.tier,
                rank: t.rank,
                reserved_slots: t.reserved_slots,
                reserved_places: t.reserved_places,
                in_flight: t.in_flight,
                waiting: t.waiting,
            }),
        };
        lines.push(format!(
            "upstream account: {} of {} running, {} waiting",
            upstream_queue.account_in_flight, upstream_queue.account_max_in_flight, upstream_queue.waiting
        ));
        let policy = self.app.limits.guard().policy();
        let costs: BTreeMap<String, u64> = policy.tools.iter().map(|(tool, p)| (tool.clone(), p.cost)).collect();
        let cost_formulas: BTreeMap<String, String> =
            policy.tools.iter().filter_map(|(tool, p)| Some((tool.clone(), p.formula.as_ref()?.to_string()))).collect();
        let price: Vec<String> = costs
            .iter()
            .map(|(t, c)| match cost_formulas.get(t) {
                Some(formula) => format!("{t} {formula} (at most {c})"),
                None => format!("{t} {c}"),
            })
            .collect();
        success(
            format!("{}. Costs: {}.", lines.join("; "), price.join(", ")),
            StatusReport {
                caller: caller.id().to_owned(),
                proof: caller.proof().as_str().to_owned(),
                tenant: caller.tenant().map(str::to_owned),
                tier: caller.tier().to_owned(),
                client: caller.client().map(str::to_owned),
                budgets,
                jobs_in_flight,
                upstream_queue,
                costs,
                cost_formulas,
            },
        )
    }
}
