//! The Redis store as the [`SharedLine`]: the one line every instance's waiting jobs stand in, in
//! four keys under the line's hash tag, each operation one script (`line.lua`, with every
//! algorithm's twin to judge and take a job's slots and gap in the same step as its turn).

use super::{GiveBack, RedisStore, StoreError, Unanswered, bounded, learner};
use crate::batch::Invocation;
use mcp_ratelimit_kernel::clock::Nanos;
use mcp_ratelimit_kernel::store::{
    JoinAt, LINE_ALIVE, LearntAt, LineAnswer, LineAt, LineClaim, LineEntry, LineWait, SharedLimit, SharedLine,
    StoreFuture,
};

/// The line script: the prelude, every algorithm, the learnt limits, then the entry point.
pub(super) const LINE_SCRIPT: &str = mcp_ratelimit_kernel::limit::registry!(
    with_every_algorithm,
    "adaptive.lua",
    "adaptive/aimd.lua",
    "adaptive/gradient2.lua",
    "line.lua"
);

/// The line's own keys, under its hash tag: the line, the flows, the virtual time, the
/// instances alive, each member's flow.
fn keys(name: &str) -> [String; 5] {
    ["line", "line:flows", "line:vtime", "line:alive", "line:flow"].map(|k| format!("{{{name}}}{k}"))
}

impl RedisStore {
    /// A call of `line.lua` for `op`, its keys and first arguments set.
    fn line_call(&self, at: LineAt<'_>, op: &str) -> Invocation<'_> {
        let mut invocation = Invocation::of(&self.line);
        for key in keys(at.name) {
            invocation.key(key);
        }
        invocation.arg(op).arg(at.instance).arg(u64::try_from(LINE_ALIVE.as_micros()).unwrap_or(u64::MAX));
        invocation
    }

    fn number<T: std::str::FromStr>(&self, what: &str, value: Option<&String>) -> Result<T, StoreError> {
        value.and_then(|v| v.parse().ok()).ok_or_else(|| self.malformed(format!("line.lua answered {what} {value:?}")))
    }

    async fn line_claim(&self, at: LineAt<'_>, claim: LineClaim<'_>) -> Result<(LineAnswer, Vec<String>), StoreError> {
        let mut invocation = self.line_call(at, "claim");
        invocation.key(claim.account.0).key(claim.share.0);
        // The learnt limit's key is read only with a learner; another of the line's keys holds
        // its place otherwise (a cluster wants every key a script names in one slot).
        invocation.key(claim.learnt.map_or_else(|| format!("{{{}}}line", at.name), |l| l.key.to_owned()));
        for (key, _) in claim.gaps.iter().flatten() {
            invocation.key(*key);
        }
        for (key, _) in claim.tiers {
            invocation.key(*key);
        }
        invocation.arg(claim.lease.id()).arg(u64::try_from(self.lease.as_micros()).unwrap_or(u64::MAX));
        invocation.arg(claim.account.1).arg(claim.share.1.max(1));
        invocation.arg(match claim.learnt {
            Some(LearntAt { ceiling, learner, .. }) => {
                format!("{} {} {}", ceiling.max(1), learner::learnt_ttl_ms(), learner::spec(learner))
            }
            None => String::new(),
        });
        invocation.arg(claim.scan.max(1));
        // Classes without a gap name no key: the script counts gaps by the specs given.
        invocation.arg(claim.gaps.len());
        let mut gap_index = 0usize;
        for gap in claim.gaps {
            match gap {
                Some((_, limiter)) => {
                    gap_index += 1;
                    let span = super::script_span(&mcp_ratelimit_kernel::store::Check {
                        key: "",
                        limiter,
                        cost: 1,
                        shadow: false,
                    })?;
                    invocation.arg(format!("{gap_index} {} {span}", limiter.capacity()));
                }
                None => {
                    invocation.arg("");
                }
            }
        }
        invocation.arg(claim.tiers.len());
        for (_, share) in claim.tiers {
            invocation.arg(format!("{share}"));
        }
        match claim.candidate {
            Some(entry) => invocation.arg(entry.member(at.instance)).arg(&entry.flow).arg(format!("{}", entry.weight)),
            None => invocation.arg("").arg("").arg("1"),
        };
        invocation.arg(claim.told);
        // Slots the script may take and nobody would hold: given back if no answer comes.
        let mut taken = vec![claim.account.0.to_owned(), claim.share.0.to_owned()];
        taken.extend(claim.tiers.iter().map(|(key, _)| (*key).to_owned()));
        let unanswered = Unanswered { release: Some((GiveBack::of(self), taken)), lease: claim.lease };
        let reply: Vec<String> = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        unanswered.answered();
        self.claim_answer(&reply)
    }

    /// A claim's answer, as `line.lua` gives it: `1 job clock limit dropped`, or
    /// `0 why wake complete dropped (job place)*`.
    fn claim_answer(&self, reply: &[String]) -> Result<(LineAnswer, Vec<String>), StoreError> {
        let mut fields = reply.iter();
        let dropped = |field: Option<&String>| -> Vec<String> {
            field.map(|ids| ids.split(' ').filter(|id| !id.is_empty()).map(str::to_owned).collect()).unwrap_or_default()
        };
        match fields.next().map(String::as_str) {
            Some("1") => {
                let job = fields.next().cloned().ok_or_else(|| self.malformed("a claim without its job".into()))?;
                let now_us: u64 = self.number("a clock", fields.next())?;
                let current: i64 = self.number("a limit", fields.next())?;
                let at = Nanos::from_micros(now_us);
                let limit = u64::try_from(current).ok().map(|current| SharedLimit { current, at });
                Ok((LineAnswer::Go { job, at, limit }, dropped(fields.next())))
            }
            Some("0") => {
                let why = match fields.next().map(String::as_str) {
                    Some("1") => LineWait::Full,
                    Some("2") => LineWait::Theirs,
                    _ => LineWait::Nothing,
                };
                let wake: i64 = self.number("a wait", fields.next())?;
                let complete = fields.next().map(String::as_str) == Some("1");
                let dropped = dropped(fields.next());
                let mut mine = Vec::new();
                while let Some(job) = fields.next() {
                    mine.push((job.clone(), self.number("a place", fields.next())?));
                }
                Ok((LineAnswer::Wait { why, wake: u64::try_from(wake).ok().map(Nanos::new), mine, complete }, dropped))
            }
            other => Err(self.malformed(format!("line.lua answered {other:?}"))),
        }
    }
}

/// The line on Redis's clock.
impl SharedLine for RedisStore {
    fn join<'a>(&'a self, at: LineAt<'a>, entry: &'a LineEntry, place: &'a JoinAt) -> StoreFuture<'a, (f64, String)> {
        Box::pin(async move {
            let mut invocation = self.line_call(at, "join");
            invocation.arg(entry.member(at.instance)).arg(&entry.flow).arg(format!("{}", entry.weight));
            match place {
                JoinAt::Back => invocation.arg("").arg(""),
                JoinAt::Front => invocation.arg("front").arg(""),
                JoinAt::Again { tag, member } => invocation.arg(format!("{tag:?}")).arg(member),
            };
            let (tag, member): (String, String) =
                bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
            let tag = tag.parse().map_err(|_| self.malformed(format!("line.lua answered tag {tag:?}")))?;
            Ok((tag, member))
        })
    }

    fn leave<'a>(&'a self, at: LineAt<'a>, member: &'a str) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let mut invocation = self.line_call(at, "leave");
            invocation.arg(member);
            let left: i64 = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
            Ok(left == 1)
        })
    }

    fn alive<'a>(&'a self, at: LineAt<'a>) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let invocation = self.line_call(at, "alive");
            let _: i64 = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
            Ok(())
        })
    }

    fn claim<'a>(&'a self, at: LineAt<'a>, claim: LineClaim<'a>) -> StoreFuture<'a, (LineAnswer, Vec<String>)> {
        Box::pin(async move { self.line_claim(at, claim).await })
    }
}
