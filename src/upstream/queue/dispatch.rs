//! The dispatcher: one task hands out the account's slots as they free and gaps pass — by the
//! shared line when the store keeps one, by this instance's round robin otherwise — and a job is
//! put back at the front of its flow, or taken out of the line.

use std::sync::Arc;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::round_robin::Waiting;
use super::{AccountSlot, Blocker, Counted, FairQueue, Flowing, Turn, line};
use crate::clock::Nanos;
use crate::upstream::classes::ClassId;

impl FairQueue {
    /// Serves waiting jobs as slots free up and gaps pass, until `stop`. Over a shared store, a
    /// slot freed by any instance is heard at once, and the jobs waiting here ask for it then.
    pub async fn dispatch(self: Arc<Self>, stop: CancellationToken) {
        let mut freed = self.shared.as_ref().and_then(|s| s.freed.clone());
        let mut alive_at = tokio::time::Instant::now();
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let now = self.clock.now();
            let (wake_at, in_line) = if let Some((shared, line)) = self.line_now(now) {
                match self.line_step(shared, line, &mut alive_at).await {
                    line::LineStep::Again => continue,
                    // While jobs here stand in the line, they say so in real time (its clock).
                    line::LineStep::Wait(at) => (at, self.state().joined_count() > 0),
                }
            } else {
                match self.local_step(now).await {
                    Some(wake_at) => (wake_at, false),
                    None => continue,
                }
            };
            // Real time, made only when needed: the simulator's runtime keeps no timers.
            let heartbeat = async {
                if in_line {
                    tokio::time::sleep_until(alive_at + crate::store::LINE_HEARTBEAT).await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            let sleep = async {
                match wake_at {
                    Some(at) => self.clock.sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let heard = async {
                match freed.as_mut() {
                    Some(freed) => freed.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = &mut changed => {}
                () = sleep => {}
                () = heartbeat => {}
                listening = heard => {
                    if listening {
                        // Another instance freed a slot: what it said full may not be any more.
                        let mut state = self.state();
                        (state.account_full_until, state.unverified_full_until) = (Nanos::ZERO, Nanos::ZERO);
                    } else {
                        freed = None;
                    }
                }
            }
        }
    }

    /// One step of the local round robin (no shared line, or the store cannot answer): the next
    /// job picked here gets its slot (claimed in the shared store, if any), or when to look
    /// again. `None`: step again at once.
    async fn local_step(self: &Arc<Self>, now: Nanos) -> Option<Option<Nanos>> {
        let (picked, wake_at) = {
            let mut state = self.state();
            let rules = self.rules_now();
            match state.pick(&rules, now) {
                Some(mut job) => {
                    // Chosen here while the line could not be asked: out of the line, and
                    // back in with its tag if it must wait again.
                    if let Some(joined) = job.joined.take() {
                        state.leaving.push(joined.member.clone());
                        job.rejoin_at = Some(joined);
                    }
                    let counted = Counted::take(self, &mut state, job.standing);
                    if let Some(gap) = self.class(job.class).and_then(|c| c.min_gap) {
                        state.set_next_at(job.class, now + gap);
                    }
                    (Some((job, counted)), None)
                }
                None => (None, state.next_wake(&rules, now)),
            }
        };
        if let Some((job, counted)) = picked {
            let (leases, shared_at) = match self.claim(job.class, job.standing.unverified).await {
                Ok(claimed) => claimed,
                Err((wait, blocker)) => {
                    // Another instance holds the slots (or the share), or submitted a job of
                    // this class within its gap: back to the front, until the store says.
                    let mut state = self.state();
                    counted.give_back(&mut state);
                    let until = self.clock.now() + wait;
                    match blocker {
                        Blocker::Account => state.account_full_until = until,
                        Blocker::UnverifiedShare => state.unverified_full_until = until,
                        Blocker::Gap => state.set_next_at(job.class, until),
                    }
                    state.unpick(job);
                    return None;
                }
            };
            // A job that left meanwhile drops its receiver: the slot comes straight back.
            let taken_at = self.clock.now();
            let slot = AccountSlot { counted, taken_at, shared_at, _leases: leases };
            let _ = job.turn.send(slot);
            return None;
        }
        Some(wake_at)
    }

    /// Puts `id` back at the front of `flow` after a failed attempt (its slot already given
    /// back), not to leave before `not_before`.
    pub fn requeue_front(self: &Arc<Self>, flow: &Flowing<'_>, id: &str, class: ClassId, not_before: Nanos) -> Turn {
        let (turn, waiting) = oneshot::channel();
        let (standing, quantum) = (flow.standing, flow.quantum);
        let job = Waiting::new(id, class, standing, not_before, turn);
        let flow = flow.name;
        self.state().push(flow, quantum, job, true);
        self.changed.notify_waiters();
        Turn { slot: waiting, queue: self.clone(), id: id.to_owned(), done: false }
    }

    /// Takes `id` out of the line (a cancelled job); `true` if it was waiting.
    pub fn remove(&self, id: &str) -> bool {
        let removed = self.state().remove(id);
        if removed {
            self.changed.notify_waiters();
        }
        removed
    }

    /// Takes out of the line the entries for `id` whose [`Turn`] was dropped before it came.
    pub(super) fn forget_abandoned(&self, id: &str) {
        let removed = self.state().remove_abandoned(id);
        if removed {
            self.changed.notify_waiters();
        }
    }
}
