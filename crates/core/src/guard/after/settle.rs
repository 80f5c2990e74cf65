//! The last stage of a priced call: its price settled from what the upstream says it used.
//!
//! A fixed price over- or under-charges whenever the work depends on the arguments or on what
//! the upstream actually did (a video cut shorter than asked, tokens an answer did not need).
//! So the guard's admission ([`Guard::call`](crate::guard::Guard::call)) *reserves* the call's price — its `[tools.NAME] cost`,
//! or that cost's formula over the arguments — in every budget counted in cost units (the
//! caller's, its tenant's, its address's, the spend cap), atomically with everything else, and
//! keeps the reservation as a [`Reserved`]. No door settles it: the guard does, by one rule,
//! [`Reserved::charge_for`], when the call answers, or, for work that outlives its answer (a job,
//! a proxied task), when that work is final ([`Held::finish`]):
//!
//! | the answer | charged |
//! | --- | --- |
//! | reports `usage.units` (`settle = "usage"`: the default for our tools and a library's, not for a proxied server's) | those units |
//! | the upstream never started the work: a job that never left our queue (canceled or expired there, or given up after the server's own submissions were refused: retries the server owns, not the agent's), a proxied call never sent | 0 |
//! | anything else: no report, the upstream's refusal or error, a timeout (a job's submission that went unanswered included: the upstream may have started it), a cancelled call | the reservation |
//!
//! The last row keeps a decision made before prices were settled: a failed upstream call is still
//! charged, because the budget protects the upstream from the agent, and an agent hammering a
//! failing upstream must be slowed as much as one hammering a healthy one (and a timed-out or
//! cancelled call may have been done, and billed).
//!
//! The difference goes back, or is taken on top, in each of those budgets through its
//! algorithm's adjustment ([`Adjustment`]) on the store that decided the call (Redis, or this
//! instance's insurance limiter while Redis was down), in one script on Redis:
//!
//! - **given back only where it was taken** ([`Adjustment::Return`]): each budget remembers when
//!   the call's charge landed, on the store's clock (its decision's `at` and `reset_after`), and
//!   gets the difference back in that window — a fixed window's, the day of a spend cap — or a
//!   sliding window's count it was taken in (the previous one's, in the next window), or the
//!   sliding log's entry at its instant, while it is still in the log; a bucket gets back what the
//!   unused units still owe. A refund that comes after its window (or its debt) has passed gives
//!   nothing back, never to a later window: the budget then stands as it would had the call
//!   cost its settled price. Never past the capacity either.
//! - **taken on top now** ([`Adjustment::Charge`]): usage above the reservation was not known
//!   when the call was decided, so it is charged when it is, to the current window, like a new
//!   call; past what is left it takes what is left — a budget never goes below empty.
//! - **after a reload** the budgets are planned anew under every limits put in force since the
//!   charge: a budget whose limit changed at any of them (a lowered burst, another window, even
//!   one put back since) gets nothing back — its state was kept under another limit (a lowered
//!   burst caps a token bucket's saved level), and a refund by the old one could give more than
//!   the call took; so does every budget when more reloads came than are remembered (16). A
//!   charge on top goes to the limiter in force. The job then says what the budgets stand at: its
//!   reservation when no budget could take the difference.
//!
//! A settlement the store does not take (Redis away, or slower than `store.timeout_ms`) is tried
//! again, with a growing pause on the server's clock, for up to [`TRIES_FOR`]. A try whose answer was lost may have
//! been applied all the same — Redis ran the script, the answer came too late — so every try
//! carries the settlement's mark, set in the same script, and a try that finds its mark set
//! changes nothing: applied exactly once however often it is sent. A job waits for its
//! settlement to land before it says what it was charged ([`Held::finish`]); a call answered
//! at once says the settled price while the tries go on behind it.
//! A settlement given up on after a minute is logged and counted
//! (`mcp_ratelimit_settlements_given_up_total`), and the reservation stands: the job says so;
//! an answer already given said the settled price (after a lost answer nobody can know which
//! stands, and a lost refund can only have charged more, never admitted more). A reservation
//! dropped without being settled stands too: a door that does not settle charges what it
//! reserved, as a fixed price always did.

use std::any::Any;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Nanos, SharedClock};
use crate::config::Settle;
use crate::guard::refusal_memory::RefusalMemory;
use crate::guard::{Admission, TakeOnce};
use crate::limit::{Adjustment, Limiter, Shape, Taken};
use crate::ops::metrics::Metrics;
use crate::store::Store;

/// How long a settlement the store does not take is tried again: past a Redis restart or a
/// failover, and well within the life of its mark ([`crate::store::MARK_LIVES`]).
pub const TRIES_FOR: Duration = Duration::from_secs(60);
/// The pause before the first try again; it doubles up to [`LONGEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(250);
/// The longest pause between two tries.
const LONGEST_PAUSE: Duration = Duration::from_secs(5);

/// What the work behind a call came to, as far as its price goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Used {
    /// The upstream reported using this many units.
    Reported(u64),
    /// The upstream never started the work: the job never left our queue (the server's own
    /// refused submissions aside), the proxied call was never sent.
    Nothing,
    /// Nobody says: the reservation stands.
    Unreported,
}

/// A reservation as another instance sharing the store can give it back ([`Reserved::handed`]):
/// the job it paid for waited on an instance that died before submitting it, so nothing ran and
/// nothing is owed. Each budget is named by its key (caller ids are hashes: no credential) with its
/// limiter as the store's scripts take it (algorithm, capacity, shape) and where the charge landed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Handed {
    /// The tool the call was of.
    pub tool: String,
    /// Units reserved.
    pub units: u64,
    budgets: Vec<HandedBudget>,
}

/// One budget of a [`Handed`] reservation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct HandedBudget {
    key: String,
    algorithm: String,
    capacity: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    period: Option<Nanos>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    window: Option<Nanos>,
    at: Nanos,
    reset_after: Nanos,
}

impl Handed {
    /// Gives the whole reservation back (the work never started: [`Used::Nothing`]) in every
    /// budget that took it, on `store`, tried as any settlement is; what was reserved and what
    /// it was charged in the end. A budget whose limiter cannot be rebuilt (a name this build
    /// does not know) keeps its charge.
    pub async fn give_back(self, store: Arc<dyn Store>, clock: SharedClock, metrics: Arc<Metrics>) -> Settled {
        let budgets = self
            .budgets
            .into_iter()
            .filter_map(|b| {
                let shape = match (b.period, b.window) {
                    (Some(period), _) => Shape::Rate { period },
                    (None, Some(window)) => Shape::Window { window },
                    (None, None) => Shape::Slots,
                };
                let limiter = Limiter::with_shape(&b.algorithm, b.capacity, shape)?;
                Some((b.key, limiter, Taken { at: b.at, reset_after: b.reset_after }))
            })
            .collect();
        // Settled under the limiters it was charged by, whatever was reloaded since.
        let in_force: InForce = Box::new(|| Some(Vec::new()));
        let reserved = Reserved::new(
            (&self.tool, self.units, Settle::Reserved),
            (store, clock),
            (budgets, in_force),
            metrics,
            None,
        );
        reserved.settle(Used::Nothing).await
    }
}

/// A call's price, reserved and settled, as the agent sees both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Units reserved before the call ran.
    pub reserved: u64,
    /// Units it was charged in the end: its settled price (a budget that had less left gave
    /// what it had, and stands at empty).
    pub charged: u64,
}

/// What a call holds past its answer while its work goes on (a job, a proxied task): its
/// admission — in-flight slots and reserved price — and the slots its door took for it (an
/// account's). Work that outlives its answer ends one way, [`Held::finish`]: every slot back at
/// once, then the price settled for what the work came to. (A call answered at once is settled by
/// the guard as it answers: [`Guard::call`](crate::guard::Guard::call).)
pub struct Held {
    /// `None` for work started without an admission (never through the guard): it holds no
    /// slot of the caller's and costs nothing.
    admission: Option<Admission>,
    slots: Vec<Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").field("units", &self.units()).field("slots", &self.slots.len()).finish()
    }
}

impl Held {
    /// The admission `admission` holds, taken for work that goes on past its answer (it is then
    /// no longer the guard's to settle); nothing if another took it.
    pub fn taking(admission: &TakeOnce<Admission>) -> Self {
        Self { admission: admission.take(), slots: Vec::new() }
    }

    /// Holds `slot` too, until the work is final.
    pub fn hold(&mut self, slot: impl Any + Send + Sync) {
        self.slots.push(Box::new(slot));
    }

    /// Units reserved, if the call has a price still to settle.
    pub fn units(&self) -> Option<u64> {
        self.admission.as_ref()?.reserved.as_ref().map(Reserved::units)
    }

    /// The reservation written down for another instance to give back ([`Reserved::handed`]).
    pub fn handed(&self) -> Option<Handed> {
        self.admission.as_ref()?.reserved.as_ref().and_then(Reserved::handed)
    }

    /// Its price was given back elsewhere (by the instance that ended the job): nothing is left to
    /// settle here.
    pub fn settled_elsewhere(&mut self) {
        if let Some(admission) = &mut self.admission {
            admission.reserved = None;
        }
    }

    /// The work is final, having come to `used`: every slot goes back now, as this is called; the
    /// future settles the price, tried until the store takes it (for up to [`TRIES_FOR`]), and says
    /// what was charged (`None`: the call had no price to settle).
    pub fn finish(mut self, used: Used) -> impl Future<Output = Option<Settled>> + Send + 'static {
        let reserved = self.admission.as_mut().and_then(|a| a.reserved.take());
        drop(self);
        async move {
            match reserved {
                Some(reserved) => Some(reserved.settle(used).await),
                None => None,
            }
        }
    }
}

/// The limiter each of a call's budgets was decided by, by key, under every limits put in force
/// since the call was charged (a reload each), oldest first: none when nothing was reloaded;
/// `None` when more was reloaded than is remembered.
pub type InForce = Box<dyn Fn() -> Option<Vec<Vec<(String, Limiter)>>> + Send + Sync>;

/// A settlement's adjustment of each budget, as every try sends it, and what it says in the
/// metrics: `refunded` or `charged`, and the units.
struct Adjusting {
    budgets: Vec<(String, Limiter, Adjustment)>,
    how: (&'static str, u64),
}

/// The price an admitted call reserved, until it is settled.
#[must_use = "a reservation dropped unsettled stands: the call is charged what it reserved"]
pub struct Reserved {
    tool: String,
    units: u64,
    settle: Settle,
    store: Arc<dyn Store>,
    /// The server's clock, which paces the tries again.
    clock: SharedClock,
    /// The budgets that took the reservation: each key, its limiter, and where the charge landed.
    budgets: Vec<(String, Limiter, Taken)>,
    /// The budgets' limiters now, if a reload changed them.
    in_force: InForce,
    metrics: Arc<Metrics>,
    /// The memory of a shared store's refusals, which a refund makes stale for these keys.
    refusals: Option<Arc<RefusalMemory>>,
}

impl std::fmt::Debug for Reserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reserved").field("tool", &self.tool).field("units", &self.units).finish_non_exhaustive()
    }
}

impl Reserved {
    /// A reservation of `units` for a call of `tool`, taken in `budgets` on `store`; tries
    /// again are paced by `clock`.
    pub(in crate::guard) fn new(
        (tool, units, settle): (&str, u64, Settle),
        (store, clock): (Arc<dyn Store>, SharedClock),
        (budgets, in_force): (Vec<(String, Limiter, Taken)>, InForce),
        metrics: Arc<Metrics>,
        refusals: Option<Arc<RefusalMemory>>,
    ) -> Self {
        Self { tool: tool.to_owned(), units, settle, store, clock, budgets, in_force, metrics, refusals }
    }

    /// Units reserved.
    pub fn units(&self) -> u64 {
        self.units
    }

    /// This reservation written down for another instance sharing the store, to give back if
    /// this one dies before the work starts ([`Handed::give_back`]); `None` when it was taken on
    /// this instance's own store (the insurance limiter while the shared one was down: nobody
    /// else could give it back there) or took no budget.
    pub fn handed(&self) -> Option<Handed> {
        if !self.store.is_shared() || self.budgets.is_empty() {
            return None;
        }
        let budgets = self
            .budgets
            .iter()
            .map(|(key, limiter, taken)| {
                let (period, window) = match limiter.shape() {
                    Shape::Rate { period } => (Some(period), None),
                    Shape::Window { window } => (None, Some(window)),
                    Shape::Slots => (None, None),
                };
                HandedBudget {
                    key: key.clone(),
                    algorithm: limiter.algorithm().to_owned(),
                    capacity: limiter.capacity(),
                    period,
                    window,
                    at: taken.at,
                    reset_after: taken.reset_after,
                }
            })
            .collect();
        Some(Handed { tool: self.tool.clone(), units: self.units, budgets })
    }

    /// What a call whose work came to `used` is charged (the table in the module doc).
    pub fn charge_for(&self, used: Used) -> u64 {
        match (self.settle, used) {
            (Settle::Usage, Used::Reported(units)) => units,
            // Work never started costs nothing, whoever is trusted to bill it.
            (_, Used::Nothing) => 0,
            (Settle::Usage, Used::Unreported) | (Settle::Reserved, _) => self.units,
        }
    }

    /// Settles the reservation for work that came to `used`: the difference refunded, or
    /// charged on top, in every budget that took it, tried until the store takes it. Returns
    /// what was reserved and charged: the settled price once the store took it; when it would
    /// not take it for [`TRIES_FOR`], the reservation, which then stands.
    pub(crate) async fn settle(self, used: Used) -> Settled {
        let (settled, adjusting) = self.settling(used);
        let Some(adjusting) = adjusting else { return settled };
        let mark = self.mark(&adjusting);
        if self.try_once(&adjusting, &mark).await || self.keep_trying(&adjusting, &mark).await {
            settled
        } else {
            Settled { charged: self.units, ..settled }
        }
    }

    /// The same for an answer that cannot wait for a store that does not answer: one try, and
    /// if the store does not take it, the same tries go on behind the answer, which says the
    /// settled price they are making.
    pub(crate) async fn settle_behind(self, used: Used) -> Settled {
        let (settled, adjusting) = self.settling(used);
        let Some(adjusting) = adjusting else { return settled };
        let mark = self.mark(&adjusting);
        if !self.try_once(&adjusting, &mark).await {
            tokio::spawn(async move { self.keep_trying(&adjusting, &mark).await });
        }
        settled
    }

    /// What work that came to `used` settles to, and the adjustment of each budget that takes
    /// it there (the module doc's rules); none when the price is the reservation, or no budget
    /// can take the difference (the reservation then stands, and is what was charged).
    fn settling(&self, used: Used) -> (Settled, Option<Adjusting>) {
        let charged = self.charge_for(used);
        let settled = Settled { reserved: self.units, charged };
        let (how, units) = match charged.cmp(&self.units) {
            _ if self.budgets.is_empty() => return (settled, None),
            std::cmp::Ordering::Equal => return (settled, None),
            std::cmp::Ordering::Less => ("refunded", self.units - charged),
            std::cmp::Ordering::Greater => ("charged", charged - self.units),
        };
        let since = (self.in_force)();
        let of = |plan: &[(String, Limiter)], key: &str| plan.iter().find(|(k, _)| k == key).map(|(_, l)| l.clone());
        let budgets: Vec<(String, Limiter, Adjustment)> = self
            .budgets
            .iter()
            .filter_map(|(key, limiter, taken)| {
                if how == "charged" {
                    // On top, now, by the limiter in force (if the call still draws on the budget;
                    // by the one it was charged under when the reloads since are not all kept).
                    let now = since.as_ref().and_then(|since| since.last());
                    let current = now.map_or(Some(limiter.clone()), |plan| of(plan, key))?;
                    return Some((key.clone(), current, Adjustment::Charge(units)));
                }
                // Given back only where the limit stayed the one the call was charged under.
                let kept = since.as_ref()?.iter().all(|plan| of(plan, key).as_ref() == Some(limiter));
                kept.then(|| (key.clone(), limiter.clone(), Adjustment::Return { units, taken: *taken }))
            })
            .collect();
        if budgets.is_empty() {
            // No budget can take the difference: the reservation stands, and is what was charged.
            return (Settled { charged: self.units, ..settled }, None);
        }
        (settled, Some(Adjusting { budgets, how: (how, units) }))
    }

    /// The key of this settlement's mark, under the budgets' hash tag (the first key's, which
    /// every key of one call shares), so a try sent again after a lost answer lands once.
    fn mark(&self, adjusting: &Adjusting) -> String {
        let first = adjusting.budgets.first().map_or("", |(key, _, _)| key.as_str());
        format!("{first}:settled:{:016x}", rand::random::<u64>())
    }

    /// One try; whether the store took it.
    async fn try_once(&self, adjusting: &Adjusting, mark: &str) -> bool {
        let budgets: Vec<(&str, &Limiter, Adjustment)> =
            adjusting.budgets.iter().map(|(key, limiter, by)| (key.as_str(), limiter, *by)).collect();
        match self.store.adjust(&budgets, Some(mark)).await {
            Ok(_) => {
                let (how, units) = adjusting.how;
                // A charge takes at most what a budget holds, whatever a report claims.
                let most = budgets.iter().map(|(_, limiter, _)| limiter.capacity()).max().unwrap_or(0);
                self.metrics.settled(&self.tool, how, units.min(most));
                if let (true, Some(refusals)) = (how == "refunded", &self.refusals) {
                    // Only time gave budget back until now: a refusal remembered for these keys
                    // may be too long. (Other instances keep theirs until it runs out: they can
                    // only refuse a little longer, never admit more.)
                    refusals.forget(budgets.iter().map(|(key, _, _)| *key));
                }
                true
            }
            Err(error) => {
                self.metrics.settlement_error(&self.tool);
                tracing::debug!(target: "mcp_ratelimit::guard::after::settle", tool = %self.tool, reserved = self.units, %error, "could not settle a price yet: trying again");
                false
            }
        }
    }

    /// Tries again, after a growing pause with jitter (a store back after an outage is not
    /// met by every settlement at once), until the store takes it or [`TRIES_FOR`] has passed;
    /// whether it landed.
    async fn keep_trying(&self, adjusting: &Adjusting, mark: &str) -> bool {
        let until = self.clock.now() + Nanos::from(TRIES_FOR);
        let mut pause = FIRST_PAUSE;
        loop {
            let next = self.clock.now() + Nanos::from(pause.mul_f64(rand::random_range(0.5..1.0)));
            if next >= until {
                break;
            }
            self.clock.sleep_until(next).await;
            if self.try_once(adjusting, mark).await {
                return true;
            }
            pause = (pause * 2).min(LONGEST_PAUSE);
        }
        self.metrics.settlement_given_up(&self.tool);
        tracing::warn!(target: "mcp_ratelimit::guard::after::settle", tool = %self.tool, reserved = self.units, "could not settle a price: the reservation stands");
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handed_reservation_keeps_its_times_as_bare_nanoseconds_on_the_wire() {
        let written = r#"{"key":"k","algorithm":"gcra","capacity":5,"period":200000000,"at":1767225600000000000,"reset_after":400000000}"#;
        let budget: HandedBudget = serde_json::from_str(written).expect("a budget as written before Nanos was a type");
        assert_eq!((budget.period, budget.at), (Some(Nanos::from_millis(200)), Nanos::from_secs(1_767_225_600)));
        assert_eq!(serde_json::to_string(&budget).expect("serializes"), written);
    }
}
