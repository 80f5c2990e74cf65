//! Scopes: which budget a decision charges, as a typed value instead of strings spread around.
//!
//! A scope has a **name** that agents see — `caller:tok:1f2e…`, `tenant:acme`,
//! `in_flight:tenant:acme` — in refusals and in `rate_limit_status`, and a **store key** that
//! prefixes the name with a hash tag: `{t:acme}tenant:acme`. Every scope of one caller's decision
//! carries the same tag, so on a Redis Cluster all the keys of one decision live in one hash slot
//! and the decision stays one atomic script. The tag is what those scopes have in common: the
//! caller's tenant; for an unverified caller (no configured key) its address, which its address
//! budget is shared by; otherwise the caller itself.
//!
//! One scope is shared across tenants: an OAuth client application's (`client:<id>`), which all
//! subjects of one client draw on; it is tagged by its client.
//!
//! An unverified caller proves nothing about who it is (anyone can invent a key per request),
//! so what a tenant's callers share, all unverified callers of one address share: the tool
//! budgets (`address:<ip>:tool:<tool>`), the spend cap and the loop history are the address's,
//! and the address has its own request limit (`address_http:<ip>`), cost budget (`address:<ip>`)
//! and jobs in flight (`in_flight:address:<ip>`) beside each caller's own.

use crate::guard::policy::MethodGroup;
use crate::identity::Caller;

/// One budget a call is charged to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// `{tag}name`: the store key.
    key: String,
    /// Where the name starts in `key`.
    name_at: usize,
}

/// The hash tag every scope of `caller` shares: its kind and its value.
fn tag_of(caller: &Caller) -> (&'static str, &str) {
    match (caller.tenant(), caller.unverified_from()) {
        (Some(tenant), _) => ("t:", tenant),
        (None, Some(address)) => ("a:", address),
        (None, None) => ("c:", caller.id()),
    }
}

impl Scope {
    /// `{tag}name` in one allocation: scopes are made for every request.
    fn new(caller: &Caller, name: std::fmt::Arguments<'_>) -> Self {
        use std::fmt::Write as _;
        let (kind, tag) = tag_of(caller);
        let mut key = String::with_capacity(4 + kind.len() + tag.len() + 48);
        key.push('{');
        key.push_str(kind);
        key.push_str(tag);
        key.push('}');
        let name_at = key.len();
        // Writing to a String cannot fail.
        let _ = key.write_fmt(name);
        Self { key, name_at }
    }

    /// The coarse HTTP budget of `caller`.
    pub fn http(caller: &Caller) -> Self {
        Self::new(caller, format_args!("http:{}", caller.id()))
    }

    /// The per-method budget of `caller` for `group`.
    pub fn method(caller: &Caller, group: MethodGroup) -> Self {
        Self::new(caller, format_args!("method:{}:{}", group.as_str(), caller.id()))
    }

    /// The caller's own tool budget.
    pub fn caller(caller: &Caller) -> Self {
        Self::new(caller, format_args!("caller:{}", caller.id()))
    }

    /// The budget the caller's tenant shares, if it has one.
    pub fn tenant(caller: &Caller) -> Option<Self> {
        caller.tenant().map(|tenant| Self::new(caller, format_args!("tenant:{tenant}")))
    }

    /// The budget the unverified callers of the caller's address share, if it is unverified.
    pub fn address(caller: &Caller) -> Option<Self> {
        caller.unverified_from().map(|address| Self::new(caller, format_args!("address:{address}")))
    }

    /// The budget all subjects of the caller's OAuth client application share, if it came with a
    /// token that names one. Unlike every other scope of a call it is not the caller's to tag: it
    /// is shared across tenants, so it carries its client's own tag (`{o:<client>}`); a store
    /// that needs one hash slot per script decides it on its own slot (see the Redis store).
    pub fn client(caller: &Caller) -> Option<Self> {
        use std::fmt::Write as _;
        let client = caller.client()?;
        let mut key = String::with_capacity(2 * client.len() + 12);
        key.push_str("{o:");
        key.push_str(client);
        key.push('}');
        let name_at = key.len();
        let _ = write!(key, "client:{client}");
        Some(Self { key, name_at })
    }

    /// The coarse HTTP budget all unverified callers of the caller's address share, if it is
    /// unverified.
    pub fn address_http(caller: &Caller) -> Option<Self> {
        caller.unverified_from().map(|address| Self::new(caller, format_args!("address_http:{address}")))
    }

    /// A tool's own budget: the tenant's, the address's for an unverified caller, or the
    /// caller's.
    pub fn tool(caller: &Caller, tool: &str) -> Self {
        match (caller.tenant(), caller.unverified_from()) {
            (Some(tenant), _) => Self::new(caller, format_args!("tenant:{tenant}:tool:{tool}")),
            (None, Some(address)) => Self::new(caller, format_args!("address:{address}:tool:{tool}")),
            (None, None) => Self::new(caller, format_args!("caller:{}:tool:{tool}", caller.id())),
        }
    }

    /// The caller's jobs in flight.
    pub fn in_flight_caller(caller: &Caller) -> Self {
        Self::new(caller, format_args!("in_flight:caller:{}", caller.id()))
    }

    /// The tenant's jobs in flight, if the caller has a tenant (without one, the caller is its
    /// own tenant and [`Scope::in_flight_caller`] is the only cap).
    pub fn in_flight_tenant(caller: &Caller) -> Option<Self> {
        caller.tenant().map(|tenant| Self::new(caller, format_args!("in_flight:tenant:{tenant}")))
    }

    /// The jobs in flight of every unverified caller of the caller's address, if it is
    /// unverified.
    pub fn in_flight_address(caller: &Caller) -> Option<Self> {
        caller.unverified_from().map(|address| Self::new(caller, format_args!("in_flight:address:{address}")))
    }

    /// An operator's block on the caller (set through the admin API).
    pub fn block_caller(caller: &Caller) -> Self {
        Self::new(caller, format_args!("block:caller:{}", caller.id()))
    }

    /// An operator's block on the caller's tenant, if it has one: every caller of the tenant
    /// reads the same key (their tag is the tenant).
    pub fn block_tenant(caller: &Caller) -> Option<Self> {
        caller.tenant().map(|tenant| Self::new(caller, format_args!("block:tenant:{tenant}")))
    }

    /// The mark that lets the caller resume one call answered "input required" (`digest` names
    /// the call and its state; see [`crate::guard::after::resume`]).
    pub fn resume(caller: &Caller, digest: &str) -> Self {
        Self::new(caller, format_args!("resume:{}:{digest}", caller.id()))
    }

    /// The caller's recent calls, for loop detection: its address's for an unverified caller.
    pub fn loops(caller: &Caller) -> Self {
        Self::new(caller, format_args!("loops:{}", loop_owner(caller)))
    }

    /// The daily spend cap of the caller's tenant, of its address for an unverified caller, or
    /// of the caller.
    pub fn spend(caller: &Caller) -> Self {
        match (caller.tenant(), caller.unverified_from()) {
            (Some(tenant), _) => Self::new(caller, format_args!("spend:tenant:{tenant}")),
            (None, Some(address)) => Self::new(caller, format_args!("spend:address:{address}")),
            (None, None) => Self::new(caller, format_args!("spend:caller:{}", caller.id())),
        }
    }

    /// This scope for another of its limits: `suffix` (`#day`) appended to its key and name, so
    /// each limit of a scope keeps its own state.
    pub fn for_limit(&self, suffix: &str) -> Self {
        Self { key: format!("{}{suffix}", self.key), name_at: self.name_at }
    }

    /// What agents see: `caller:tok:1f2e…`, `tenant:acme`, ….
    pub fn name(&self) -> &str {
        &self.key[self.name_at..]
    }

    /// Where the state lives: the name behind the hash tag.
    pub fn key(&self) -> &str {
        &self.key
    }
}

/// Whose call history loop detection keeps for `caller`: its own, or for an unverified caller
/// its address's, so a stuck agent that invents a key per call is still seen repeating itself.
pub(super) fn loop_owner(caller: &Caller) -> &str {
    caller.unverified_from().unwrap_or(caller.id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scope_of_a_callers_decision_shares_one_hash_tag_and_names_stay_readable() {
        let caller = Caller::from_token("agent");
        let scopes = [Scope::http(&caller), Scope::caller(&caller), Scope::tool(&caller, "generate_image")];
        let tag = |s: &Scope| s.key()[..s.key().find('}').expect("tagged") + 1].to_owned();
        assert!(scopes.iter().all(|s| tag(s) == tag(&scopes[0])), "{scopes:?}");
        assert_eq!(scopes[1].name(), format!("caller:{}", caller.id()));
        assert!(scopes[1].key().starts_with("{c:tok:") && scopes[1].key().ends_with(scopes[1].name()));
    }
}
