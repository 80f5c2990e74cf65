//! Callers known by their OAuth access tokens, against a real authorization server the test
//! starts (`oauth2-mock-server`, `tests/common/oauth.rs`): discovery from the 401 alone by the
//! official Python SDK in both eras, forged tokens refused with the subject's budget untouched,
//! key rotation, a flood of made-up key ids, budgets per subject, tenant, tier and client, scopes,
//! introspection, and what `/metrics` counts.

use std::sync::Arc;

use crate::common::*;
use crate::oauth::Provider;
use crate::python;
use mcp_ratelimit::clock::{ManualClock, Nanos};
use serde_json::{Value, json};

const METRICS_KEY: &str = "metrics-key-of-the-oauth-tests";

/// A manual clock at the wall clock's time: tokens carry Unix times.
fn wall_clock() -> Arc<ManualClock> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970");
    ManualClock::starting_at(Nanos::new(u64::try_from(now.as_nanos()).expect("fits")))
}

/// A server that requires a credential and takes tokens of `provider`, with `extra` config.
async fn resource_server(provider: &Provider, extra: &str) -> TestServer {
    let toml = format!(
        "{NO_LOOP_DETECTION}[server]\nmetrics_key = \"{METRICS_KEY}\"\n[auth]\nrequired = true\n\
         [auth.oauth]\nissuer = \"{}\"\n{extra}",
        provider.issuer
    );
    TestServer::start_on(&toml, wall_clock()).await
}

/// A 2025-11-25 `initialize` with `bearer`: status and `WWW-Authenticate`.
async fn knock(server: &TestServer, bearer: Option<&str>) -> (u16, String) {
    let header = bearer.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = header.as_deref().map(|h| vec![("authorization", h)]).unwrap_or_default();
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "knock", "version": "1"}}});
    let (status, answered, _) = RawSession::new(&server.url, &headers).post(init).await;
    let challenge = answered.get("www-authenticate").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    (status, challenge)
}

/// The `rate_limit_status` a client presenting `token` sees.
async fn status_of(server: &TestServer, token: &str) -> rmcp::model::CallToolResult {
    call(&server.client(Some(token)).await, "rate_limit_status", json!({})).await
}

fn remaining(status: &rmcp::model::CallToolResult, prefix: &str) -> u64 {
    budget(status, prefix)["remaining"].as_u64().expect("remaining")
}

#[tokio::test]
async fn the_python_sdk_finds_the_provider_from_the_401_alone_and_calls_in_both_eras() {
    let provider = Provider::start(json!({"agent-app": {"org_id": "acme", "tier": "admin"}})).await;
    let server = resource_server(&provider, "").await;
    let steps = json!([
        {"op": "call", "tool": "rate_limit_status", "args": {}, "check_schema": true},
        {"op": "call", "tool": "list_articles", "args": {}},
    ]);
    let mut callers = Vec::new();
    for mode in ["auto", "legacy"] {
        let client = ["--oauth-client", "agent-app:app-secret", "--oauth-issuer", &provider.issuer];
        let walked = python::walk(&server.url, mode, steps.clone(), &client).await;
        assert!(python::all_ok(&walked), "{mode}: {walked}");
        assert_eq!(walked["protocol_version"], python::era_of(mode), "{walked}");
        let status = &walked["steps"][0]["ok"]["structured"];
        assert_eq!(status["proof"], "token", "{mode}: a verified caller, not its address's: {status}");
        assert_eq!(status["tenant"], "acme", "{status}");
        assert_eq!(status["tier"], "admin", "{status}");
        assert_eq!(status["client"], "agent-app", "{status}");
        let caller = status["caller"].as_str().expect("caller").to_owned();
        assert!(caller.starts_with("sub:") && caller.len() == 20, "{caller}");
        assert!(walked["steps"][1]["ok"]["is_error"] == false, "{walked}");
        callers.push(caller);
    }
    assert_eq!(callers[0], callers[1], "one subject, one caller id, whichever era");
    assert!(provider.stats().await["token"].as_u64() >= Some(2), "each walk got its token from the provider");
}

#[tokio::test]
async fn no_token_gets_a_challenge_naming_the_metadata_which_names_the_provider() {
    let provider = Provider::start(json!({})).await;
    let server = resource_server(&provider, "scopes_required = [\"mcp:tools\"]\n").await;
    let (status, challenge) = knock(&server, None).await;
    assert_eq!(status, 401);
    let metadata = format!("http://{}/.well-known/oauth-protected-resource/mcp", server.addr);
    assert!(challenge.starts_with("Bearer ") && !challenge.contains("error="), "{challenge}");
    assert!(challenge.contains(&format!("resource_metadata=\"{metadata}\"")), "{challenge}");
    assert!(challenge.contains("scope=\"mcp:tools\""), "the scope it needs: {challenge}");

    for path in ["/.well-known/oauth-protected-resource/mcp", "/.well-known/oauth-protected-resource"] {
        let document: Value =
            reqwest::get(format!("http://{}{path}", server.addr)).await.expect("GET").json().await.expect("JSON");
        assert_eq!(document["resource"], server.url, "{path}: {document}");
        assert_eq!(document["authorization_servers"], json!([provider.issuer]), "{document}");
        assert_eq!(document["scopes_supported"], json!(["mcp:tools"]), "{document}");
        assert_eq!(document["bearer_methods_supported"], json!(["header"]), "{document}");
    }

    // A token without the scope: 403 insufficient_scope, naming it; with it, in.
    let bare = provider.mint(json!({"sub": "alice", "aud": server.url})).await;
    let (status, challenge) = knock(&server, Some(&bare)).await;
    assert_eq!(status, 403);
    assert!(
        challenge.contains("error=\"insufficient_scope\"") && challenge.contains("scope=\"mcp:tools\""),
        "{challenge}"
    );
    let scoped = provider.mint(json!({"sub": "alice", "aud": server.url, "scope": "openid mcp:tools"})).await;
    assert_eq!(knock(&server, Some(&scoped)).await.0, 200);

    // With [auth.oauth] off there is no document to find.
    let plain = TestServer::start("").await;
    let off =
        reqwest::get(format!("http://{}/.well-known/oauth-protected-resource/mcp", plain.addr)).await.expect("GET");
    assert_eq!(off.status(), 404);
}

#[tokio::test]
async fn forged_tokens_are_refused_invalid_token_and_the_subject_keeps_its_whole_budget() {
    let provider = Provider::start(json!({})).await;
    let server = resource_server(&provider, "").await;
    let aud = server.url.clone();
    let alice = |extra: Value| {
        let mut claims = json!({"sub": "alice", "aud": aud});
        claims.as_object_mut().expect("object").extend(extra.as_object().cloned().unwrap_or_default());
        claims
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("now").as_secs();
    let forged = [
        ("another key under the provider's kid", provider.forge("other_key", alice(json!({}))).await),
        ("alg none", provider.forge("none", alice(json!({}))).await),
        ("HS256 keyed with the public key", provider.forge("hs256_public", alice(json!({}))).await),
        ("the wrong aud", provider.mint(alice(json!({"aud": "https://another.example/mcp"}))).await),
        ("the wrong iss", provider.mint(alice(json!({"iss": "https://evil.example"}))).await),
        ("expired", provider.mint(alice(json!({"iat": now - 7200, "exp": now - 3600}))).await),
        ("nbf in the future", provider.mint(alice(json!({"nbf": now + 3600}))).await),
    ];
    let metadata = format!("http://{}/.well-known/oauth-protected-resource/mcp", server.addr);
    for (what, token) in &forged {
        for _ in 0..3 {
            let (status, challenge) = knock(&server, Some(token)).await;
            assert_eq!(status, 401, "{what}");
            assert!(challenge.starts_with("Bearer error=\"invalid_token\""), "{what}: {challenge}");
            assert!(challenge.contains(&format!("resource_metadata=\"{metadata}\"")), "{what}: {challenge}");
        }
    }
    // Alice herself, with a real token: every unit of her budget is still hers.
    let real = provider.mint(alice(json!({}))).await;
    let status = status_of(&server, &real).await;
    assert_eq!(structured(&status)["proof"], "token");
    let own = budget(&status, "caller:sub:");
    assert_eq!(own["remaining"], own["limit"], "forgeries in her name cost her nothing: {own}");

    let metrics = reqwest::Client::new().get(format!("http://{}/metrics", server.addr)).bearer_auth(METRICS_KEY);
    let metrics = metrics.send().await.expect("GET").text().await.expect("text");
    for outcome in [
        "bad_signature",
        "algorithm_not_allowed",
        "wrong_audience",
        "wrong_issuer",
        "expired",
        "not_yet_valid",
        "valid",
    ] {
        let counted = metrics
            .lines()
            .find(|l| l.starts_with(&format!("mcp_ratelimit_token_validations_total{{outcome=\"{outcome}\"}}")))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        assert!(counted >= 1.0, "outcome {outcome} counted: {metrics}");
    }
    assert!(metric_sum(&metrics, "mcp_ratelimit_jwks_fetches_total") >= 1.0, "{metrics}");
    assert!(!metrics.contains(&real[..40]) && !metrics.contains("alice"), "no token or subject in a label");
}

#[tokio::test]
async fn a_rotated_key_is_taken_and_forty_made_up_kids_cost_at_most_three_fetches() {
    let provider = Provider::start(json!({})).await;
    let server = resource_server(&provider, "").await;
    let first = provider.mint(json!({"sub": "alice", "aud": server.url})).await;
    assert_eq!(knock(&server, Some(&first)).await.0, 200);

    // The provider rotates; a minute on (jwks_refresh_min_seconds) its new kid is fetched for.
    provider.rotate().await;
    server.clock.advance(std::time::Duration::from_secs(61));
    let rotated = provider.mint(json!({"sub": "alice", "aud": server.url})).await;
    assert_eq!(knock(&server, Some(&rotated)).await.0, 200, "the new key is taken");
    assert_eq!(knock(&server, Some(&first)).await.0, 200, "the old one still is, while the JWKS has it");

    let before = provider.jwks_fetches().await;
    for i in 0..40 {
        server.clock.advance(std::time::Duration::from_secs(1));
        let made_up = provider
            .mint_with(json!({"sub": "alice", "aud": server.url}), json!({"kid": format!("made-up-{i}")}))
            .await;
        let (status, challenge) = knock(&server, Some(&made_up)).await;
        assert_eq!(status, 401);
        assert!(challenge.contains("invalid_token"), "{challenge}");
    }
    let fetched = provider.jwks_fetches().await - before;
    assert!(fetched <= 3, "40 made-up kids over 40 s cost {fetched} JWKS fetches");
}

#[tokio::test]
async fn budgets_per_subject_tenant_tier_and_client() {
    let provider = Provider::start(json!({})).await;
    let limits = "[limits.caller]\nalgorithm = \"token_bucket\"\nburst = 10\nrefill_per_sec = 0.001\n\
                  [limits.tenant]\nalgorithm = \"token_bucket\"\nburst = 100\nrefill_per_sec = 0.001\n\
                  [limits.client]\nalgorithm = \"token_bucket\"\nburst = 200\nrefill_per_sec = 0.001\n\
                  [tools.generate_image_to_video]\ncost = 5\n";
    let server = resource_server(&provider, limits).await;
    let token = |sub: &str, org: &str, client: &str, tier: Option<&str>| {
        let mut claims = json!({"sub": sub, "aud": server.url, "org_id": org, "client_id": client});
        if let Some(tier) = tier {
            claims["tier"] = json!(tier);
        }
        provider.mint(claims)
    };
    let alice = token("alice", "acme", "app-1", None).await;
    let bob = token("bob", "acme", "app-1", None).await;
    let carol = token("carol", "globex", "app-2", None).await;
    let admin = token("dave", "acme", "app-1", Some("admin")).await;

    let spent = spend_until_refused(&server.client(Some(&alice)).await, "list_articles", json!({}), 50).await.0;
    assert_eq!(spent, 10, "alice's own caller budget");
    let bob_status = status_of(&server, &bob).await;
    assert_eq!(remaining(&bob_status, "caller:sub:"), 10, "bob has his own caller budget");
    assert_eq!(remaining(&bob_status, "tenant:acme"), 90, "and shares acme's with alice");
    assert_eq!(remaining(&bob_status, "client:app-1"), 190, "and app-1's");
    let carol_status = status_of(&server, &carol).await;
    assert_eq!(remaining(&carol_status, "client:app-2"), 200, "another client is unaffected");
    assert_eq!(remaining(&carol_status, "tenant:globex"), 100);

    let admin_status = status_of(&server, &admin).await;
    assert_eq!(structured(&admin_status)["tier"], "admin");
    assert_eq!(
        budget(&admin_status, "caller:sub:")["limit"],
        40,
        "the tier claim scales the caller's budget (admin = 4.0)"
    );
    let unknown = token("erin", "acme", "app-1", Some("platinum")).await;
    assert_eq!(structured(&status_of(&server, &unknown).await)["tier"], "default", "a tier nobody configured");
}

#[tokio::test]
async fn a_client_shares_one_budget_across_its_subjects_and_tenants() {
    let provider = Provider::start(json!({})).await;
    let limits = "[limits.client]\nalgorithm = \"token_bucket\"\nburst = 12\nrefill_per_sec = 0.001\n\
                  [tools.generate_image_to_video]\ncost = 10\n[tools.generate_image]\ncost = 5\n";
    let server = resource_server(&provider, limits).await;
    let token = |sub: &str, org: &str, client: &str| {
        provider.mint(json!({"sub": sub, "aud": server.url, "org_id": org, "azp": client}))
    };
    let runaway = [token("u1", "acme", "runaway-app").await, token("u2", "globex", "runaway-app").await];
    let mut admitted = 0;
    for token in runaway.iter().cycle().take(30) {
        if !is_error(&call(&server.client(Some(token)).await, "list_articles", json!({})).await) {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 12, "one client's subjects, in two tenants, share its 12 (azp names it)");
    let refused = call(&server.client(Some(&runaway[0])).await, "list_articles", json!({})).await;
    assert_eq!(error_code(&refused), Some("rate_limited"));
    assert_eq!(structured(&refused)["error"]["scope"], "client:runaway-app");
    let other = token("u3", "acme", "careful-app").await;
    assert!(
        !is_error(&call(&server.client(Some(&other)).await, "list_articles", json!({})).await),
        "another client calls"
    );
}

#[tokio::test]
async fn an_opaque_token_is_introspected_and_believed_no_longer_than_it_lives() {
    let provider = Provider::start(json!({})).await;
    let extra = format!(
        "introspection_endpoint = \"{}/introspect\"\nintrospection_client_id = \"rs\"\nintrospection_client_secret = \"rs-secret\"\n",
        provider.issuer
    );
    let server = resource_server(&provider, &extra).await;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("now").as_secs();
    provider
        .opaque("opaque-token-of-alice", json!({"sub": "alice", "aud": server.url, "exp": now + 120, "org_id": "acme"}))
        .await;
    let status = status_of(&server, "opaque-token-of-alice").await;
    assert_eq!(structured(&status)["proof"], "token", "{}", structured(&status));
    assert_eq!(structured(&status)["tenant"], "acme");
    assert_eq!(knock(&server, Some("opaque-token-of-nobody")).await.0, 401, "inactive");
    let asked = provider.stats().await["introspect"].as_u64().expect("count");
    assert_eq!(knock(&server, Some("opaque-token-of-alice")).await.0, 200);
    assert_eq!(provider.stats().await["introspect"].as_u64(), Some(asked), "the answer is kept while the token lives");
    server.clock.advance(std::time::Duration::from_secs(121 + 30));
    assert_eq!(knock(&server, Some("opaque-token-of-alice")).await.0, 401, "past its exp (and the leeway)");
}

#[tokio::test]
async fn a_key_the_token_names_is_never_fetched_nor_taken() {
    let provider = Provider::start(json!({})).await;
    let server = resource_server(&provider, "").await;
    let claims = json!({"sub": "alice", "aud": server.url});
    let elsewhere = json!({"jku": format!("{}/forger/jwks", provider.issuer), "x5u": format!("{}/forger/cert.pem", provider.issuer)});
    for header in [json!({}), elsewhere] {
        let forged = provider.forge_with("own_key", claims.clone(), header.clone()).await;
        let (status, challenge) = knock(&server, Some(&forged)).await;
        assert_eq!(status, 401, "{header}");
        assert!(challenge.contains("invalid_token"), "{challenge}");
    }
    assert_eq!(provider.stats().await["forger"], 0, "no URL a token names is fetched");
}

#[tokio::test]
async fn an_unreachable_provider_fails_closed_with_a_wait() {
    let provider = Provider::start(json!({})).await;
    let issuer = provider.issuer.clone();
    let minted = provider.mint(json!({"sub": "alice"})).await;
    drop(provider);
    let toml = format!("{NO_LOOP_DETECTION}[auth.oauth]\nissuer = \"{issuer}\"\n");
    let server = TestServer::start_on(&toml, wall_clock()).await;
    let (status, _) = knock(&server, Some(&minted)).await;
    assert_eq!(status, 503, "a token that cannot be checked is no caller, verified or not");
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "knock", "version": "1"}}});
    let (_, headers, _) =
        RawSession::new(&server.url, &[("authorization", &format!("Bearer {minted}"))]).post(init).await;
    let wait: u64 = headers.get("retry-after").and_then(|v| v.to_str().ok()?.parse().ok()).expect("Retry-After");
    assert!((1..=60).contains(&wait), "{wait}");
    // Without a token the server still serves (auth.required is off).
    assert_eq!(knock(&server, None).await.0, 200);
}
