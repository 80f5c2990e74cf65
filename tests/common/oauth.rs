//! A real authorization server for the tests: `oauth2-mock-server` (npm, installed into
//! `.tools/node` by `scripts/proxy-fixtures.sh`), wrapped by `tests/fixtures/oauth_provider.mjs`,
//! which counts the JWKS fetches and lets a test mint, forge and rotate (see the script's header).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Stdio;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

fn installed(path: PathBuf) -> String {
    assert!(path.exists(), "{} is missing: run scripts/proxy-fixtures.sh (make test does)", path.display());
    path.to_string_lossy().into_owned()
}

/// The authorization server, running until dropped.
pub(crate) struct Provider {
    pub issuer: String,
    http: reqwest::Client,
    _child: Child,
}

impl Provider {
    /// Starts one whose `client_credentials` tokens carry, per client id, the extra claims in
    /// `clients` (e.g. `{"agent-app": {"org_id": "acme"}}`).
    pub(crate) async fn start(clients: Value) -> Self {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let node = installed(root.join(".tools/node/node_modules/.bin/node"));
        let script = installed(root.join("tests/fixtures/oauth_provider.mjs"));
        let mut child = Command::new(node)
            .arg(script)
            .arg(clients.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("node starts");
        let stdout = child.stdout.take().expect("stdout");
        let line = tokio::time::timeout(std::time::Duration::from_secs(30), BufReader::new(stdout).lines().next_line())
            .await
            .expect("the provider starts within 30 s")
            .expect("its stdout")
            .expect("a line naming the issuer");
        let started: Value = serde_json::from_str(&line).expect("JSON");
        let issuer = started["issuer"].as_str().expect("issuer").to_owned();
        Self { issuer, http: reqwest::Client::new(), _child: child }
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        let response = self.http.post(format!("{}{path}", self.issuer)).json(&body).send().await.expect("provider");
        assert!(response.status().is_success(), "{path}: {}", response.status());
        response.json().await.expect("JSON")
    }

    /// A token signed with the provider's current key: the standard claims (`iss`, `iat`, `nbf`
    /// 10 s ago, `exp` in an hour), then `claims` (a null removes one).
    pub(crate) async fn mint(&self, claims: Value) -> String {
        self.mint_with(claims, json!({})).await
    }

    /// [`Provider::mint`] with header fields of its own (a `kid`, say).
    pub(crate) async fn mint_with(&self, claims: Value, header: Value) -> String {
        let minted = self.post("/test/mint", json!({"claims": claims, "header": header})).await;
        minted["token"].as_str().expect("token").to_owned()
    }

    /// A token a resource server must refuse: `other_key`, `own_key`, `none` or `hs256_public`.
    pub(crate) async fn forge(&self, kind: &str, claims: Value) -> String {
        self.forge_with(kind, claims, json!({})).await
    }

    /// [`Provider::forge`] with header fields of the forger's (`jku`, `x5u`).
    pub(crate) async fn forge_with(&self, kind: &str, claims: Value, header: Value) -> String {
        let forged = self.post("/test/forge", json!({"kind": kind, "claims": claims, "header": header})).await;
        forged["token"].as_str().expect("token").to_owned()
    }

    /// A new signing key, the only one tokens are signed with from now on; its kid.
    pub(crate) async fn rotate(&self) -> String {
        self.post("/test/rotate", json!({})).await["kid"].as_str().expect("kid").to_owned()
    }

    /// Introspection answers `claims` (active) for the opaque `token`.
    pub(crate) async fn opaque(&self, token: &str, claims: Value) {
        self.post("/test/opaque", json!({"token": token, "claims": claims})).await;
    }

    /// Requests served so far: `{jwks, discovery, token, introspect}`.
    pub(crate) async fn stats(&self) -> Value {
        let response = self.http.get(format!("{}/test/stats", self.issuer)).send().await.expect("provider");
        response.json().await.expect("JSON")
    }

    /// How many times the JWKS was fetched.
    pub(crate) async fn jwks_fetches(&self) -> u64 {
        self.stats().await["jwks"].as_u64().expect("count")
    }
}
