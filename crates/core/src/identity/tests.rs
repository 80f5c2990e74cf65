//! The identity tests: how a credential, an address, a proxy's headers or a token's claims name
//! a caller, and how an operator names one back.

use std::net::IpAddr;

use http::HeaderMap;
use sha2::{Digest, Sha256};

use super::{Caller, CallerIds, Identifier, Identity, Proof, Unauthorized, UnknownCaller, address_group};
use crate::clock::Nanos;
use crate::config::LimitsConfig;

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(*k, v.parse().expect("valid header"));
    }
    h
}

fn identifier(toml: &str) -> Identifier {
    Identifier::new(&LimitsConfig::from_toml(toml, &crate::config::Catalogue::new()).expect("config"))
}

/// The caller `headers` name, with no token to verify ([`Identity::Caller`]).
trait Names {
    fn caller(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Result<Caller, Unauthorized>;
}

impl Names for Identifier {
    fn caller(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Result<Caller, Unauthorized> {
        match self.identify(headers, peer)? {
            Identity::Caller(caller) => Ok(caller),
            token => panic!("a token to verify: {token:?}"),
        }
    }
}

fn ip(s: &str) -> Option<IpAddr> {
    Some(s.parse().expect("ip"))
}

#[test]
fn token_is_hashed_never_kept() {
    let c = identifier("").caller(&headers(&[("authorization", "Bearer sk-live-secret")]), None).expect("caller");
    // The first 16 hex digits of SHA-256("sk-live-secret").
    let digest = Sha256::digest(b"sk-live-secret");
    let expected: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(c.id(), format!("tok:{expected}"));
    assert!(!c.id().contains("secret"));
}

#[test]
fn bearer_and_api_key_with_the_same_token_are_one_caller() {
    let id = identifier("");
    let a = id.caller(&headers(&[("authorization", "bearer abc")]), None);
    let b = id.caller(&headers(&[("x-api-key", "abc")]), None);
    assert_eq!(a, b);
}

#[test]
fn configured_keys_carry_tenant_and_tier() {
    let id = identifier("[[auth.keys]]\nkey = \"k1\"\ntenant = \"acme\"\ntier = \"admin\"\n");
    let c = id.caller(&headers(&[("x-api-key", "k1")]), None).expect("caller");
    assert_eq!((c.tenant(), c.tier()), (Some("acme"), "admin"));
    let config = LimitsConfig::from_toml(
        "[[auth.keys]]\nkey = \"k1\"\ntenant = \"acme\"\ntier = \"admin\"\n",
        &crate::config::Catalogue::new(),
    )
    .expect("config");
    assert_eq!(Caller::of_key(&config.auth.keys[0], &CallerIds::of(&config)), c, "the key's caller without the key");
    let other = id.caller(&headers(&[("x-api-key", "k2")]), None).expect("anonymous");
    assert_eq!((other.tenant(), other.tier()), (None, "default"));
}

#[test]
fn required_auth_refuses_missing_and_unknown_keys() {
    let id = identifier("[auth]\nrequired = true\n[[auth.keys]]\nkey = \"k1\"\n");
    assert_eq!(id.caller(&headers(&[]), ip("10.0.0.1")), Err(Unauthorized::Missing));
    assert_eq!(id.caller(&headers(&[("x-api-key", "nope")]), None), Err(Unauthorized::Unknown));
    assert!(id.caller(&headers(&[("authorization", "Bearer k1")]), None).is_ok());
}

#[test]
fn an_operator_names_callers_as_the_server_shows_them() {
    let id = identifier("[[auth.keys]]\nkey = \"k1\"\ntenant = \"acme\"\n");
    let keyed = id.caller(&headers(&[("x-api-key", "k1")]), None).expect("caller");
    assert_eq!(id.by_id(keyed.id(), None), Ok(keyed.clone()));
    assert_eq!(id.member_of("acme"), Some(keyed));
    let anonymous = id.caller(&headers(&[("x-api-key", "made-up")]), ip("203.0.113.7")).expect("caller");
    assert_eq!(id.by_id(anonymous.id(), None), Err(UnknownCaller::NeedsAddress(anonymous.id().to_owned())));
    assert_eq!(id.by_id(anonymous.id(), Some("ip:203.0.113.7")), Ok(anonymous));
    let v6 = id.caller(&headers(&[]), ip("2001:db8::7")).expect("caller");
    assert_eq!(id.by_id("ip:2001:db8::7", None), Ok(v6));
    assert!(matches!(id.by_id("tok:xyz", None), Err(UnknownCaller::Malformed(_))));
    assert!(matches!(id.by_id("alice", None), Err(UnknownCaller::Malformed(_))));
}

#[test]
fn a_request_start_stamp_counts_only_from_a_trusted_proxy_and_never_after_now() {
    let now: Nanos = Nanos::new(1_700_000_000_500_000_000);
    let stamped = |value: &str| headers(&[("x-request-start", value)]);
    let off = identifier("");
    assert_eq!(off.arrived(&stamped("t=1700000000.2"), ip("127.0.0.1"), now), now, "trust_proxy off");
    let on = identifier("[server]\ntrust_proxy = true\ntrusted_proxies = [\"10.0.0.0/8\"]\n");
    assert_eq!(on.arrived(&stamped("t=1700000000.2"), ip("203.0.113.9"), now), now, "an untrusted peer");
    assert_eq!(on.arrived(&stamped("t=1700000000.2"), None, now), now);
    let from_proxy = |value: &str| on.arrived(&stamped(value), ip("10.1.2.3"), now);
    // nginx's `t=${msec}` (seconds), Heroku's milliseconds, HAProxy's and Apache's microseconds.
    assert_eq!(from_proxy("t=1700000000.200"), Nanos::new(1_700_000_000_200_000_000));
    assert_eq!(from_proxy("1700000000300"), Nanos::new(1_700_000_000_300_000_000));
    assert_eq!(from_proxy("t=1700000000400000"), Nanos::new(1_700_000_000_400_000_000));
    for never_later in ["t=1800000000", "t=1e300", "NaN", "t=-5", "inf", "t=", "soon", "t=1700000000.2.1"] {
        assert_eq!(from_proxy(never_later), now, "{never_later}");
    }
}

#[test]
fn forwarded_for_is_ignored_unless_trusted() {
    let spoofed = headers(&[("x-forwarded-for", "6.6.6.6")]);
    let off = identifier("");
    assert_eq!(off.caller(&spoofed, ip("127.0.0.1")).expect("caller").id(), "ip:127.0.0.1");
    let on = identifier("[server]\ntrust_proxy = true\n");
    assert_eq!(on.caller(&spoofed, ip("127.0.0.1")).expect("caller").id(), "ip:6.6.6.6");
    // A peer that is not a trusted proxy cannot forward for anyone.
    assert_eq!(on.caller(&spoofed, ip("8.8.8.8")).expect("caller").id(), "ip:8.8.8.8");
}

#[test]
fn the_right_most_untrusted_hop_is_the_caller() {
    let on = identifier("[server]\ntrust_proxy = true\ntrusted_proxies = [\"127.0.0.1/8\", \"10.0.0.0/8\"]\n");
    let chain = headers(&[("x-forwarded-for", "1.1.1.1, 203.0.113.7"), ("x-forwarded-for", "10.1.2.3")]);
    assert_eq!(on.caller(&chain, ip("127.0.0.1")).expect("caller").id(), "ip:203.0.113.7");
    let garbage = headers(&[("x-forwarded-for", "not-an-ip, 10.1.2.3")]);
    assert_eq!(on.caller(&garbage, ip("127.0.0.1")).expect("caller").id(), "ip:10.1.2.3");
}

/// HMAC-SHA256 written out from RFC 2104 (a reference that shares no code with `hmac`).
fn reference_hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.iter().map(|b| b ^ byte).collect::<Vec<u8>>();
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(message).finalize();
    Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().into()
}

const SECRET: &str = "id-secret-for-tests-0123456789";

#[test]
fn an_id_secret_keys_caller_ids_with_hmac_of_the_keys_sha256() {
    let keyed = identifier(&format!("[auth]\nid_secret = \"{SECRET}\"\n"));
    let c = keyed.caller(&headers(&[("authorization", "Bearer sk-live-secret")]), ip("10.0.0.1")).expect("caller");
    let digest: [u8; 32] = Sha256::digest(b"sk-live-secret").into();
    let mac = reference_hmac(SECRET.as_bytes(), &digest);
    let expected: String = mac[..8].iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(c.id(), format!("tok:{expected}"), "tok: + 16 hex of HMAC-SHA256(id_secret, SHA-256(key))");
    assert_ne!(c.id(), Caller::from_token("sk-live-secret").id(), "not the unkeyed SHA-256 prefix");
    let again = identifier(&format!("[auth]\nid_secret = \"{SECRET}\"\n"));
    assert_eq!(again.caller(&headers(&[("x-api-key", "sk-live-secret")]), ip("10.0.0.1")), Ok(c.clone()));
    // A secret longer than SHA-256's block is hashed first, as HMAC says.
    let long = "a-long-secret-".repeat(8);
    let long_id = identifier(&format!("[auth]\nid_secret = \"{long}\"\n"))
        .caller(&headers(&[("x-api-key", "sk-live-secret")]), None)
        .expect("caller");
    let mac = reference_hmac(long.as_bytes(), &digest);
    let expected: String = mac[..8].iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(long_id.id(), format!("tok:{expected}"));
    let other = identifier("[auth]\nid_secret = \"another-secret-of-enough-length\"\n");
    let other = other.caller(&headers(&[("x-api-key", "sk-live-secret")]), None).expect("caller");
    assert_ne!(other.id(), c.id(), "another secret, another id");
    // No secret (or only blanks): today's unkeyed ids.
    for plain in ["", "[auth]\nid_secret = \"   \"\n"] {
        let unkeyed = identifier(plain).caller(&headers(&[("x-api-key", "sk-live-secret")]), None).expect("caller");
        assert_eq!(unkeyed.id(), Caller::from_token("sk-live-secret").id());
    }
    assert!(!format!("{keyed:?}").contains(SECRET), "the secret never shows in a Debug print");
}

#[test]
fn configured_keys_and_operators_use_the_keyed_ids() {
    let toml = format!(
        "[auth]\nid_secret = \"{SECRET}\"\n[[auth.keys]]\nkey = \"k1\"\ntenant = \"acme\"\n\
         [[auth.keys]]\nsha256 = \"{}\"\n",
        Sha256::digest(b"k2").iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    let config = LimitsConfig::from_toml(&toml, &crate::config::Catalogue::new()).expect("config");
    let id = Identifier::new(&config);
    let k1 = id.caller(&headers(&[("x-api-key", "k1")]), None).expect("caller");
    assert_eq!(k1.id(), CallerIds::of(&config).id_of_token("k1"));
    assert_eq!(Caller::of_key(&config.auth.keys[0], &CallerIds::of(&config)), k1);
    assert_eq!(id.configured(&config.auth.keys[0].sha256), Some(k1.clone()));
    assert_eq!(id.by_id(k1.id(), None), Ok(k1.clone()), "an operator finds it by the id the server shows");
    assert_eq!(id.member_of("acme"), Some(k1));
    // A key given only by its SHA-256 has its keyed id too.
    let k2 = id.caller(&headers(&[("x-api-key", "k2")]), None).expect("caller");
    assert_eq!((k2.id(), k2.unverified_from()), (CallerIds::of(&config).id_of_token("k2").as_str(), None));
    assert_eq!(id.by_id(k2.id(), None), Ok(k2));
    // An unkeyed id of a configured key names nobody configured.
    let unkeyed = Caller::from_token("k1");
    assert_eq!(id.by_id(unkeyed.id(), None), Err(UnknownCaller::NeedsAddress(unkeyed.id().to_owned())));
}

#[test]
fn an_ipv4_mapped_peer_is_its_ipv4_address() {
    // A dual-stack listener sees IPv4 clients as ::ffff:a.b.c.d.
    let off = identifier("");
    let caller = off.caller(&headers(&[]), ip("::ffff:1.2.3.4")).expect("caller");
    assert_eq!((caller.id(), caller.unverified_from()), ("ip:1.2.3.4", Some("ip:1.2.3.4")));
    assert_eq!(off.caller(&headers(&[]), ip("1.2.3.4")), Ok(caller.clone()), "one caller either way");
    assert_eq!(off.by_id("ip:::ffff:1.2.3.4", None), Ok(caller), "an operator's mapped form names it too");
    // A plain IPv6 peer is left as it is.
    assert_eq!(off.caller(&headers(&[]), ip("2001:db8::7")).expect("caller").id(), "ip:2001:db8::7");
}

#[test]
fn ipv6_callers_are_grouped_by_the_configured_prefix() {
    let addr = |s: &str| s.parse::<IpAddr>().expect("ip");
    // The grouping itself: host bits zero, IPv4 (and IPv4-mapped) left whole.
    assert_eq!(address_group(addr("2001:db8:1:2:3:4:5:6"), 64), addr("2001:db8:1:2::"));
    assert_eq!(address_group(addr("2001:db8:1:2ff:3:4:5:6"), 56), addr("2001:db8:1:200::"));
    assert_eq!(address_group(addr("2001:db8:1:2ff:3:4:5:6"), 48), addr("2001:db8:1::"));
    assert_eq!(address_group(addr("2001:db8::7"), 128), addr("2001:db8::7"));
    assert_eq!(address_group(addr("2001:db8::7"), 1), addr("::"));
    assert_eq!(address_group(addr("::ffff:1.2.3.4"), 48), addr("1.2.3.4"));
    assert_eq!(address_group(addr("1.2.3.4"), 48), addr("1.2.3.4"));
    // A /56 (256 /64s) is 256 addresses by default, one with ipv6_prefix = 56.
    let by = |toml: &str, peer: &str| {
        let caller = identifier(toml).caller(&headers(&[("x-api-key", "made-up")]), ip(peer)).expect("caller");
        caller.unverified_from().expect("unverified").to_owned()
    };
    assert_eq!(by("", "2001:db8:0:7::1"), "ip6:2001:db8:0:7::/64");
    assert_ne!(by("", "2001:db8:0:1::1"), by("", "2001:db8:0:2::1"));
    let wide = "[server]\nipv6_prefix = 56\n";
    assert_eq!(by(wide, "2001:db8:0:1::1"), "ip6:2001:db8::/56");
    assert_eq!(by(wide, "2001:db8:0:ff:ffff::1"), by(wide, "2001:db8:0:1::1"));
    assert_ne!(by(wide, "2001:db8:0:100::1"), by(wide, "2001:db8:0:1::1"), "the next /56");
    // An operator names such an address in the configured form only.
    let id = identifier(wide);
    let made_up = id.caller(&headers(&[("x-api-key", "made-up")]), ip("2001:db8:0:42::9")).expect("caller");
    assert_eq!(id.by_id(made_up.id(), Some("ip6:2001:db8::/56")), Ok(made_up.clone()));
    assert!(matches!(id.by_id(made_up.id(), Some("ip6:2001:db8::/64")), Err(UnknownCaller::BadAddress(_))));
}

#[test]
fn an_ipv4_mapped_proxy_is_the_trusted_ipv4_proxy() {
    let on = identifier("[server]\ntrust_proxy = true\ntrusted_proxies = [\"127.0.0.1/8\", \"10.0.0.0/8\"]\n");
    let forwarded = headers(&[("x-forwarded-for", "203.0.113.7")]);
    assert_eq!(on.caller(&forwarded, ip("::ffff:127.0.0.1")).expect("caller").id(), "ip:203.0.113.7");
    // A mapped hop is trusted like its IPv4 address, and a mapped client is named unmapped.
    let chain = headers(&[("x-forwarded-for", "::ffff:198.51.100.9, ::ffff:10.1.2.3")]);
    assert_eq!(on.caller(&chain, ip("::ffff:127.0.0.1")).expect("caller").id(), "ip:198.51.100.9");
    // An untrusted mapped peer is still not a proxy.
    assert_eq!(on.caller(&forwarded, ip("::ffff:8.8.8.8")).expect("caller").id(), "ip:8.8.8.8");
    // A proxy written in mapped form trusts the same peers.
    let mapped = identifier("[server]\ntrust_proxy = true\ntrusted_proxies = [\"::ffff:10.0.0.0/104\"]\n");
    for peer in ["10.1.2.3", "::ffff:10.1.2.3"] {
        assert_eq!(mapped.caller(&forwarded, ip(peer)).expect("caller").id(), "ip:203.0.113.7", "{peer}");
    }
}

fn claims(value: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    value.as_object().cloned().expect("an object")
}

const OAUTH: &str = "[auth.oauth]\nissuer = \"https://idp.example\"\n";

#[test]
fn a_verified_token_names_its_subject_tenant_tier_and_client_from_its_claims() {
    let id = identifier(OAUTH);
    assert!(id.takes_tokens() && !identifier("").takes_tokens());
    let alice = id
        .subject(&claims(
            serde_json::json!({"sub": "alice", "org_id": "acme", "tier": "admin", "client_id": "agent-app"}),
        ))
        .expect("a subject");
    assert!(alice.id().starts_with("sub:") && alice.id().len() == 20, "{}", alice.id());
    assert_eq!((alice.tenant(), alice.tier(), alice.client()), (Some("acme"), "admin", Some("agent-app")));
    assert_eq!((alice.unverified_from(), alice.proof()), (None, Proof::Token), "verified, never the address's");
    // Without the claims: its own tenant, tier default, the client from azp.
    let bob =
        id.subject(&claims(serde_json::json!({"sub": "bob", "azp": "other-app", "tier": "platinum"}))).expect("bob");
    assert_eq!((bob.tenant(), bob.tier(), bob.client()), (None, "default", Some("other-app")));
    assert!(id.subject(&claims(serde_json::json!({"org_id": "acme"}))).is_err(), "no sub, no caller");
    assert!(id.subject(&claims(serde_json::json!({"sub": ""}))).is_err());
}

#[test]
fn a_subject_id_is_keyed_by_its_issuer_and_the_id_secret() {
    let sub = |toml: &str| identifier(toml).subject(&claims(serde_json::json!({"sub": "alice"}))).expect("alice");
    let plain = sub(OAUTH);
    assert_eq!(plain, sub(OAUTH), "stable");
    assert_ne!(plain.id(), sub("[auth.oauth]\nissuer = \"https://other.example\"\n").id(), "another issuer's alice");
    let keyed = sub(&format!("{OAUTH}[auth]\nid_secret = \"{SECRET}\"\n"));
    assert_ne!(keyed.id(), plain.id(), "keyed with auth.id_secret");
    // (issuer, sub) pairs that concatenate alike are still apart.
    let ids = CallerIds::unkeyed();
    assert_ne!(ids.id_of_subject("https://a.b", "c"), ids.id_of_subject("https://a.", "bc"));
    // An operator names it back, with what it calls as.
    let id = identifier(OAUTH);
    let named = id.subject_by_id(plain.id(), None, None, None).expect("named");
    assert_eq!((named.id(), named.proof()), (plain.id(), Proof::Token));
    assert_eq!(id.by_id(plain.id(), None), Ok(named));
    assert!(matches!(id.subject_by_id(plain.id(), None, Some("gold"), None), Err(UnknownCaller::UnknownTier(_))));
    assert!(matches!(id.by_id("sub:xyz", None), Err(UnknownCaller::Malformed(_))));
}

#[test]
fn claim_values_that_are_not_plain_names_are_hashed_like_keys() {
    let id = identifier(OAUTH);
    let of = |value: serde_json::Value| {
        let caller = id
            .subject(&claims(serde_json::json!({"sub": "s", "org_id": value.clone(), "client_id": value})))
            .expect("s");
        (caller.tenant().map(str::to_owned), caller.client().map(str::to_owned))
    };
    let cimd = "https://app.example.com/oauth/client-metadata.json";
    let (tenant, client) = of(serde_json::json!(cimd));
    let hashed = client.expect("a client");
    assert!(hashed.starts_with('#') && hashed.len() == 17 && !hashed.contains("example"), "{hashed}");
    assert_eq!(tenant.as_deref(), Some(hashed.as_str()));
    assert_ne!(of(serde_json::json!("https://app.example.com/other.json")).1, Some(hashed));
    assert_eq!(of(serde_json::json!(["acme"])).0.as_deref(), Some("acme"), "Keycloak's organization list");
    assert_eq!(of(serde_json::json!({"acme": {"id": "42"}})).0.as_deref(), Some("acme"), "with attributes");
    assert_eq!(of(serde_json::json!(42)).0.as_deref(), Some("42"));
    assert_eq!(of(serde_json::json!(["a", "b"])).0, None, "two organizations name none");
    assert!(of(serde_json::json!("x".repeat(65))).0.is_some_and(|t| t.starts_with('#')));
    assert!(of(serde_json::json!("}{t:acme")).0.is_some_and(|t| t.starts_with('#')), "no brace reaches a hash tag");
}

#[test]
fn with_oauth_a_bearer_that_is_no_key_is_a_token_to_verify_and_an_api_key_is_not() {
    let id = identifier(&format!("{OAUTH}[auth]\nrequired = true\n[[auth.keys]]\nkey = \"k1\"\n"));
    let peer = ip("203.0.113.7");
    let bearer = headers(&[("authorization", "Bearer eyJ.a.b")]);
    let shown = format!("{:?}", id.identify(&bearer, peer));
    assert!(!shown.contains("eyJ.a.b") && shown.contains("Token"), "the token in a Debug string: {shown}");
    match id.identify(&bearer, peer).expect("a token to verify") {
        Identity::Token { token, digest, unverified } => {
            assert_eq!(token, "eyJ.a.b");
            assert_eq!(digest, <[u8; 32]>::from(Sha256::digest(b"eyJ.a.b")));
            assert_eq!(unverified.unverified_from(), Some("ip:203.0.113.7"), "until verified: its address's");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(id.identify(&headers(&[("authorization", "Bearer k1")]), peer), Ok(Identity::Caller(_))));
    assert_eq!(id.identify(&headers(&[("x-api-key", "eyJ.a.b")]), peer).map(|_| ()), Err(Unauthorized::Unknown));
    assert_eq!(id.identify(&headers(&[]), peer).map(|_| ()), Err(Unauthorized::Missing));
    // Off: a made-up bearer is an unverified caller, as before.
    let off = identifier("");
    assert!(matches!(off.identify(&bearer, peer), Ok(Identity::Caller(c)) if c.proof() == Proof::Unverified));
}
