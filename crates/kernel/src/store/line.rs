//! The one line every instance's waiting jobs stand in ([`SharedLine`]), kept in a store shared by
//! several instances: whichever instance frees a slot of the upstream account, the job whose turn
//! it is goes next, on whichever instance it waits.
//!
//! The line orders jobs by a tag, their flow's virtual finish time (start-time fair queueing: a
//! flow's jobs are tagged one weight apart from the line's virtual time on), so a flow with many
//! jobs waiting delays another's single job by one turn; among the jobs that may go now, one of a
//! tier holding fewer slots than it is reserved goes first, then the highest rank. A claim is
//! made by an instance for its own jobs only: the store takes the slots of the job whose turn it
//! is if that job waits there, and otherwise changes nothing. The jobs' bodies, their callers and
//! their answers stay on their instance; the line holds their order.

use std::time::Duration;

use super::{LearntAt, Lease, SharedLimit, StoreFuture};
use crate::clock::Nanos;
use crate::limit::Limiter;

/// How long an instance counts as alive after its last word to the line. A mark that ran out is
/// given one more such life from the moment a call to the line notices (a grace: after the store
/// was away longer than a mark lasts, every mark runs out at once, and the instances alive say so
/// again before their jobs, some sent upstream meanwhile, are taken for a dead instance's); an
/// instance silent through that too is dead, and its jobs are dropped from the line, so a dead
/// instance never holds it. Instances say so every [`LINE_HEARTBEAT`].
pub const LINE_ALIVE: Duration = Duration::from_secs(5);

/// How often an instance with jobs in the line says it is alive.
pub const LINE_HEARTBEAT: Duration = Duration::from_secs(1);

/// Which line, and who asks.
#[derive(Debug, Clone, Copy)]
pub struct LineAt<'a> {
    /// The hash tag its keys are under (`upstream`, `proxied`): instances with the same name share
    /// one line.
    pub name: &'a str,
    /// The instance asking (random per process).
    pub instance: &'a str,
}

/// One job in the line.
#[derive(Debug, Clone, PartialEq)]
pub struct LineEntry {
    /// Its id (unique across instances).
    pub job: String,
    /// The flow it waits in: a tenant, the address of unverified callers, or a caller.
    pub flow: String,
    /// The flow's weight (its tier's factor): its jobs are tagged `1 / weight` apart.
    pub weight: f64,
    /// Its class, as an index into [`LineClaim::gaps`].
    pub class: usize,
    /// An unverified caller's job, held to their share.
    pub unverified: bool,
    /// The tier whose reserved slots it draws on, as an index into [`LineClaim::tiers`].
    pub tier: Option<usize>,
    /// Its rank when the account is full.
    pub rank: i64,
}

impl LineEntry {
    /// How it is named for `instance`: everything a claim needs to judge it, and nothing a
    /// caller sent (the flow is kept apart). The line names it after the order it joined in too
    /// ([`SharedLine::join`]).
    pub fn member(&self, instance: &str) -> String {
        let tier = self.tier.map_or(0, |t| t.saturating_add(1));
        let class = self.class.saturating_add(1);
        format!(
            "{instance}\u{1f}{}\u{1f}{class}\u{1f}{}\u{1f}{tier}\u{1f}{}",
            self.job,
            u8::from(self.unverified),
            self.rank
        )
    }
}

/// Where a job joins the line.
#[derive(Debug, Clone, PartialEq)]
pub enum JoinAt {
    /// Behind its flow's jobs: a new tag.
    Back,
    /// At the front (a job put back to retry keeps its place): the line's virtual time.
    Front,
    /// Where it stood, under the name it had there (it joins again after the store lost track
    /// of it, or failed while it was asked).
    Again {
        /// Its tag.
        tag: f64,
        /// Its name in the line.
        member: String,
    },
}

/// What a claim is decided under: the account's slots and everything that may hold a job back.
#[derive(Debug, Clone, Copy)]
pub struct LineClaim<'a> {
    /// The account's slots: its key and the static cap.
    pub account: (&'a str, u64),
    /// The unverified callers' share of them: its key and cap.
    pub share: (&'a str, u64),
    /// The learnt limit the caps are scaled to, when the account's slots are learnt.
    pub learnt: Option<LearntAt<'a>>,
    /// Per class: its gap's key and limiter (a GCRA of burst 1), if it has one.
    pub gaps: &'a [Option<(&'a str, &'a Limiter)>],
    /// Per tier with a reserved share or a rank: the key its jobs' slots are counted on, and its
    /// reserved share of the slots.
    pub tiers: &'a [(&'a str, f64)],
    /// The most entries one claim reads.
    pub scan: usize,
    /// A job at the door that has not joined: it goes at once only if it would be next.
    pub candidate: Option<&'a LineEntry>,
    /// The lease the slots are taken under.
    pub lease: Lease,
    /// The channel every instance hears a slot freed on ([`Broadcast::hear`](super::Broadcast::hear)):
    /// a claim that lets a job go and leaves slots free while jobs still wait says so on it, so
    /// the instance whose job is next asks now (several slots freed at once are one message).
    pub told: &'a str,
}

/// Why no job of the claiming instance goes now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineWait {
    /// Every slot of the account is taken.
    Full,
    /// Another instance's job is next.
    Theirs,
    /// No job in the line may go now (gaps, the unverified share).
    Nothing,
}

/// What a claim answered.
#[derive(Debug, Clone, PartialEq)]
pub enum LineAnswer {
    /// This job of the instance goes: its slots were taken under the claim's lease, at `at` on
    /// the store's clock, under the learnt `limit` when the claim had one.
    Go {
        /// The job's id.
        job: String,
        /// The store's clock when its slots were taken.
        at: Nanos,
        /// The learnt limit it was decided under.
        limit: Option<SharedLimit>,
    },
    /// None of the instance's jobs goes now.
    Wait {
        /// Why.
        why: LineWait,
        /// How long until a job may go by time alone (a gap passing), if one may.
        wake: Option<Nanos>,
        /// Per job of this instance in the line: how many go before it.
        mine: Vec<(String, usize)>,
        /// Whether the whole line was read (else `mine` may miss some).
        complete: bool,
    },
}

/// The line every instance's waiting jobs stand in, in a store they share.
pub trait SharedLine: Send + Sync + std::fmt::Debug {
    /// Puts `entry` in the line where `place` says; the tag it has and its name in the line (of
    /// two jobs with one tag, the one that joined first goes first). Joining again under the same
    /// name is harmless: an entry already there keeps its tag.
    fn join<'a>(&'a self, at: LineAt<'a>, entry: &'a LineEntry, place: &'a JoinAt) -> StoreFuture<'a, (f64, String)>;

    /// Takes the entry named `member` ([`LineEntry::member`]) out of the line; whether it was in
    /// it.
    fn leave<'a>(&'a self, at: LineAt<'a>, member: &'a str) -> StoreFuture<'a, bool>;

    /// Says the instance is alive, so its entries stay in the line for [`LINE_ALIVE`].
    fn alive<'a>(&'a self, at: LineAt<'a>) -> StoreFuture<'a, ()>;

    /// Takes the slots of the job whose turn it is, if it is one of this instance's (or the
    /// candidate), in one step; see [`LineAnswer`]. Also the jobs of instances no longer alive it
    /// took out of the line (for the claiming instance to end: nobody else will).
    fn claim<'a>(&'a self, at: LineAt<'a>, claim: LineClaim<'a>) -> StoreFuture<'a, (LineAnswer, Vec<String>)>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_names_the_instance_job_class_share_tier_and_rank_one_based() {
        let entry = LineEntry {
            job: "i_1".into(),
            flow: "tenant:acme".into(),
            weight: 1.0,
            class: 0,
            unverified: true,
            tier: Some(2),
            rank: -1,
        };
        assert_eq!(entry.member("a"), "a\u{1f}i_1\u{1f}1\u{1f}1\u{1f}3\u{1f}-1");
        assert_eq!(LineEntry { tier: None, ..entry }.member("a"), "a\u{1f}i_1\u{1f}1\u{1f}1\u{1f}0\u{1f}-1");
    }
}
