//! The caller a request is charged to: its id, tenant, tier and address, and how it proved who
//! it is.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::CallerIds;
use crate::config::ApiKey;

/// The identity a request is charged to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Caller {
    pub(super) id: String,
    tenant: Option<Arc<str>>,
    tier: Arc<str>,
    unverified_from: Option<Arc<str>>,
    /// The OAuth client application a token's caller came through, as shown.
    pub(super) client: Option<Arc<str>>,
    /// [`bucket_of`] the id, computed once: every refusal reports it, some several times.
    bucket: u8,
}

/// How a caller proved who it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proof {
    /// The local user of a stdio transport.
    Local,
    /// A configured key (`[[auth.keys]]`).
    Key,
    /// An OAuth access token the server verified (`[auth.oauth]`).
    Token,
    /// Nothing: no credential, or one nobody configured or could verify. Held to its address's
    /// budgets.
    Unverified,
}

impl Proof {
    /// As `rate_limit_status`, the dashboard and traces say it.
    pub fn as_str(self) -> &'static str {
        match self {
            Proof::Local => "local",
            Proof::Key => "key",
            Proof::Token => "token",
            Proof::Unverified => "unverified",
        }
    }
}

impl Caller {
    pub(super) fn new(id: String, tenant: Option<Arc<str>>, tier: Arc<str>, unverified_from: Option<Arc<str>>) -> Self {
        let bucket = bucket_of(&id);
        Self { id, tenant, tier, unverified_from, client: None, bucket }
    }

    pub(super) fn from_digest(
        ids: &CallerIds,
        digest: &[u8; 32],
        tenant: Option<Arc<str>>,
        tier: Arc<str>,
        unverified_from: Option<Arc<str>>,
    ) -> Self {
        Self::new(ids.id_of_digest(digest), tenant, tier, unverified_from)
    }

    /// A caller known by a credential (tier `default`, no tenant, not tied to an address), named
    /// as a server without `auth.id_secret` names it.
    pub fn from_token(token: &str) -> Self {
        Self::from_digest(&CallerIds::unkeyed(), &Sha256::digest(token.as_bytes()).into(), None, "default".into(), None)
    }

    /// The caller a configured key names, with its tenant and tier, its id derived by `ids` (the
    /// config's `auth.id_secret`): what [`Identifier::identify`] returns for that key, for callers
    /// that act as a key without holding it (the simulator).
    ///
    /// [`Identifier::identify`]: super::Identifier::identify
    pub fn of_key(key: &ApiKey, ids: &CallerIds) -> Self {
        Self::from_digest(ids, &key.sha256, key.tenant.as_deref().map(Arc::from), Arc::from(key.tier.as_str()), None)
    }

    /// The stable, non-secret identifier (`tok:…`, `ip:…` or `local`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The tenant whose shared budget this caller draws on, if its key has one.
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// [`Caller::tenant`], shared (for records that keep it).
    pub fn tenant_shared(&self) -> Option<&Arc<str>> {
        self.tenant.as_ref()
    }

    /// The tier scaling this caller's own budgets.
    pub fn tier(&self) -> &str {
        &self.tier
    }

    /// For a caller without a configured key, the address it came from (`ip:…`, or `ip6:…/64`
    /// with the configured prefix), whose budget all such callers share; `None` for configured
    /// keys and stdio.
    pub fn unverified_from(&self) -> Option<&str> {
        self.unverified_from.as_deref()
    }

    /// A small, stable bucket (0-15) for metric labels: enough to see whether rejections come
    /// from a few callers or many, never enough to name one.
    pub fn bucket(&self) -> u8 {
        self.bucket
    }

    /// For a caller known by an OAuth token, the client application it came through (as shown:
    /// plain, or hashed), whose subjects share `[limits.client]`.
    pub fn client(&self) -> Option<&str> {
        self.client.as_deref()
    }

    /// How it proved who it is.
    pub fn proof(&self) -> Proof {
        if self.unverified_from.is_some() {
            Proof::Unverified
        } else if self.id.starts_with("sub:") {
            Proof::Token
        } else if self.id == "local" {
            Proof::Local
        } else {
            Proof::Key
        }
    }
}

/// The 16-way bucket (0-15) of an identifier (a caller id, a tenant's flow), for metric labels.
pub fn bucket_of(id: &str) -> u8 {
    Sha256::digest(id.as_bytes())[0] & 0x0f
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id)
    }
}
