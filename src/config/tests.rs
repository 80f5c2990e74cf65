//! The config's own tests: every error names its key.
use super::*;
use crate::redact::Secret;

/// The tools the documented defaults price: the reference server's catalogue, read from
/// `config.toml` rather than imported from the MCP layer.
fn reference() -> Catalogue {
    let defaults = config::Config::builder()
        .add_source(config::File::from_str(DEFAULT_TOML, config::FileFormat::Toml))
        .build()
        .expect("the defaults parse");
    let tools = defaults.get_table("tools").expect("the defaults price tools");
    let catalogue = tools.into_keys().fold(Catalogue::new(), Catalogue::tool);
    // As the server's own catalogue knows it (from the tool's schema): what a price may read.
    catalogue.arguments("generate_image_to_video", ["image_url", "prompt", "seconds"])
}

impl Config {
    fn from_toml_test(toml: &str) -> Result<Self, ConfigError> {
        Self::from_toml(toml, &reference())
    }
}

fn err(toml: &str) -> String {
    match Config::from_toml_test(toml) {
        Ok(_) => panic!("config should have been rejected:\n{toml}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn documented_defaults_load() {
    let c = Config::from_toml_test("").expect("defaults are valid");
    assert_eq!(c.limiting.limits.caller[0].limiter.capacity(), 60);
    let video = &c.limiting.tools["generate_image_to_video"];
    assert_eq!(video.cost, 30, "a formula's cost is its most");
    let formula = video.formula.as_ref().expect("priced by a formula");
    let price = |seconds: u32| formula.units(&serde_json::json!({ "seconds": seconds }), (video.cost_min, video.cost));
    assert_eq!((price(5), price(8), price(30)), (20, 26, 30), "20 as SPEC says, for a 5-second video");
    assert_eq!(c.limiting.tools.len(), reference().names().count());
    // Without those tools in the catalogue, their default prices are not loaded.
    assert!(Config::defaults(&Catalogue::new().tool("search")).is_err(), "search has no cost");
    let other = Config::from_toml("[tools.search]\ncost = 3\n", &Catalogue::new().tool("search"))
        .expect("another server's catalogue");
    assert_eq!(other.limiting.tools.keys().collect::<Vec<_>>(), ["search"]);
}

#[test]
fn cost_larger_than_bucket_names_both_keys() {
    let e = err("[tools.generate_image_to_video]\ncost = 100\n");
    assert!(e.contains("tools.generate_image_to_video.cost") && e.contains("limits.caller.burst"), "{e}");
}

#[test]
fn unknown_tool_unknown_algorithm_and_bad_rates_are_named() {
    assert!(err("[tools.make_coffee]\ncost = 1\n").contains("tools.make_coffee"));
    assert!(err("[limits.caller]\nalgorithm = \"magic\"\n").contains("limits.caller.algorithm"));
    assert!(err("[limits.caller]\nrefill_per_sec = 0\n").contains("limits.caller.refill_per_sec"));
    assert!(err("[limits.caller]\nrefill_per_sec = -1.5\n").contains("limits.caller.refill_per_sec"));
    assert!(err("[limits.caller]\nburst = 0\n").contains("limits.caller.burst"));
    assert!(err("[tools.save_article]\ncost = -2\n").contains("tools.save_article.cost"));
    assert!(err("[upstream]\nurl = \"ftp://x\"\n").contains("upstream.url"));
    assert!(err("[limits.in_flight]\ncaller = 0\n").contains("limits.in_flight.caller"));
    assert!(err("[loop_detection]\nrepeats = 1\n").contains("loop_detection.repeats"));
    assert!(err("[loop_detection]\nno_progress = 1\n").contains("loop_detection.no_progress"));
    assert!(err("[loop_detection]\nno_progress = 1001\n").contains("loop_detection.no_progress"));
    assert!(err("[loop_detection]\nno_progress = -3\n").contains("no_progress"));
    assert!(err("[loop_detection]\nvolatile_fields = [\"\"]\n").contains("loop_detection.volatile_fields"));
    assert!(err("[tools.list_articles]\nno_progress = 1\n").contains("tools.list_articles.no_progress"));
    assert!(
        err("[tools.list_articles]\nvolatile_fields = [\"ok\", \"\"]\n")
            .contains("tools.list_articles.volatile_fields")
    );
    assert!(err("[upstream]\nmax_attempts = 0\n").contains("upstream.max_attempts"));
    assert!(err("[upstream]\nretry_budget_ratio = 1.5\n").contains("upstream.retry_budget_ratio"));
}

#[test]
fn every_algorithm_can_be_selected_with_its_own_parameters() {
    for (toml, name) in [
        ("algorithm = \"gcra\"", "gcra"),
        ("algorithm = \"fixed_window\"\nlimit = 100\nwindow_ms = 60000", "fixed_window"),
        ("algorithm = \"sliding_log\"\nlimit = 100\nwindow_ms = 60000", "sliding_log"),
        ("algorithm = \"sliding_window\"\nlimit = 100\nwindow_ms = 60000", "sliding_window"),
        ("algorithm = \"leaky_bucket\"\nleak_per_sec = 2.0", "leaky_bucket"),
        ("algorithm = \"concurrency\"\nmax_in_flight = 100", "concurrency"),
    ] {
        let c = Config::from_toml_test(&format!("[limits.caller]\n{toml}\n")).expect(name);
        assert_eq!(c.limiting.limits.caller[0].limiter.algorithm(), name);
    }
}

#[test]
fn an_algorithm_without_its_parameters_names_the_missing_key() {
    assert!(err("[limits.caller]\nalgorithm = \"fixed_window\"\nlimit = 10\n").contains("limits.caller.window_ms"));
    assert!(err("[limits.caller]\nalgorithm = \"sliding_log\"\nwindow_ms = 10\n").contains("limits.caller.limit"));
    assert!(err("[limits.caller]\nalgorithm = \"concurrency\"\n").contains("limits.caller.max_in_flight"));
    assert!(err("[limits.caller]\nalgorithm = \"fixed_window\"\nlimit = 10\nwindow_ms = 0\n").contains("window_ms"));
}

#[test]
fn a_short_admin_key_is_refused_and_no_key_keeps_the_admin_api_off() {
    let e = err("[admin]\nkey = \"short\"\n");
    assert!(e.contains("admin.key") && !e.contains("short"), "{e}");
    assert!(Config::from_toml_test("").expect("defaults").admin.key_sha256.is_none());
    let on = Config::from_toml_test("[admin]\nkey = \"0123456789abcdef\"\n").expect("16 characters");
    assert!(on.admin.key_sha256.is_some());
    assert!(!format!("{on:?}").contains("0123456789abcdef"), "the key never shows in a Debug print");
}

#[test]
fn the_raw_config_prints_no_secret_either() {
    let toml = "[store]\nredis_url = \"redis://:redis-pw-hush@h:1,redis://:other-pw-hush@g:2\"\n\
                [upstream]\nurl = \"https://u:upstream-pw-hush@api.example.com/\"\n\
                [admin]\nkey = \"admin-key-hush-01234\"\n[auth]\nid_secret = \"id-secret-hush-01234\"\n\
                [[auth.keys]]\nkey = \"plain-key-hush\"\n[[auth.keys]]\nsha256 = \"ab12cd34\"\n";
    let document = Document::from_toml(toml, &reference()).expect("reads");
    let raw = document.section::<RawServerSections>().expect("the server's sections");
    for printed in [format!("{document:?}"), format!("{document:#?}"), format!("{raw:?}"), format!("{raw:#?}")] {
        assert!(!printed.contains("hush") && !printed.contains("ab12cd34"), "{printed}");
    }
    assert!(format!("{raw:?}").contains("https://***@api.example.com/"), "{raw:?}");
}

#[test]
fn a_short_id_secret_is_refused_without_showing_it() {
    let e = err("[auth]\nid_secret = \"too-short\"\n");
    assert!(e.contains("auth.id_secret") && e.contains("16") && !e.contains("too-short"), "{e}");
    assert!(Config::from_toml_test("[auth]\nid_secret = \"  \"\n").expect("blank").limiting.auth.id_secret.is_none());
    let on = Config::from_toml_test("[auth]\nid_secret = \" 0123456789abcdef \"\n").expect("16 characters");
    assert_eq!(on.limiting.auth.id_secret.as_ref().map(Secret::expose), Some("0123456789abcdef"), "trimmed");
    assert!(on.limits_table().contains("caller ids: keyed (auth.id_secret)"), "{}", on.limits_table());
    assert!(!format!("{on:?}{on:#?}").contains("0123456789abcdef"), "the secret never shows in a Debug print");
}

#[test]
fn an_insurance_share_below_a_cost_names_the_instances_the_limit_and_the_tool() {
    let redis = "[store]\nbackend = \"redis\"\nexpected_instances = 3\n";
    // 60 × guest 0.5 = 30, a third of which (10) is below a video's 20, for a tool that fails open.
    let open = "[tools.generate_image_to_video]\ncost = 20\nfail = \"open\"\n";
    let e = err(&format!("{redis}{open}"));
    assert!(e.contains("`store.expected_instances`"), "{e}");
    for part in ["1/3", "`limits.caller.burst` × `tiers.guest`", "30 → 10", "cost 20", "generate_image_to_video"] {
        assert!(e.contains(part), "{part}: {e}");
    }
    assert!(e.contains("fail = \"closed\""), "says what to change: {e}");
    // The same share for a tool that fails closed never decides it: accepted.
    assert!(Config::from_toml_test(redis).is_ok());
    // In memory there is no insurance limiter; with one instance its share is the whole.
    assert!(Config::from_toml_test(open).is_ok());
    assert!(Config::from_toml_test(&format!("{}{open}", redis.replace("= 3", "= 1"))).is_ok());
    // Tenants' and keys' own budgets are shared out too, and checked as written.
    let tenant = "[tenants.acme.budget]\nalgorithm = \"sliding_window\"\nlimit = 50\nwindow_ms = 60000\n";
    let e = err(&format!("{redis}{open}{tenant}[limits.caller]\nburst = 600\n"));
    assert!(e.contains("`tenants.acme.budget.limit` (50 → 17)"), "{e}");
    let key =
        "[[auth.keys]]\nkey = \"k\"\n[auth.keys.caller]\nalgorithm = \"gcra\"\nburst = 10\nrefill_per_sec = 1.0\n";
    let e = err(key);
    assert!(
        e.contains("`tools.generate_image_to_video.cost`") && e.contains("`auth.keys[0].caller.burst` = 10"),
        "{e}"
    );
}

#[test]
fn budget_slices_out_of_bounds_are_refused_naming_the_key() {
    for (toml, key) in [
        ("[store]\nslice_ms = 0\n", "store.slice_ms"),
        ("[store]\nslice_ms = 60001\n", "store.slice_ms"),
        ("[store]\nslice_max = 4294967297\n", "store.slice_max"),
        ("[store]\nslice_max = -1\n", "store.slice_max"),
    ] {
        let e = err(toml);
        assert!(e.contains(&format!("`{key}`")) || e.contains(key), "{toml}: {e}");
    }
    let off = Config::from_toml_test("[store]\nslice_max = 0\nslice_ms = 60000\n");
    assert!(off.is_ok(), "slices off, and a minute's slices, are within bounds");
}

#[test]
fn durations_past_a_day_are_refused_naming_the_key() {
    for (toml, key) in [
        ("[upstream]\ntimeout_ms = 86400001\n", "upstream.timeout_ms"),
        ("[upstream]\ntimeout_ms = 9223372036854775807\n", "upstream.timeout_ms"),
        ("[upstream]\nbreaker_cooldown_ms = 100000000\n", "upstream.breaker_cooldown_ms"),
        ("[upstream]\njob_expiry_seconds = 604801\n", "upstream.job_expiry_seconds"),
        ("[upstream]\nvideo_poll_seconds = 86401\n", "upstream.video_poll_seconds"),
        ("[store]\nlease_ms = 86400001\n", "store.lease_ms"),
        ("[store]\nsweep_interval_ms = 86400001\n", "store.sweep_interval_ms"),
        ("[loop_detection]\nwindow_ms = 86400001\n", "loop_detection.window_ms"),
        ("[mock_upstream]\nvideo_job_ms = 86400001\n", "mock_upstream.video_job_ms"),
    ] {
        let e = err(toml);
        assert!(e.contains(&format!("`{key}`")), "{toml}: {e}");
    }
    let week = Config::from_toml_test("[upstream]\njob_expiry_seconds = 604800\ntimeout_ms = 86400000\n");
    assert!(week.is_ok(), "a week's expiry and a day's timeout are the bounds themselves");
}

#[test]
fn an_integer_too_large_for_toml_is_refused_naming_its_key() {
    let e = err("[upstream]\ntimeout_ms = 18446744073709551615\n");
    assert!(e.contains("`upstream.timeout_ms`") && e.contains("18446744073709551615"), "{e}");
    let e = err("[[limits.caller]]\nalgorithm = \"token_bucket\"\nburst = 99999999999999999999\n");
    assert!(e.contains("`limits.caller[0].burst`"), "{e}");
}

#[test]
fn a_tier_that_stretches_a_bucket_past_what_redis_decides_exactly_is_named() {
    // A burst of 1 stays 1 for guests (× 0.5, rounded, never below one) while its rate halves.
    let e = err("[store]\nbackend = \"redis\"\n[limits.caller]\nburst = 1\nrefill_per_sec = 0.0000003\n\
                 [tools.list_articles]\ncost = 1\n[tools.save_article]\ncost = 1\n[tools.generate_image]\ncost = 1\n\
                 [tools.generate_image_to_video]\ncost = 1\n");
    assert!(e.contains("`limits.caller`") && e.contains("tiers.guest"), "{e}");
}

#[test]
fn typos_are_rejected_not_ignored() {
    let e = err("[limits.caller]\nbrust = 10\n");
    assert!(e.contains("brust"), "{e}");
}

#[test]
fn adaptive_concurrency_is_checked_naming_its_key() {
    let tools = reference();
    for (toml, key) in [
        ("[upstream.adaptive]\nalgorithm = \"vegas\"\n", "upstream.adaptive.algorithm"),
        ("[upstream.adaptive]\nmin = 0\n", "upstream.adaptive.min"),
        ("[upstream.adaptive]\nmax = 11\n", "upstream.adaptive.max"),
        ("[upstream.adaptive]\nmin = 6\nmax = 5\n", "upstream.adaptive.min"),
        ("[upstream.adaptive]\nbackoff_ratio = 1.0\n", "upstream.adaptive.backoff_ratio"),
        ("[proxy.adaptive]\nmax = 17\n", "proxy.adaptive.max"),
        ("[upstream.adaptive]\ntolerance = 0.9\n", "upstream.adaptive.tolerance"),
        ("[upstream.adaptive]\ntolerance = nan\n", "upstream.adaptive.tolerance"),
        ("[upstream.adaptive]\nsmoothing = 0.0\n", "upstream.adaptive.smoothing"),
        ("[upstream.adaptive]\nsmoothing = 1.5\n", "upstream.adaptive.smoothing"),
        ("[upstream.adaptive]\nlong_window = 0\n", "upstream.adaptive.long_window"),
        ("[upstream.adaptive]\nqueue_size = 0\n", "upstream.adaptive.queue_size"),
        ("[proxy.adaptive]\nalgorithm = \"gradient\"\n", "proxy.adaptive.algorithm"),
        ("[proxy.adaptive]\nsmoothing = -0.2\n", "proxy.adaptive.smoothing"),
        ("[upstream.adaptive]\nlong_window = -1\n", "upstream.adaptive.long_window"),
    ] {
        let error = Config::from_toml(toml, &tools).expect_err(toml).to_string();
        assert!(error.contains(&format!("`{key}`")), "{toml}: {error}");
    }
    let config = Config::from_toml("[upstream.adaptive]\nenabled = true\nmin = 2\n", &tools).expect("valid");
    let adaptive = &config.upstream.adaptive;
    assert_eq!((adaptive.enabled, adaptive.min, adaptive.max_under(10)), (true, 2, 10), "max 0: the static cap");
    assert!(!Config::defaults(&tools).expect("defaults").upstream.adaptive.enabled, "off by default");
    let error =
        Config::from_toml("[upstream.adaptive]\nalgorithm = \"vegas\"\n", &tools).expect_err("unknown").to_string();
    assert!(error.contains("aimd, gradient2"), "names what it takes: {error}");
    let config = Config::from_toml(
        "[upstream.adaptive]\nenabled = true\nalgorithm = \"gradient2\"\ntolerance = 2.0\nqueue_size = 4\n",
        &tools,
    )
    .expect("valid");
    let adaptive = &config.upstream.adaptive;
    assert_eq!(
        (adaptive.tolerance, adaptive.smoothing, adaptive.long_window, adaptive.queue_size),
        (2.0, 0.2, 600, 4),
        "Netflix's defaults where not set (queue_size is 1 unless set: an account has few slots)"
    );
}

#[test]
fn a_cost_formula_is_checked_naming_its_key() {
    let video = "[tools.generate_image_to_video]\n";
    for (toml, key, said) in [
        ("cost = \"20 + 2 * secs\"\ncost_max = 30\n", "tools.generate_image_to_video.cost", "reads `secs`"),
        ("cost = \"20 + 2 * seconds\"\ncost_max = 0\n", "tools.generate_image_to_video.cost_max", "1 or more"),
        ("cost = \"random()\"\ncost_max = 30\n", "tools.generate_image_to_video.cost", "calls `random`"),
        ("cost = \"(20\"\ncost_max = 30\n", "tools.generate_image_to_video.cost", "not a formula"),
        ("cost = \"seconds = 9\"\ncost_max = 30\n", "tools.generate_image_to_video.cost", "assigns"),
        ("cost = \"2 * seconds\"\ncost_max = 31\n", "tools.generate_image_to_video.cost", "tiers.guest"),
        ("settle = \"sometimes\"\n", "settle", "sometimes"),
        (
            "cost = \"seconds\"\ncost_max = 30\ncost_min = 31\n",
            "tools.generate_image_to_video.cost_min",
            "0 to cost_max",
        ),
        (
            "cost = \"seconds\"\ncost_max = 30\ncost_min = -1\n",
            "tools.generate_image_to_video.cost_min",
            "0 to cost_max",
        ),
    ] {
        let e = err(&format!("{video}{toml}"));
        assert!(e.contains(key) && e.contains(said), "{toml}: {e}");
    }
    // A formula's arguments are checked where the catalogue knows them (a proxy learns its
    // tools later).
    let formula = "[tools.save_article]\ncost = \"1 + len(body) / 1000\"\ncost_max = 5\n";
    let tools = Catalogue::new().tool("save_article").arguments("save_article", ["title", "body"]);
    let config = Config::from_toml(formula, &tools).expect("reads only `body`");
    assert_eq!(config.limiting.tools["save_article"].cost, 5);
    assert!(Config::from_toml(formula, &Catalogue::learned()).is_ok(), "a proxy's tools come later");
    // cost_max is read only with a formula: a fixed cost written over config.toml's formula is fine.
    let fixed = Config::from_toml_test("[tools.generate_image_to_video]\ncost = 20\n").expect("fixed");
    assert!(fixed.limiting.tools["generate_image_to_video"].formula.is_none());
    assert_eq!(fixed.limiting.tools["generate_image_to_video"].cost, 20);
    let e = err("[tools.save_article]\ncost = \"2 + len(body)\"\n");
    assert!(e.contains("tools.save_article.cost_max") && e.contains("the most one call may reserve"), "{e}");
}

#[test]
fn the_listeners_caps_are_checked_naming_their_keys_and_the_metrics_key_never_shows() {
    for (toml, key) in [
        ("[server]\nipv6_prefix = 0\n", "server.ipv6_prefix"),
        ("[server]\nipv6_prefix = 129\n", "server.ipv6_prefix"),
        ("[server]\nipv6_prefix = -64\n", "server.ipv6_prefix"),
        ("[server]\nmax_connections = 0\n", "server.max_connections"),
        ("[server]\nmax_connections_per_address = 0\n", "server.max_connections_per_address"),
        ("[server]\nmax_streams_per_connection = 0\n", "server.max_streams_per_connection"),
        ("[server]\nmax_streams_per_connection = -1\n", "server.max_streams_per_connection"),
        ("[server]\nunverified_session_share = 1.5\n", "server.unverified_session_share"),
        ("[server]\nunverified_session_share = -0.1\n", "server.unverified_session_share"),
        ("[server]\nkey_session_share = 0.0\n", "server.key_session_share"),
        ("[server]\ntenant_session_share = 2.0\n", "server.tenant_session_share"),
        ("[server]\nmetrics_key = \"short-hush\"\n", "server.metrics_key"),
    ] {
        let e = err(toml);
        assert!(e.contains(key) && !e.contains("hush"), "{toml}: {e}");
    }
    let defaults = Config::from_toml_test("").expect("defaults");
    let server = &defaults.server;
    assert_eq!(defaults.limiting.proxies.ipv6_prefix, 64);
    assert_eq!(
        (server.connections.max, server.connections.max_per_address, server.connections.ipv6_prefix),
        (10000, 500, 64)
    );
    assert!(server.connections.exempt.is_empty() && server.metrics_key_sha256.is_none());
    assert_eq!(server.max_streams_per_connection, 100, "hyper's own default is 200");
    assert_eq!(
        (server.unverified_sessions(), server.sessions_per_key(), server.sessions_per_tenant()),
        (2500, 500, 1250)
    );
    let small = Config::from_toml_test("[server]\nmax_sessions = 5\nunverified_session_share = 0.5\n").expect("valid");
    assert_eq!((small.server.unverified_sessions(), small.server.sessions_per_key()), (2, 1), "down, at least one");
    let toml = "[server]\nipv6_prefix = 48\ntrust_proxy = true\nmetrics_key = \"metrics-key-hush-0123\"\n";
    let on = Config::from_toml_test(toml).expect("valid");
    assert_eq!((on.server.connections.ipv6_prefix, on.limiting.proxies.ipv6_prefix), (48, 48), "one key, both uses");
    assert_eq!(on.server.connections.exempt, on.limiting.proxies.trusted_proxies, "trusted proxies are exempt");
    assert_eq!(
        on.server.metrics_key_sha256.map(|k| k.0),
        Some(<sha2::Sha256 as sha2::Digest>::digest(b"metrics-key-hush-0123").into())
    );
    assert!(!format!("{on:?}{on:#?}").contains("hush"), "the metrics key never shows in a Debug print");
    let document = Document::from_toml(toml, &reference()).expect("reads");
    let raw = document.section::<RawServerSections>().expect("the server's sections");
    assert!(!format!("{raw:?}{document:?}").contains("hush"), "nor in the raw config's");
}

#[test]
fn reserved_shares_and_ranks_name_known_tiers_and_reserve_no_more_than_the_account() {
    let ok = Config::from_toml_test(
        "[tiers]\npro = 2.0\n[upstream.reserved]\npro = 0.5\n[upstream.priority]\npro = 3\nguest = -1\n",
    )
    .expect("valid");
    assert_eq!(ok.upstream.reserved["pro"], 0.5);
    assert_eq!(ok.upstream.priority["guest"], -1);
    assert!(
        Config::from_toml_test("[upstream.reserved]\nadmin = 0.2\ndefault = 0.1\nguest = 0.7\n").is_ok(),
        "0.1 + 0.2 + 0.7 is the whole"
    );
    let unknown = err("[upstream.reserved]\nplatinum = 0.5\n");
    assert!(unknown.contains("upstream.reserved.platinum") && unknown.contains("admin, default, guest"), "{unknown}");
    assert!(err("[upstream.priority]\nplatinum = 1\n").contains("upstream.priority.platinum"));
    assert!(err("[upstream.reserved]\nadmin = 1.5\n").contains("upstream.reserved.admin"));
    assert!(err("[upstream.reserved]\nadmin = -0.1\n").contains("upstream.reserved.admin"));
    let over = err("[upstream.reserved]\nadmin = 0.6\ndefault = 0.5\n");
    assert!(over.contains("upstream.reserved") && over.contains("more than the whole account"), "{over}");
}

#[test]
fn telemetry_is_off_unless_an_endpoint_is_set_and_each_bad_value_is_named() {
    assert_eq!(Config::from_toml_test("").expect("defaults").telemetry, None);
    let on = Config::from_toml_test("[telemetry]\notlp_endpoint = \"http://collector:4318\"\n").expect("valid");
    let on = on.telemetry.expect("on");
    assert_eq!(on.traces_url.as_str(), "http://collector:4318/v1/traces", "a base URL gets the traces path");
    assert_eq!(on.service_name, "mcp-ratelimit");
    let full = Config::from_toml_test("[telemetry]\notlp_endpoint = \"https://otel.example/custom/traces\"\n");
    assert_eq!(full.expect("valid").telemetry.expect("on").traces_url.as_str(), "https://otel.example/custom/traces");
    for (toml, key, says) in [
        ("otlp_endpoint = \"collector:4318\"", "telemetry.otlp_endpoint", "http://"),
        ("otlp_endpoint = \"not a url\"", "telemetry.otlp_endpoint", "is not a URL"),
        ("otlp_endpoint = \"ftp://collector\"", "telemetry.otlp_endpoint", "http://"),
        ("otlp_endpoint = \"http://user:pw@collector:4318\"", "telemetry.otlp_endpoint", "credentials"),
        ("otlp_endpoint = \"http://c:4318\"\nservice_name = \" \"", "telemetry.service_name", "empty"),
        ("otlp_endpoint = \"http://c:4318\"\nsample_ratio = 1.5", "telemetry.sample_ratio", "0.0 to 1.0"),
        ("otlp_endpoint = \"http://c:4318\"\nexport_interval_ms = 0", "telemetry.export_interval_ms", "1 to"),
        ("otlp_endpoint = \"http://c:4318\"\nexport_timeout_ms = 3600001", "telemetry.export_timeout_ms", "1 to"),
        ("otlp_endpiont = \"http://c:4318\"", "otlp_endpiont", ""),
    ] {
        let e = err(&format!("[telemetry]\n{toml}\n"));
        assert!(e.contains(key) && e.contains(says), "{toml}: {e}");
    }
    // The password of a refused URL is not repeated in the error.
    assert!(!err("[telemetry]\notlp_endpoint = \"http://user:hunter2@c:4318\"\n").contains("hunter2"));
}

#[test]
fn webhook_keys_are_checked_and_their_errors_name_the_key_never_the_secret() {
    let tools = Catalogue::learned();
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let url = "https://mcp.example.com/webhooks/upstream";
    for (toml, key) in [
        (format!("[upstream]\nwebhook_url = \"{url}\"\n"), "upstream.webhook_secret"),
        ("[upstream]\nwebhook_secret = \"MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n".to_owned(), "upstream.webhook_secret"),
        ("[upstream]\nwebhook_secret = \"whsec_!!not-base64!!\"\n".to_owned(), "upstream.webhook_secret"),
        (
            format!("[upstream]\nwebhook_secret = \"{secret}\"\nwebhook_url = \"ftp://x/webhooks/upstream\"\n"),
            "upstream.webhook_url",
        ),
        (
            format!("[upstream]\nwebhook_secret = \"{secret}\"\nwebhook_url = \"https://x/hooks\"\n"),
            "upstream.webhook_url",
        ),
        (format!("[upstream]\nwebhook_secret = \"{secret}\"\nwebhook_url = \"{url}?job=1\"\n"), "upstream.webhook_url"),
        ("[mock_upstream]\nwebhook_secret = \"whsec_AAAA\"\n".to_owned(), "mock_upstream.webhook_secret"),
    ] {
        let error = Config::from_toml(&toml, &tools).expect_err(&toml).to_string();
        assert!(error.contains(&format!("`{key}`")), "{toml}: {error}");
        assert!(!error.contains("MfKQ9r8"), "the secret is never repeated: {error}");
    }
    let config =
        Config::from_toml(&format!("[upstream]\nwebhook_url = \"{url}\"\nwebhook_secret = \"{secret}\"\n"), &tools)
            .expect("valid");
    let target = config.upstream.webhooks().expect("on");
    assert_eq!(target.url.as_str(), url);
    assert!(Config::defaults(&tools).expect("defaults").upstream.webhooks().is_none(), "off by default");
}
