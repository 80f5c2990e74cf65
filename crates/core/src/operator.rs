//! What an operator may do to budgets, through the admin API: read them, reset them, refund
//! units, block a caller or a tenant for a while.
//!
//! A [`Target`] is one caller's own budgets (its HTTP and method budgets, its tool budget, its
//! tools' own budgets when it has no tenant) or one tenant's (the shared budget and the tools'
//! own budgets). Every operation acts on the guard's store, so on Redis it acts for every
//! instance at once: a reset deletes the keys, a refund runs the algorithm's `refund` twin
//! (`adjust.lua`), a block is a key with a TTL that the decision script reads with the budgets.
//!
//! One thing is local to each instance: the memory of the shared store's refusals
//! (`refusals.rs`), which refuses a caller until the time Redis named, without asking, on the
//! rule that only time gives budget back. An operator breaks that rule, so a reset or refund
//! also bumps a counter in Redis that every instance watches ([`Guard::hear_operators`], a few
//! times a second) and forgets its remembered refusals when it moves.
//!
//! In-flight caps are shown but never reset or refunded here: their slots belong to running
//! jobs, which give them back when they end; cancel a job to free its slot.

use crate::clock::ceil_ms;
use crate::config::Limit;
use crate::guard::MethodGroup;
use crate::guard::admit::plan::{Planned, plan, status_scopes};
use crate::guard::admit::report::budget_status;
use crate::guard::{BudgetStatus, Guard, Scope};
use crate::identity::Caller;
use crate::limit::Adjustment;
use crate::store::{Check, Lease, StoreError};

/// The counter every instance watches to hear that an operator gave budget back.
const FORGIVEN_KEY: &str = "{admin}forgiven";

/// How often an instance that remembers refusals looks at that counter (wall clock: the news
/// comes from another process), which bounds how late it hears of a reset or refund.
pub const HEAR_OPERATORS_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// Whose budgets an operator acts on.
#[derive(Debug, Clone)]
pub enum Target {
    /// One caller's own budgets.
    Caller(Caller),
    /// A tenant's budgets, named through any caller of it (every scope of a tenant is keyed by
    /// the tenant alone).
    Tenant(Caller),
}

/// Why an operation was not done.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    /// The request names something this target does not have; `field` is the request's field.
    #[error("`{field}`: {message}")]
    Invalid {
        /// The request field at fault.
        field: &'static str,
        /// What is wrong and what would be right.
        message: String,
    },
    /// The store could not be reached.
    #[error("the limiter store cannot act right now: {0}")]
    Store(#[from] StoreError),
}

/// A block in force.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BlockStatus {
    /// The block's scope: `block:caller:tok:…` or `block:tenant:acme`.
    pub scope: String,
    /// Milliseconds it still holds.
    pub left_ms: u64,
}

impl Target {
    /// `caller tok:…` or `tenant acme`, for logs (never a raw credential).
    pub fn label(&self) -> String {
        match self {
            Target::Caller(caller) => format!("caller {}", caller.id()),
            Target::Tenant(caller) => format!("tenant {}", caller.tenant().unwrap_or_default()),
        }
    }

    /// The budgets that belong to this target alone, one entry per limit.
    fn own_scopes<'p>(&self, policy: &'p crate::guard::Policy) -> Vec<(Scope, &'p Limit)> {
        let mut scopes = Vec::new();
        match self {
            Target::Caller(caller) => {
                let tier = policy.for_caller(caller);
                if caller.id() != "local" {
                    plan(&mut scopes, Scope::http(caller), &tier.http, 0);
                }
                for group in [MethodGroup::ToolsList, MethodGroup::ToolsCall, MethodGroup::Other] {
                    plan(&mut scopes, Scope::method(caller, group), tier.method(group), 0);
                }
                plan(&mut scopes, Scope::caller(caller), policy.caller_budget(caller), 0);
                // With a tenant, the tools' own budgets and the spend cap are the tenant's; for
                // an unverified caller they are its address's, shared with every other.
                if caller.tenant().is_none() && caller.unverified_from().is_none() {
                    tool_budgets(policy, caller, &mut scopes);
                    if let Some(cap) = policy.spend_cap(None) {
                        scopes.push(Planned { scope: Scope::spend(caller), limit: cap, cost: 0, priced: true });
                    }
                }
                scopes.push(Planned {
                    scope: Scope::in_flight_caller(caller),
                    limit: &policy.in_flight_caller,
                    cost: 0,
                    priced: false,
                });
            }
            Target::Tenant(member) => {
                if let (Some(scope), Some(tenant)) = (Scope::tenant(member), member.tenant()) {
                    plan(&mut scopes, scope, policy.tenant_budget(tenant), 0);
                }
                tool_budgets(policy, member, &mut scopes);
                if let Some(cap) = policy.spend_cap(member.tenant()) {
                    scopes.push(Planned { scope: Scope::spend(member), limit: cap, cost: 0, priced: true });
                }
                let in_flight = Scope::in_flight_tenant(member);
                scopes.extend(in_flight.map(|scope| Planned {
                    scope,
                    limit: &policy.in_flight_tenant,
                    cost: 0,
                    priced: false,
                }));
            }
        }
        scopes.into_iter().map(|p| (p.scope, p.limit)).collect()
    }

    /// The block on this target.
    fn block_scope(&self) -> Option<Scope> {
        match self {
            Target::Caller(caller) => Some(Scope::block_caller(caller)),
            Target::Tenant(member) => Scope::block_tenant(member),
        }
    }

    /// The blocks that stop this target's calls: a caller's own and its tenant's.
    fn blocks_on(&self) -> Vec<Scope> {
        match self {
            Target::Caller(caller) => {
                std::iter::once(Scope::block_caller(caller)).chain(Scope::block_tenant(caller)).collect()
            }
            Target::Tenant(_) => self.block_scope().into_iter().collect(),
        }
    }

    /// The scope named `name` among this target's own rate budgets (in-flight caps excluded), or
    /// all of them when `name` is `None`.
    fn rate_scopes<'p>(
        &self,
        policy: &'p crate::guard::Policy,
        name: Option<&str>,
    ) -> Result<Vec<(Scope, &'p Limit)>, OperatorError> {
        let own = self.own_scopes(policy);
        let Some(name) = name else {
            return Ok(own.into_iter().filter(|(_, limit)| !limit.limiter.holds_slots()).collect());
        };
        let Some((scope, limit)) = own.iter().find(|(scope, _)| scope.name() == name) else {
            let names: Vec<&str> = own.iter().map(|(scope, _)| scope.name()).collect();
            return Err(OperatorError::Invalid {
                field: "scope",
                message: format!("`{name}` is not a budget of {}; its budgets are {}", self.label(), names.join(", ")),
            });
        };
        if limit.limiter.holds_slots() {
            return Err(OperatorError::Invalid {
                field: "scope",
                message: format!(
                    "`{name}` counts jobs in flight, whose slots come back when the jobs end: cancel a job (POST \
                     /admin/jobs/{{predict_id}}/cancel) to free its slot"
                ),
            });
        }
        Ok(vec![(scope.clone(), *limit)])
    }
}

/// The tools' own budgets as `caller` draws on them (its tenant's, or its own without one).
fn tool_budgets<'p>(policy: &'p crate::guard::Policy, caller: &Caller, out: &mut Vec<Planned<'p>>) {
    for (tool, tool_policy) in &policy.tools {
        plan(out, Scope::tool(caller, tool), &tool_policy.budget, 0);
    }
}

impl Guard {
    /// The budgets of `target` right now, without spending anything: for a caller every scope it
    /// draws on, as `rate_limit_status` shows them; for a tenant its own. Read from the store
    /// itself (never the insurance limiter): an operator must see the shared truth or an error.
    pub async fn budgets(&self, target: &Target) -> Result<Vec<BudgetStatus>, OperatorError> {
        let policy = self.policy();
        let scopes: Vec<(Scope, &Limit)> = match target {
            Target::Caller(caller) => {
                status_scopes(&policy, caller, caller.id() != "local").into_iter().map(|p| (p.scope, p.limit)).collect()
            }
            Target::Tenant(_) => target.own_scopes(&policy),
        };
        let checks: Vec<Check<'_>> = scopes
            .iter()
            .map(|(scope, limit)| Check { key: scope.key(), limiter: &limit.limiter, cost: 0, shadow: false })
            .collect();
        let decisions = self.store().decide_all(&checks, Lease::new()).await?;
        Ok(scopes.iter().zip(&decisions).map(|((scope, limit), d)| budget_status(&policy, scope, limit, d)).collect())
    }

    /// The blocks in force on `target`.
    pub async fn blocks(&self, target: &Target) -> Result<Vec<BlockStatus>, OperatorError> {
        let mut blocks = Vec::new();
        for scope in target.blocks_on() {
            if let Some(left) = self.store().block_left(scope.key()).await? {
                blocks.push(BlockStatus { scope: scope.name().to_owned(), left_ms: ceil_ms(left) });
            }
        }
        Ok(blocks)
    }

    /// Forgets `target`'s rate budgets — the one named `scope`, or all of them: its next call
    /// finds them full. Returns the scopes reset.
    pub async fn reset(&self, target: &Target, scope: Option<&str>) -> Result<Vec<String>, OperatorError> {
        let policy = self.policy();
        let scopes = target.rate_scopes(&policy, scope)?;
        let keys: Vec<&str> = scopes.iter().map(|(scope, _)| scope.key()).collect();
        self.store().forget(&keys).await?;
        self.forgive().await;
        let names: Vec<String> = scopes.iter().map(|(scope, _)| scope.name().to_owned()).collect();
        tracing::info!(target: "mcp_ratelimit::operator", action = "reset", target = %target.label(), scopes = %names.join(","), "admin action");
        Ok(names)
    }

    /// Gives `units` back to `target`'s budget `scope` (by default its caller or tenant budget),
    /// never beyond the budget's capacity; returns the budget after it.
    pub async fn refund(
        &self,
        target: &Target,
        scope: Option<&str>,
        units: u64,
    ) -> Result<BudgetStatus, OperatorError> {
        let default = match target {
            Target::Caller(caller) => Scope::caller(caller),
            Target::Tenant(member) => Scope::tenant(member).unwrap_or_else(|| Scope::caller(member)),
        };
        let policy = self.policy();
        let scopes = target.rate_scopes(&policy, Some(scope.unwrap_or(default.name())))?;
        let Some((scope, limit)) = scopes.first() else {
            return Err(OperatorError::Invalid { field: "scope", message: "no such budget".into() });
        };
        let adjusted = self.store().adjust(&[(scope.key(), &limit.limiter, Adjustment::Refund(units))], None).await?;
        let decision = adjusted.first().copied().ok_or_else(|| OperatorError::Invalid {
            field: "units",
            message: "the limiter store answered without the budget's level; try again".into(),
        })?;
        self.forgive().await;
        tracing::info!(target: "mcp_ratelimit::operator", action = "refund", target = %target.label(), scope = scope.name(), units, "admin action");
        Ok(budget_status(&policy, scope, limit, &decision))
    }

    /// Blocks `target`'s tool calls for `duration`: each is refused `rate_limited` with the time
    /// left. On Redis every instance sees it at its next decision.
    pub async fn block(&self, target: &Target, duration: std::time::Duration) -> Result<BlockStatus, OperatorError> {
        let scope = target.block_scope().ok_or_else(|| OperatorError::Invalid {
            field: "tenant",
            message: format!("{} has no tenant to block", target.label()),
        })?;
        self.store().block(scope.key(), duration).await?;
        let left_ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        tracing::info!(target: "mcp_ratelimit::operator", action = "block", target = %target.label(), duration_ms = left_ms, "admin action");
        Ok(BlockStatus { scope: scope.name().to_owned(), left_ms })
    }

    /// Lifts the block on `target`; whether one was in force.
    pub async fn unblock(&self, target: &Target) -> Result<bool, OperatorError> {
        let Some(scope) = target.block_scope() else { return Ok(false) };
        let lifted = self.store().unblock(scope.key()).await?;
        tracing::info!(target: "mcp_ratelimit::operator", action = "unblock", target = %target.label(), lifted, "admin action");
        Ok(lifted)
    }

    /// Tells every instance that budget was given back: this one forgets its remembered refusals
    /// now, the others when they next look ([`Guard::hear_operators`]).
    async fn forgive(&self) {
        let Some(refused) = self.remembered_refusals() else { return };
        refused.clear();
        if self.store().is_shared()
            && let Err(error) = self.store().bump(FORGIVEN_KEY).await
        {
            tracing::warn!(target: "mcp_ratelimit::operator", %error, "could not tell the other instances about an operator's refund or reset");
        }
    }

    /// Forgets the remembered refusals if an operator gave budget back since `seen` (the counter
    /// `Guard::forgive` bumps); returns the counter now. Asks the store only while refusals
    /// are remembered: otherwise there is nothing to forget.
    pub async fn hear_operators(&self, seen: u64) -> Result<u64, StoreError> {
        let Some(refused) = self.remembered_refusals().filter(|_| self.store().is_shared()) else { return Ok(seen) };
        if refused.is_empty() {
            return Ok(seen);
        }
        let now = self.store().counter(FORGIVEN_KEY).await?;
        if now != seen {
            refused.clear();
        }
        Ok(now)
    }
}
