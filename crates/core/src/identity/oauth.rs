//! A caller named from a verified OAuth access token's claims (`[auth.oauth]`): its subject,
//! tenant, tier and client, and an operator's name for such a subject.

use std::sync::Arc;

use super::{Caller, Identifier, NoSubject, UnknownCaller};
use crate::config::OAuthConfig;

/// How `[auth.oauth]` names a caller from a verified token's claims.
#[derive(Debug)]
pub(super) struct Claims {
    issuer: String,
    tenant: String,
    tier: String,
    client: String,
}

impl Claims {
    /// The claims `oauth` names, when it is on.
    pub(super) fn of(oauth: &OAuthConfig) -> Option<Self> {
        oauth.enabled().then(|| Self {
            issuer: oauth.issuer.clone(),
            tenant: oauth.tenant_claim.clone(),
            tier: oauth.tier_claim.clone(),
            client: oauth.client_claim.clone(),
        })
    }
}

/// A claim's value as a name: a string; a number; a list of one string (Keycloak's
/// `organization`); a map of one key (the same, with attributes). Anything else names nothing.
fn claim_value(value: Option<&serde_json::Value>) -> Option<String> {
    use serde_json::Value;
    let name = match value? {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Array(items) if items.len() == 1 => items[0].as_str()?.to_owned(),
        Value::Object(map) if map.len() == 1 => map.keys().next()?.clone(),
        _ => return None,
    };
    (!name.is_empty()).then_some(name)
}

impl Identifier {
    /// Whether bearer tokens that are no configured key are OAuth access tokens to verify
    /// (`[auth.oauth]` is on).
    pub fn takes_tokens(&self) -> bool {
        self.claims.is_some()
    }

    /// The caller a verified token's `claims` name: `sub:` + 16 hex digits of (the issuer, `sub`),
    /// the tenant its tenant claim names (none: the subject is its own tenant), the tier its tier
    /// claim names when that is a configured tier (else `default`), and the client its client
    /// claim (else `azp`) names. Never unverified: the authorization server vouches for it.
    pub fn subject(&self, claims: &serde_json::Map<String, serde_json::Value>) -> Result<Caller, NoSubject> {
        let sub = claims.get("sub").and_then(|v| v.as_str()).filter(|s| (1..=1024).contains(&s.len()));
        let sub = sub.ok_or(NoSubject::Missing)?;
        let Some(names) = &self.claims else { return Err(NoSubject::Missing) };
        let id = self.ids.id_of_subject(&names.issuer, sub);
        let tenant = claim_value(claims.get(&names.tenant)).map(|t| Arc::from(self.ids.shown(&t)));
        let tier = claims
            .get(&names.tier)
            .and_then(|v| v.as_str())
            .and_then(|t| self.tiers.get(t).cloned())
            .unwrap_or_else(|| Arc::from("default"));
        let client = claim_value(claims.get(&names.client).or_else(|| claims.get("azp")));
        let mut caller = Caller::new(id, tenant, tier, None);
        caller.client = client.map(|c| Arc::from(self.ids.shown(&c)));
        Ok(caller)
    }

    /// The subject an operator names by the id the server shows (`sub:…`), with the tenant, tier
    /// and client it calls with (none of which the id says): its budgets are found by them.
    pub fn subject_by_id(
        &self,
        id: &str,
        tenant: Option<&str>,
        tier: Option<&str>,
        client: Option<&str>,
    ) -> Result<Caller, UnknownCaller> {
        let hex = id.strip_prefix("sub:").ok_or_else(|| UnknownCaller::Malformed(id.to_owned()))?;
        if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(UnknownCaller::Malformed(id.to_owned()));
        }
        let tier = tier.unwrap_or("default");
        let tier = self.tiers.get(tier).cloned().ok_or_else(|| UnknownCaller::UnknownTier(tier.to_owned()))?;
        let mut caller = Caller::new(id.to_owned(), tenant.map(Arc::from), tier, None);
        caller.client = client.map(Arc::from);
        Ok(caller)
    }
}
