//! Every Redis call bounded by the store's timeout, and what went wrong named in terms a user
//! can act on (an unreachable server, a URL of the wrong form, a timeout, keys on two slots).

use std::future::Future;
use std::time::Duration;

use ::redis::{ErrorKind, RedisError, RedisResult, ServerErrorKind};

use mcp_ratelimit_kernel::store::StoreError;

use crate::RedisStore;

/// Runs one Redis call under the store timeout, naming what went wrong in terms a user can act
/// on.
pub(super) async fn bounded<T>(
    address: &str,
    timeout: Duration,
    call: impl Future<Output = RedisResult<T>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(classify(address, timeout, e)),
        Err(_) => Err(StoreError::Timeout { store: STORE, address: address.to_owned(), timeout }),
    }
}

pub(super) fn classify(address: &str, timeout: Duration, e: RedisError) -> StoreError {
    let address = address.to_owned();
    if e.kind() == ErrorKind::Server(ServerErrorKind::CrossSlot) {
        StoreError::KeysApart { store: STORE, address }
    } else if e.kind() == ErrorKind::InvalidClientConfig {
        invalid_url(e.to_string())
    } else if e.is_timeout() {
        StoreError::Timeout { store: STORE, address, timeout }
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        unreachable(address, e.to_string())
    } else {
        StoreError::Failed { store: STORE, address, reason: e.to_string() }
    }
}

/// What this backend is called in its errors.
pub(super) const STORE: &str = "Redis";

/// Redis at `address` cannot be reached, with what to look at.
fn unreachable(address: String, reason: String) -> StoreError {
    StoreError::Unreachable {
        store: STORE,
        address,
        reason: format!("{reason}. Is redis-server running there and reachable from this host?"),
    }
}

/// A Redis URL that cannot be used: `why`, and the forms a URL takes.
pub(super) fn invalid_url(why: String) -> StoreError {
    StoreError::InvalidAddress(format!(
        "the Redis URL is not valid ({why}); expected redis://[:password@]host[:port][/db] (rediss:// for TLS) for \
         one server, or redis+cluster://[:password@]host1:port1,host2:port2,... (rediss+cluster:// for TLS; or \
         redis:// URLs separated by commas) for the nodes of a Redis Cluster"
    ))
}

impl RedisStore {
    /// A reply this store cannot read: `reason`, at this store's address.
    pub(super) fn malformed(&self, reason: String) -> StoreError {
        StoreError::Failed { store: STORE, address: self.address.clone(), reason }
    }
}
