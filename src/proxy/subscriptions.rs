//! How many 2026-07-28 subscriptions (`subscriptions/listen`) callers hold open through the proxy.
//!
//! A subscription is a request that stays open until its caller ends it, and it opens no session,
//! so no session cap counts it; each holds a stream, a task and their channels (about 55 KB
//! measured). And a caller without a configured key can invent a key per request, each with a
//! budget of its own. So:
//!
//! - a configured caller (a key, a token's subject, stdio's one caller) holds at most
//!   `proxy.max_subscriptions_per_caller` open at once;
//! - the unverified callers of one address (no key, or made-up keys however many; IPv6 by
//!   `server.ipv6_prefix`) hold at most `proxy.max_subscriptions_per_address` together, as they
//!   share that address's sessions and budgets.
//!
//! One past its bound is refused `busy`, naming the bound, before it is charged. A place is
//! counted and handed to its guard in one step, under one lock, and the guard gives it back when
//! it is dropped: the subscription ended, its caller closed it, or the proxy stopped — whatever
//! future held it was dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::clock::Nanos;
use crate::config::ProxyConfig;
use crate::guard::Refusal;
use crate::identity::Caller;

/// The wait a caller refused a subscription is told: a guess, since a place frees only when a
/// subscription holding one is closed.
const WAIT: Nanos = Nanos::from_secs(5);

/// Whose subscriptions are counted together.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Holder {
    /// One configured caller's (its id).
    Caller(Arc<str>),
    /// The unverified callers' of one address.
    Address(Arc<str>),
}

impl Holder {
    fn of(caller: &Caller) -> Self {
        match caller.unverified_from() {
            Some(address) => Holder::Address(Arc::from(address)),
            None => Holder::Caller(Arc::from(caller.id())),
        }
    }
}

/// The subscriptions open through the proxy, per holder, and the bounds they are held to.
#[derive(Debug)]
pub struct Subscriptions {
    per_caller: usize,
    per_address: usize,
    open: Arc<Mutex<HashMap<Holder, usize>>>,
}

impl Subscriptions {
    /// The bounds `[proxy]` sets (`max_subscriptions_per_caller`, `max_subscriptions_per_address`).
    pub fn new(config: &ProxyConfig) -> Self {
        Self {
            per_caller: config.max_subscriptions_per_caller,
            per_address: config.max_subscriptions_per_address,
            open: Arc::default(),
        }
    }

    /// A place for one more subscription of `caller`'s (opened by `what`), held until the
    /// returned guard is dropped; or, its holder's bound reached, the refusal.
    pub fn open(&self, caller: &Caller, what: &str) -> Result<Subscribed, Refusal> {
        let holder = Holder::of(caller);
        let (max, address) = match holder {
            Holder::Caller(_) => (self.per_caller, false),
            Holder::Address(_) => (self.per_address, true),
        };
        let mut open = lock(&self.open);
        let held = open.get(&holder).copied().unwrap_or(0);
        if held >= max {
            let max = u64::try_from(max).unwrap_or(u64::MAX);
            return Err(Refusal::subscriptions_full(what, address, max, WAIT));
        }
        open.insert(holder.clone(), held.saturating_add(1));
        Ok(Subscribed { open: self.open.clone(), holder })
    }

    /// Subscriptions open now, every caller together.
    pub fn count(&self) -> usize {
        lock(&self.open).values().fold(0, |all, held| all.saturating_add(*held))
    }
}

fn lock(open: &Mutex<HashMap<Holder, usize>>) -> MutexGuard<'_, HashMap<Holder, usize>> {
    open.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One subscription's place among its holder's, given back when dropped.
#[derive(Debug)]
pub struct Subscribed {
    open: Arc<Mutex<HashMap<Holder, usize>>>,
    holder: Holder,
}

impl Drop for Subscribed {
    fn drop(&mut self) {
        let mut open = lock(&self.open);
        if let Some(held) = open.get_mut(&self.holder) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                open.remove(&self.holder);
            }
        }
    }
}
