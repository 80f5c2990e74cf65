//! What the live dashboard costs the hot path: nanoseconds per call of [`Activity`], the record
//! the guard and the tool door keep for `GET /dashboard`.
//!
//! Run with `cargo bench --bench activity`. Under `cargo test` each benchmark runs once.
//!
//! * `admitted_roomy` — an admitted tool call whose four scopes (method, caller, tenant, tool
//!   budget) all have room: one atomic increment, and one call in 16 records the levels. This is
//!   what every admitted call of a server with room to spare pays.
//! * `admitted_low` — the same call with its caller budget down to a quarter: every one records.
//! * `refused_http` — a 429 from the HTTP layer (the refusal a flood is made of).
//! * `refused_tool` — a refused tool call with its message.
//! * `snapshot` — what `GET /dashboard/data` reads, with 7 tools × 2 codes and full rings.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use mcp_ratelimit::clock::Nanos;
use mcp_ratelimit::identity::Caller;
use mcp_ratelimit::limit::{Decision, Limiter, TokenBucket};
use mcp_ratelimit::ops::activity::{Activity, Refused, Sample};
use mcp_ratelimit::ops::metrics::Layer;

fn decision(remaining: u64, limit: u64) -> Decision {
    Decision { allowed: true, limit, remaining, retry_after: Nanos::ZERO, reset_after: Nanos::ZERO, at: Nanos::ZERO }
}

fn admitted(c: &mut Criterion) {
    let caller = Caller::from_token("bench-agent");
    let names = [
        format!("method:tools/call:{}", caller.id()),
        format!("caller:{}", caller.id()),
        "tenant:acme".to_owned(),
        "tenant:acme:tool:list_articles".to_owned(),
    ];
    let roomy = [decision(110, 120), decision(50, 60), decision(290, 300), decision(25, 30)];
    let low = [decision(110, 120), decision(10, 60), decision(290, 300), decision(25, 30)];
    // As the guard passes them: each scope's name, and its key and limiter to read it again.
    let limiter = Limiter::TokenBucket(TokenBucket::new(60, 1.0));
    let samples = |decisions: &'static [Decision; 4]| {
        let (names, limiter) = (&names, &limiter);
        move || {
            names.iter().zip(decisions.iter()).map(move |(name, decision)| Sample {
                name,
                decision,
                source: Some((name.as_str(), limiter)),
            })
        }
    };
    let (roomy, low): (&'static [Decision; 4], &'static [Decision; 4]) =
        (Box::leak(Box::new(roomy)), Box::leak(Box::new(low)));
    let activity = Activity::new();
    let mut now = 0;
    let roomy_levels = samples(roomy);
    c.bench_function("admitted_roomy", |b| {
        b.iter(|| {
            now += 1_000;
            activity.admitted(black_box(&caller), roomy_levels(), Nanos::new(now));
        })
    });
    let low_levels = samples(low);
    c.bench_function("admitted_low", |b| {
        b.iter(|| {
            now += 1_000;
            activity.admitted(black_box(&caller), low_levels(), Nanos::new(now));
        })
    });
}

fn refused(c: &mut Criterion) {
    let caller = Caller::from_token("bench-agent");
    let http = format!("http:{}", caller.id());
    let scope = format!("caller:{}", caller.id());
    let activity = Activity::new();
    let mut now = 0;
    c.bench_function("refused_http", |b| {
        b.iter(|| {
            now += 1_000;
            let refused = Refused {
                layer: Layer::Http,
                tool: "POST /mcp",
                code: "rate_limited",
                scope: Some(&http),
                limit: Some(120),
                remaining: Some(0),
                retry_after_ms: Some(500),
                message: "Too many requests: answered 429 before any JSON was read.",
            };
            activity.refused(black_box(&caller), refused, Nanos::new(now));
        })
    });
    c.bench_function("refused_tool", |b| {
        b.iter(|| {
            now += 1_000;
            let refused = Refused {
                layer: Layer::Tool,
                tool: "list_articles",
                code: "rate_limited",
                scope: Some(&scope),
                limit: Some(60),
                remaining: Some(0),
                retry_after_ms: Some(1000),
                message: "Rate limit reached for list_articles. Wait 1 second before calling it again.",
            };
            activity.refused(black_box(&caller), refused, Nanos::new(now));
        })
    });
}

fn snapshot(c: &mut Criterion) {
    let activity = Activity::new();
    let tools = ["list_articles", "save_article", "generate_image", "generate_image_to_video", "get_prediction"];
    for second in 0..600u64 {
        for (i, tool) in tools.iter().chain(["POST /mcp", "tools/list"].iter()).enumerate() {
            let caller = Caller::from_token(&format!("agent-{}", (second as usize + i) % 300));
            let scope = format!("caller:{}", caller.id());
            for code in ["rate_limited", "busy"] {
                let refused = Refused {
                    layer: Layer::Tool,
                    tool,
                    code,
                    scope: Some(&scope),
                    limit: Some(60),
                    remaining: Some(0),
                    retry_after_ms: Some(1000),
                    message: "Rate limit reached.",
                };
                activity.refused(&caller, refused, Nanos::from_secs(second));
            }
        }
    }
    c.bench_function("snapshot", |b| b.iter(|| black_box(activity.snapshot(Nanos::from_secs(600)))));
}

criterion_group!(benches, admitted, refused, snapshot);
criterion_main!(benches);
