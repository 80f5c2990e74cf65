//! A call's decision: its checks, operator blocks, loop check and learnt limit sent to
//! `decide.lua` in one round trip, and a call whose budgets span hash slots decided as one.

use std::collections::HashMap;

use ::redis::cluster_routing::Slot;

use mcp_ratelimit_kernel::clock::Nanos;
use mcp_ratelimit_kernel::limit::{Adjustment, Decision, Limiter};
use mcp_ratelimit_kernel::store::{Check, LearntAt, Lease, LoopCall, Pattern, SharedLimit, StoreError, Verdict};

use crate::RedisStore;
use crate::batch::Invocation;
use crate::connection::Connection;
use crate::errors::{STORE, bounded};
use crate::learner::{self, learnt_ttl_ms};
use crate::leases::Unanswered;
use crate::scripts::{REPLY_FIELDS, hex, micros, script_span};

impl RedisStore {
    /// Decides every check atomically in ONE script call (one round trip), time from Redis TIME.
    ///
    /// One decision per check, in order; the states are charged only when every decision is
    /// `allowed`.
    pub async fn decide(&self, checks: &[Check<'_>]) -> Result<Vec<Decision>, StoreError> {
        self.run(checks, None, Lease::new()).await
    }

    /// [`RedisStore::decide`], with any in-flight slots taken under `lease` (to renew and release
    /// them by), at an explicit clock reading when `now` is given (see [`RedisStore::decide_at`]).
    pub async fn decide_leased(
        &self,
        checks: &[Check<'_>],
        lease: Lease,
        now: Option<Nanos>,
    ) -> Result<Vec<Decision>, StoreError> {
        let now_us = now.map(micros).transpose()?;
        self.run(checks, now_us, lease).await
    }

    /// The same with an explicit clock reading (epoch nanoseconds, a multiple of 1000): for
    /// tests that walk time, and parity with the Rust algorithms.
    ///
    /// TTLs are set as if Redis's clock stood at `now`: a key written at a `now` ahead of Redis
    /// still expires one TTL after the write.
    pub async fn decide_at(&self, checks: &[Check<'_>], now: Nanos) -> Result<Vec<Decision>, StoreError> {
        self.run(checks, Some(micros(now)?), Lease::new()).await
    }

    /// [`LoopHistory::decide_after_loop_check`](mcp_ratelimit_kernel::store::LoopHistory::decide_after_loop_check)
    /// at an explicit clock reading (see [`RedisStore::decide_at`]).
    pub async fn decide_after_loop_check_at(
        &self,
        call: LoopCall<'_>,
        checks: &[Check<'_>],
        blocks: &[&str],
        now: Nanos,
    ) -> Result<Verdict, StoreError> {
        self.run_unless_blocked(checks, blocks, Some(call), Some(micros(now)?), Lease::new()).await
    }

    async fn run(&self, checks: &[Check<'_>], now_us: Option<u64>, lease: Lease) -> Result<Vec<Decision>, StoreError> {
        match self.run_unless_blocked(checks, &[], None, now_us, lease).await? {
            Verdict::Decided(decisions) => Ok(decisions),
            Verdict::Blocked { .. } => Err(self.malformed("a block answered a decision that named none".into())),
            Verdict::Looping { .. } => Err(self.malformed("a loop answered a decision that checked none".into())),
        }
    }

    /// [`RedisStore::decide_leased`], unless one of `blocks` (keys an operator set with
    /// [`RedisStore::block`]) still exists, after checking `looped` against its loop history:
    /// all read in the same script, so neither a block nor a loop check costs a round trip
    /// ([`Budgets::decide`](mcp_ratelimit_kernel::store::Budgets::decide),
    /// [`LoopHistory`](mcp_ratelimit_kernel::store::LoopHistory)). The block keys and the history must share
    /// the checks' hash tag.
    pub(super) async fn run_unless_blocked(
        &self,
        checks: &[Check<'_>],
        blocks: &[&str],
        looped: Option<LoopCall<'_>>,
        now_us: Option<u64>,
        lease: Lease,
    ) -> Result<Verdict, StoreError> {
        Ok(self.run_script(checks, blocks, looped, None, now_us, lease).await?.0)
    }

    /// [`RedisStore::run_unless_blocked`], with the in-flight checks decided under the learnt
    /// limit `under` names when there is one (read in the same script, its key last), and what
    /// that limit stood at.
    ///
    /// Cancel-safe: the in-flight slots the script may take under `lease` are owned by a guard
    /// from the moment it is sent ([`Unanswered`]). Dropped before its answer (its caller was
    /// cancelled) or failed (timed out: Redis may run it all the same), the decision gives them
    /// back; only an answer in hand hands them to the caller, who holds them by [`SlotGuard`]s
    /// made in the same step.
    ///
    /// [`SlotGuard`]: mcp_ratelimit_kernel::store::SlotGuard
    pub(super) async fn run_script(
        &self,
        checks: &[Check<'_>],
        blocks: &[&str],
        looped: Option<LoopCall<'_>>,
        under: Option<LearntAt<'_>>,
        now_us: Option<u64>,
        lease: Lease,
    ) -> Result<(Verdict, Option<SharedLimit>), StoreError> {
        if let Some(away) = self.away_from_home(checks, blocks, looped.as_ref(), under.as_ref()) {
            return self.run_apart(checks, &away, blocks, looped, under, now_us, lease).await;
        }
        let unanswered = Unanswered::of(self, checks, lease);
        let answer = self.ask_script(checks, blocks, looped, under, now_us, lease).await;
        if answer.is_ok() {
            unanswered.answered();
        }
        answer
    }

    /// On a cluster, the checks of a call that live on another hash slot than the call's own
    /// (whose keys are its blocks, loop history and learnt limit, else its first check's): the
    /// budgets shared across tenants, such as an OAuth client's (`{o:app}client:app`). `None`
    /// when every check shares the home slot (always, on one Redis).
    fn away_from_home(
        &self,
        checks: &[Check<'_>],
        blocks: &[&str],
        looped: Option<&LoopCall<'_>>,
        under: Option<&LearntAt<'_>>,
    ) -> Option<Vec<bool>> {
        let Connection::Cluster(..) = self.connection else { return None };
        let home = looped
            .map(|call| call.key)
            .or_else(|| blocks.first().copied())
            .or_else(|| under.map(|at| at.key))
            .or_else(|| checks.first().map(|check| check.key))?;
        let home = Slot::for_key(home);
        let away: Vec<bool> = checks.iter().map(|check| Slot::for_key(check.key) != home).collect();
        away.contains(&true).then_some(away)
    }

    /// A call whose checks span hash slots, decided as one: the budgets away from home first,
    /// one script per slot (rate budgets only: they are charged, or nothing is), then the home
    /// slot's with the blocks, loop history and in-flight slots. Whatever refuses, nothing stays
    /// charged: an away budget that admitted is given back its charge where it landed
    /// ([`Adjustment::Return`]) when another refuses. Between the two steps a concurrent call
    /// may see the away budgets charged by a call that is then refused: it is refused no more
    /// than if that call had been admitted, and the units come back at once.
    #[allow(clippy::too_many_arguments)]
    async fn run_apart(
        &self,
        checks: &[Check<'_>],
        away: &[bool],
        blocks: &[&str],
        looped: Option<LoopCall<'_>>,
        under: Option<LearntAt<'_>>,
        now_us: Option<u64>,
        lease: Lease,
    ) -> Result<(Verdict, Option<SharedLimit>), StoreError> {
        if checks.iter().zip(away).any(|(check, &away)| away && check.limiter.holds_slots()) {
            // In-flight slots are held under a lease on the home slot; none is shared that way.
            return Err(StoreError::KeysApart { store: STORE, address: self.address.clone() });
        }
        let mut by_slot: HashMap<Slot, Vec<usize>> = HashMap::new();
        for (i, check) in checks.iter().enumerate().filter(|(i, _)| away[*i]) {
            by_slot.entry(Slot::for_key(check.key)).or_default().push(i);
        }
        let groups: Vec<Vec<usize>> = by_slot.into_values().collect();
        let asked = groups.iter().map(|group| {
            let group: Vec<Check<'_>> = group.iter().map(|&i| checks[i]).collect();
            async move { self.ask_script(&group, &[], None, None, now_us, lease).await }
        });
        let answers = futures::future::join_all(asked).await;
        let mut decisions: Vec<Option<Decision>> = vec![None; checks.len()];
        let mut charged: Vec<usize> = Vec::new();
        let mut failed = None;
        for (group, answer) in groups.iter().zip(answers) {
            match answer {
                Ok((Verdict::Decided(decided), _)) if decided.len() == group.len() => {
                    let admitted = group.iter().zip(&decided).all(|(&i, d)| d.allowed || checks[i].shadow);
                    for (&i, decision) in group.iter().zip(decided) {
                        decisions[i] = Some(decision);
                    }
                    if admitted {
                        charged.extend(group.iter().copied().filter(|&i| !checks[i].shadow));
                    }
                }
                Ok(_) => failed = Some(self.malformed("an away budget's script answered no decisions".into())),
                Err(error) => failed = Some(error),
            }
        }
        let refused_away = failed.is_some()
            || groups.iter().flatten().any(|&i| decisions[i].as_ref().is_some_and(|d| !d.allowed && !checks[i].shadow));
        if refused_away {
            self.give_back(checks, &charged, &decisions, now_us).await;
            if let Some(error) = failed {
                return Err(error);
            }
            // The home budgets as they stand, charged nothing, for the refusal to report beside.
            let home: Vec<usize> = (0..checks.len()).filter(|&i| !away[i]).collect();
            let read: Vec<Check<'_>> = home.iter().map(|&i| Check { cost: 0, ..checks[i] }).collect();
            if let (Verdict::Decided(read), _) = self.ask_script(&read, &[], None, None, now_us, lease).await? {
                for (&i, decision) in home.iter().zip(read) {
                    decisions[i] = Some(decision);
                }
            }
            return self.merged(decisions).map(|decided| (Verdict::Decided(decided), None));
        }
        let home: Vec<usize> = (0..checks.len()).filter(|&i| !away[i]).collect();
        let home_checks: Vec<Check<'_>> = home.iter().map(|&i| checks[i]).collect();
        let unanswered = Unanswered::of(self, &home_checks, lease);
        let answer = self.ask_script(&home_checks, blocks, looped, under, now_us, lease).await;
        if answer.is_ok() {
            unanswered.answered();
        }
        let (verdict, limit) = match answer {
            Ok(answered) => answered,
            Err(error) => {
                self.give_back(checks, &charged, &decisions, now_us).await;
                return Err(error);
            }
        };
        match verdict {
            Verdict::Decided(decided) => {
                let admitted = home.iter().zip(&decided).all(|(&i, d)| d.allowed || checks[i].shadow);
                if !admitted {
                    self.give_back(checks, &charged, &decisions, now_us).await;
                }
                for (&i, decision) in home.iter().zip(decided) {
                    decisions[i] = Some(decision);
                }
                Ok((Verdict::Decided(self.merged(decisions)?), limit))
            }
            blocked_or_looping => {
                self.give_back(checks, &charged, &decisions, now_us).await;
                Ok((blocked_or_looping, limit))
            }
        }
    }

    /// Gives the checks at `charged` back what their admitting decisions took (best effort: a
    /// charge that cannot be given back is logged, and comes back by time alone).
    async fn give_back(
        &self,
        checks: &[Check<'_>],
        charged: &[usize],
        decisions: &[Option<Decision>],
        now_us: Option<u64>,
    ) {
        let budgets: Vec<(&str, &Limiter, Adjustment)> = charged
            .iter()
            .filter_map(|&i| {
                let decision = decisions.get(i)?.as_ref()?;
                let check = checks.get(i)?;
                Some((check.key, check.limiter, Adjustment::Return { units: check.cost, taken: decision.taken() }))
            })
            .collect();
        // At the decision's clock reading when it was given one (a test's), else Redis's.
        if let Err(error) = self.adjust(&budgets, None, now_us.map(Nanos::from_micros)).await {
            tracing::warn!(%error, "could not give back a refused call's charge on another hash slot");
        }
    }

    /// One decision per check, in order, or a malformed reply if one is missing.
    pub(super) fn merged(&self, decisions: Vec<Option<Decision>>) -> Result<Vec<Decision>, StoreError> {
        decisions
            .into_iter()
            .map(|decision| decision.ok_or_else(|| self.malformed("a check went undecided".into())))
            .collect()
    }

    /// [`RedisStore::run_script`]'s round trip.
    async fn ask_script(
        &self,
        checks: &[Check<'_>],
        blocks: &[&str],
        looped: Option<LoopCall<'_>>,
        under: Option<LearntAt<'_>>,
        now_us: Option<u64>,
        lease: Lease,
    ) -> Result<(Verdict, Option<SharedLimit>), StoreError> {
        if checks.is_empty() && blocks.is_empty() && looped.is_none() && under.is_none() {
            return Ok((Verdict::Decided(Vec::new()), None));
        }
        let mut invocation = Invocation::of(&self.decide);
        invocation.arg(now_us.map_or_else(String::new, |us| us.to_string()));
        invocation.arg(lease.id()).arg(u64::try_from(self.lease.as_micros()).unwrap_or(u64::MAX));
        match &looped {
            Some(call) => {
                let (signature, tool) = (hex(call.signature), hex(call.tool_signature));
                let said = |h: &[u8; 32]| String::from_utf8_lossy(h).into_owned();
                invocation.arg(call.window.as_u64().div_ceil(1_000)).arg(call.repeats).arg(format!(
                    "{} {}",
                    said(&signature),
                    said(&tool)
                ))
            }
            None => invocation.arg("").arg("").arg(""),
        };
        match &under {
            Some(at) => {
                invocation.arg(format!("{} {} {}", at.ceiling.max(1), learnt_ttl_ms(), learner::spec(at.learner)))
            }
            None => invocation.arg(""),
        };
        for check in checks {
            invocation.key(check.key).arg(check.limiter.algorithm()).arg(check.limiter.capacity());
            invocation.arg(script_span(check)?).arg(check.cost).arg(u8::from(check.shadow));
        }
        for block in blocks {
            invocation.key(*block);
        }
        if let Some(call) = &looped {
            invocation.key(call.key);
        }
        if let Some(at) = &under {
            invocation.key(at.key);
        }
        let mut reply: Vec<i64> = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        if let [-2, retry_after_us, pattern] = reply[..] {
            let retry_after = Nanos::from_micros(u64::try_from(retry_after_us).unwrap_or(0));
            return Ok((Verdict::Looping { retry_after, pattern: Pattern::from_code(pattern) }, None));
        }
        if let [-1, place, left_ms] = reply[..] {
            let index = usize::try_from(place - 1).ok().filter(|i| *i < blocks.len());
            let index = index.ok_or_else(|| self.malformed(format!("block reply {reply:?}")))?;
            let left = Nanos::from_millis(u64::try_from(left_ms).unwrap_or(0));
            return Ok((Verdict::Blocked { index, left }, None));
        }
        // Last, the script's clock: when every charge of the call landed.
        let at = self.clock_of(reply.pop())?;
        let limit = match under {
            Some(_) => {
                let Some(current) = reply.pop() else {
                    return Err(self.malformed("a decision under a learnt limit answered without it".into()));
                };
                let current =
                    u64::try_from(current).map_err(|_| self.malformed(format!("negative value {current}")))?;
                Some(SharedLimit { current, at })
            }
            None => None,
        };
        Ok((Verdict::Decided(self.decisions(&reply, checks.len(), at)?), limit))
    }

    /// The clock reading a script ends its reply with (epoch microseconds), in nanoseconds.
    pub(super) fn clock_of(&self, now_us: Option<i64>) -> Result<Nanos, StoreError> {
        let now_us = now_us.ok_or_else(|| self.malformed("a reply without the script's clock".into()))?;
        let now_us = u64::try_from(now_us).map_err(|_| self.malformed(format!("clock reading {now_us}")))?;
        Ok(Nanos::from_micros(now_us))
    }

    /// Reads the script's reply: [`REPLY_FIELDS`] integers per check, decided `at`.
    pub(super) fn decisions(&self, reply: &[i64], checks: usize, at: Nanos) -> Result<Vec<Decision>, StoreError> {
        let malformed = |what: String| StoreError::Failed { store: STORE, address: self.address.clone(), reason: what };
        if reply.len() != checks * REPLY_FIELDS {
            return Err(malformed(format!("{} values in the reply for {checks} checks", reply.len())));
        }
        let unsigned = |v: i64| u64::try_from(v).map_err(|_| malformed(format!("negative value {v} in the reply")));
        reply
            .chunks_exact(REPLY_FIELDS)
            .map(|d| {
                Ok(Decision {
                    allowed: d[0] == 1,
                    limit: unsigned(d[1])?,
                    remaining: unsigned(d[2])?,
                    retry_after: Nanos::new(unsigned(d[3])?),
                    reset_after: Nanos::new(unsigned(d[4])?),
                    at,
                })
            })
            .collect()
    }
}
