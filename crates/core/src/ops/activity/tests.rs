//! The dashboard record's tests: refusals counted and grouped, levels sampled, audiences kept
//! apart, and callers stored only hashed, in bounded memory.

use super::{Activity, Audience, BUCKETS, LATEST, MAX_SCOPES, Refused, SAMPLE_EVERY, Sample, Snapshot};
use crate::clock::Nanos;
use crate::identity::Caller;
use crate::limit::Decision;
use crate::ops::metrics::Layer;

fn sample<'a>(name: &'a str, decision: &'a Decision) -> Sample<'a> {
    Sample { name, decision, source: None }
}

#[test]
fn a_debug_print_never_shows_the_hash_key() {
    let activity = Activity::new();
    let printed = format!("{activity:?}{activity:#?}");
    assert!(!printed.contains(&activity.key.to_string()), "{printed}");
    assert!(printed.contains("admitted"), "{printed}");
}

fn refused<'a>(tool: &'a str, scope: &'a str, message: &'a str) -> Refused<'a> {
    Refused {
        layer: Layer::Tool,
        tool,
        code: "rate_limited",
        scope: Some(scope),
        limit: Some(60),
        remaining: Some(0),
        retry_after_ms: Some(1000),
        message,
    }
}

#[test]
fn identical_refusals_in_a_row_are_one_row_with_their_count() {
    let activity = Activity::new();
    let (one, other) = (Caller::from_token("one"), Caller::from_token("other"));
    for at in 0..12 {
        activity.refused(&one, refused("POST /mcp", "http:x", "wait"), Nanos::from_secs(at));
    }
    activity.refused(&other, refused("POST /mcp", "http:y", "wait"), Nanos::from_secs(12));
    activity.refused(&one, refused("POST /mcp", "http:x", "wait 2"), Nanos::from_secs(13));
    activity.refused(&one, refused("list_articles", "caller:x", "wait"), Nanos::from_secs(14));
    let latest = activity.snapshot(Nanos::from_secs(14)).latest;
    let rows: Vec<(&str, u32, u64)> = latest.iter().map(|r| (r.tool.as_str(), r.count, r.ago_ms)).collect();
    // Newest first; another caller between two runs keeps them apart; a changed wait does not.
    assert_eq!(
        rows,
        vec![("list_articles", 1, 0), ("POST /mcp", 1, 1000), ("POST /mcp", 1, 2000), ("POST /mcp", 12, 3000)]
    );
}

#[test]
fn counts_land_in_their_bucket_and_leave_the_window_after_ten_minutes() {
    let activity = Activity::new();
    let caller = Caller::from_token("agent");
    for at in [0, 1, 2] {
        activity.refused(&caller, refused("list_articles", "caller:x", "wait"), Nanos::from_secs(at));
    }
    activity.refused(&caller, refused("list_articles", "caller:x", "wait"), Nanos::from_secs(15));
    let snap = activity.snapshot(Nanos::from_secs(15));
    let tool = &snap.tools[0];
    assert_eq!((tool.refused, snap.refused_in_window, snap.refused_total), (4, 4, 4));
    assert_eq!(&tool.per_bucket[BUCKETS - 2..], &[3, 1]);
    // 590 s later the first bucket has left the window; the second is its oldest.
    let snap = activity.snapshot(Nanos::from_secs(15 + 590));
    assert_eq!(snap.tools[0].per_bucket[0], 1);
    assert_eq!(snap.tools[0].refused, 1);
    let snap = activity.snapshot(Nanos::from_secs(20 * 60));
    assert!(snap.tools.is_empty() && snap.latest.is_empty() && snap.scopes.is_empty(), "{snap:?}");
    assert_eq!(snap.refused_total, 4, "the total counts since start");
    // A lap later the ring's slots are reused from zero.
    activity.refused(&caller, refused("list_articles", "caller:x", "wait"), Nanos::from_secs(20 * 60));
    assert_eq!(activity.snapshot(Nanos::from_secs(20 * 60)).tools[0].per_bucket.iter().sum::<u32>(), 1);
}

#[test]
fn an_audience_of_one_key_sees_its_tenants_rows_or_its_own() {
    use sha2::Digest as _;
    let key = |name: &str, tenant: Option<&str>| {
        let key = crate::config::ApiKey {
            sha256: sha2::Sha256::digest(name.as_bytes()).into(),
            tenant: tenant.map(str::to_owned),
            tier: "default".to_owned(),
            caller: None,
        };
        Caller::of_key(&key, &crate::identity::CallerIds::unkeyed())
    };
    let (acme, acme_too, globex) = (key("a", Some("acme")), key("b", Some("acme")), key("g", Some("globex")));
    let (carol, dave) = (key("c", None), key("d", None));
    let activity = Activity::new();
    let d = Decision {
        allowed: true,
        limit: 60,
        remaining: 1,
        retry_after: Nanos::ZERO,
        reset_after: Nanos::ZERO,
        at: Nanos::ZERO,
    };
    for caller in [&acme, &acme_too, &globex, &carol, &dave] {
        let own = format!("caller:{}", caller.id());
        activity.refused(caller, refused("list_articles", &own, "wait"), Nanos::ZERO);
        let shared = format!("tenant:{}", caller.tenant().unwrap_or("-"));
        activity.admitted(caller, [sample(shared.as_str(), &d)].into_iter(), Nanos::ZERO);
    }
    let everyone = activity.snapshot(Nanos::ZERO);
    assert_eq!((everyone.latest.len(), everyone.scopes.len()), (5, 8));
    let seen = |viewer: &Caller| activity.snapshot_for(Nanos::ZERO, Audience::Of(viewer));
    let of_acme = seen(&acme_too);
    assert_eq!(of_acme.latest.len(), 2, "both acme callers' refusals");
    assert!(of_acme.latest.iter().all(|r| r.tenant.as_deref() == Some("acme")));
    assert_eq!(of_acme.scopes.iter().filter(|s| s.scope == "tenant:acme").count(), 1);
    assert_eq!(of_acme.scopes.len(), 3, "acme's budget and both its callers'");
    let of_carol = seen(&carol);
    assert_eq!(of_carol.latest.len(), 1, "only carol's own: {of_carol:?}");
    assert_eq!(of_carol.latest[0].caller, activity.hashed(carol.id()));
    let scopes: Vec<&str> = of_carol.scopes.iter().map(|s| s.scope.as_str()).collect();
    assert_eq!(scopes, [format!("caller:{}", activity.hashed(carol.id()))], "not dave's, tenant-less too");
    assert_eq!((of_carol.refused_total, of_carol.tools.len()), (5, 1), "the counts are everyone's");
    assert!(Audience::Of(&carol).sees_job(carol.id(), None) && !Audience::Of(&carol).sees_job(dave.id(), None));
    assert!(Audience::Of(&acme).sees_job(acme_too.id(), Some("acme")));
    assert!(!Audience::Of(&acme).sees_job(globex.id(), Some("globex")));
}

#[test]
fn callers_and_addresses_are_stored_only_hashed() {
    let activity = Activity::new();
    let caller = Caller::from_token("sk-secret");
    let scope = format!("caller:{}", caller.id());
    let message = format!("refused for {}", caller.id());
    activity.refused(&caller, refused("generate_image", &scope, &message), Nanos::ZERO);
    let d = Decision {
        allowed: true,
        limit: 60,
        remaining: 1,
        retry_after: Nanos::ZERO,
        reset_after: Nanos::ZERO,
        at: Nanos::ZERO,
    };
    let method = format!("method:tools/call:{}", caller.id());
    activity.admitted(&caller, [sample(method.as_str(), &d)].into_iter(), Nanos::ZERO);
    let json = serde_json::to_string(&activity.snapshot(Nanos::ZERO)).expect("json");
    assert!(!json.contains(caller.id()) && !json.contains(&caller.id()[4..]), "{json}");
    let hashed = activity.hashed(caller.id());
    assert!(json.contains(&format!("caller:{hashed}")) && json.contains(&format!("method:tools/call:{hashed}")));
    assert!(json.contains(&format!("\"caller\":\"{hashed}\"")), "{json}");
    assert!(json.contains(&format!("\"bucket\":\"b{:02}\"", caller.bucket())), "{json}");
}

#[test]
fn an_unverified_callers_id_and_address_are_both_hashed_wherever_they_appear() {
    let activity = Activity::new();
    let identifier = crate::identity::Identifier::new(
        &crate::config::LimitsConfig::from_toml("", &crate::config::Catalogue::new()).expect("defaults"),
    );
    let mut headers = http::HeaderMap::new();
    headers.insert("x-api-key", http::HeaderValue::from_static("made-up"));
    let caller = identifier
        .identify(&headers, Some([203, 0, 113, 9].into()))
        .map(crate::identity::Identity::without_verifying)
        .expect("a caller");
    let address = caller.unverified_from().expect("unverified").to_owned();
    let text = format!("{address} then {} then address:{address}", caller.id());
    let (a, c) = (activity.hashed(&address), activity.hashed(caller.id()));
    assert_eq!(activity.redact(&text, &caller), format!("{a} then {c} then address:{a}"));
    assert_eq!(activity.redact("tenant:acme", &caller), "tenant:acme");
}

#[test]
fn levels_are_sampled_now_and_then_and_whenever_a_scope_runs_low() {
    let activity = Activity::new();
    let caller = Caller::from_token("agent");
    let roomy = Decision {
        allowed: true,
        limit: 100,
        remaining: 90,
        retry_after: Nanos::ZERO,
        reset_after: Nanos::ZERO,
        at: Nanos::ZERO,
    };
    for _ in 1..SAMPLE_EVERY * 2 {
        activity.admitted(&caller, [sample("tenant:roomy", &roomy)].into_iter(), Nanos::ZERO);
    }
    let low = Decision { remaining: 20, ..roomy };
    activity.admitted(&caller, [sample("tenant:low", &low)].into_iter(), Nanos::ZERO);
    // A loop stop is a refusal, not a budget with a level.
    activity.refused(&caller, refused("list_articles", "loop:list_articles", "loop"), Nanos::ZERO);
    let snap = activity.snapshot(Nanos::ZERO);
    assert_eq!(snap.latest[0].scope.as_deref(), Some("loop:list_articles"));
    assert_eq!(snap.admitted_total, SAMPLE_EVERY * 2);
    let level = |name: &str| snap.scopes.iter().find(|s| s.scope == name).map(|s| s.remaining);
    assert_eq!(level("tenant:roomy"), Some(90), "sampled: {:?}", snap.scopes);
    assert_eq!(level("tenant:low"), Some(20), "the 32nd call was not due a sample, but it ran low");
    assert_eq!(snap.scopes.len(), 2, "{:?}", snap.scopes);
    assert_eq!(snap.scopes[0].scope, "tenant:low", "the fuller scope ranks first");
}

#[test]
fn a_level_is_read_again_from_where_its_last_call_found_it_until_the_limits_change() {
    use crate::limit::{Concurrency, Limiter};
    let activity = Activity::new();
    let caller = Caller::from_token("agent");
    let slots = Limiter::Concurrency(Concurrency::new(5));
    let key = format!("in_flight:caller:{}", caller.id());
    let held = Decision {
        allowed: true,
        limit: 5,
        remaining: 4,
        retry_after: Nanos::ZERO,
        reset_after: Nanos::ZERO,
        at: Nanos::ZERO,
    };
    let sample = Sample { name: &key, decision: &held, source: Some((&key, &slots)) };
    activity.admitted(&caller, [sample].into_iter(), Nanos::ZERO);
    let source = |snap: Snapshot| snap.scopes[0].source.clone().map(|s| (s.key.to_string(), s.limiter));
    assert_eq!(source(activity.snapshot(Nanos::ZERO)), Some((key.clone(), slots.clone())), "the raw key, never shown");
    assert!(!serde_json::to_string(&activity.snapshot(Nanos::ZERO)).expect("JSON").contains(caller.id()));
    activity.limits_changed();
    assert_eq!(source(activity.snapshot(Nanos::ZERO)), None, "the old limiter would read the old limit");
}

#[test]
fn memory_stays_bounded_by_the_latest_and_the_scope_caps() {
    let activity = Activity::new();
    for i in 0..(MAX_SCOPES * 2) {
        let caller = Caller::from_token(&format!("agent-{i}"));
        let scope = format!("caller:{}", caller.id());
        activity.refused(&caller, refused("list_articles", &scope, "wait"), Nanos::new(i as u64));
    }
    let recent = activity.recent();
    assert_eq!((recent.latest.len(), recent.scopes.len()), (LATEST, MAX_SCOPES));
}
