//! The spaced submission queue: at most one upstream submission per `gap`, first come first
//! served across every caller, with a bounded number of places.
//!
//! Video APIs take a submission only every so often; an agent that fans out ten videos, or ten
//! agents that each send one, must not turn into ten submissions in the same second (ten 429s,
//! and a retry storm after them). A job reserves a place *before* anything is charged (a full
//! queue is refused `busy` with the wait, and the caller's budget is untouched), then waits for
//! its turn here. Its task — not a dispatcher — does the submitting, so a cancelled job simply
//! leaves the line.
//!
//! The head of the line is served once the clock has reached both `next_free_at` (the previous
//! submission plus `gap`) and the head's own `not_before` (a backoff after a failed attempt puts
//! the job back at the *front* with the delay, so retries keep their place and stay spaced too).
//! Every wait is on the shared [`Clock`](crate::clock::Clock), so tests walk it.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::clock::{Nanos, SharedClock};

#[derive(Debug)]
struct Waiting {
    id: String,
    not_before: Nanos,
}

#[derive(Debug, Default)]
struct Line {
    /// When the next submission may leave: the last one plus the gap.
    next_free_at: Nanos,
    waiting: VecDeque<Waiting>,
    /// Places promised to calls still being admitted.
    reserved: usize,
}

/// A FIFO of jobs waiting to be submitted, spaced by a minimum gap.
#[derive(Debug)]
pub struct SpacedQueue {
    gap: Nanos,
    max: usize,
    clock: SharedClock,
    line: Mutex<Line>,
    changed: Notify,
}

/// Where a queued job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    /// Jobs ahead of it (0: it is next).
    pub ahead: usize,
    /// Expected time until it is submitted, if nothing ahead has to retry.
    pub wait: Nanos,
}

/// A place promised in the queue while the call that asked for it is being admitted; given back
/// if dropped without [`Reservation::enqueue`].
#[derive(Debug)]
#[must_use = "dropping a reservation gives the place back"]
pub struct Reservation {
    queue: Arc<SpacedQueue>,
    used: bool,
}

impl SpacedQueue {
    /// A queue of at most `max` jobs, submitting at most one per `gap`.
    pub fn new(gap: Nanos, max: usize, clock: SharedClock) -> Self {
        Self { gap, max: max.max(1), clock, line: Mutex::new(Line::default()), changed: Notify::new() }
    }

    fn line(&self) -> MutexGuard<'_, Line> {
        // Every update leaves the line whole, so a poisoned lock is still consistent.
        self.line.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The most jobs that may wait.
    pub fn max(&self) -> usize {
        self.max
    }

    /// The least time between two submissions.
    pub fn gap(&self) -> Nanos {
        self.gap
    }

    /// Jobs waiting now.
    pub fn len(&self) -> usize {
        self.line().waiting.len()
    }

    /// Whether no job is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// When the head of `line` may leave.
    fn head_ready_at(&self, line: &Line, now: Nanos) -> Nanos {
        let head = line.waiting.front().map_or(0, |w| w.not_before);
        now.max(line.next_free_at).max(head)
    }

    /// Promises a place, or says how long until one frees up (the head leaving).
    pub fn reserve(self: &Arc<Self>) -> Result<Reservation, Nanos> {
        let now = self.clock.now();
        let mut line = self.line();
        if line.waiting.len() + line.reserved >= self.max {
            // A place frees when the head leaves; a reserved place may free sooner, never later.
            return Err((self.head_ready_at(&line, now) - now).max(1));
        }
        line.reserved += 1;
        Ok(Reservation { queue: self.clone(), used: false })
    }

    /// Where `id` stands, if it is waiting.
    pub fn position(&self, id: &str) -> Option<Position> {
        let now = self.clock.now();
        let line = self.line();
        let ahead = line.waiting.iter().position(|w| w.id == id)?;
        let wait = self.head_ready_at(&line, now) - now + self.gap.saturating_mul(ahead as u64);
        Some(Position { ahead, wait })
    }

    /// Waits until `id` is at the head and its time has come, then takes it out of the line and
    /// starts the gap. `false` if `id` left the line meanwhile ([`SpacedQueue::remove`]).
    pub async fn wait_turn(&self, id: &str) -> bool {
        loop {
            // Registered before the line is read, so a change made in between still wakes us.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let ready_at = {
                let now = self.clock.now();
                let mut line = self.line();
                match line.waiting.iter().position(|w| w.id == id) {
                    None => return false,
                    Some(0) => {
                        let ready_at = self.head_ready_at(&line, now);
                        if ready_at <= now {
                            line.waiting.pop_front();
                            line.next_free_at = now.saturating_add(self.gap);
                            drop(line);
                            self.changed.notify_waiters();
                            return true;
                        }
                        Some(ready_at)
                    }
                    Some(_) => None,
                }
            };
            match ready_at {
                Some(at) => {
                    tokio::select! {
                        () = self.clock.sleep_until(at) => {}
                        () = &mut changed => {}
                    }
                }
                None => changed.await,
            }
        }
    }

    /// Puts `id` back at the head after a failed attempt, not to leave before `not_before`.
    pub fn requeue_front(&self, id: &str, not_before: Nanos) {
        self.line().waiting.push_front(Waiting { id: id.to_owned(), not_before });
        self.changed.notify_waiters();
    }

    /// Takes `id` out of the line (a cancelled job); `true` if it was waiting.
    pub fn remove(&self, id: &str) -> bool {
        let removed = {
            let mut line = self.line();
            let before = line.waiting.len();
            line.waiting.retain(|w| w.id != id);
            line.waiting.len() != before
        };
        if removed {
            self.changed.notify_waiters();
        }
        removed
    }
}

impl Reservation {
    /// Turns the promised place into `id` waiting at the back of the line.
    pub fn enqueue(mut self, id: &str) {
        self.used = true;
        let mut line = self.queue.line();
        line.reserved = line.reserved.saturating_sub(1);
        line.waiting.push_back(Waiting { id: id.to_owned(), not_before: 0 });
        drop(line);
        self.queue.changed.notify_waiters();
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.used {
            let mut line = self.queue.line();
            line.reserved = line.reserved.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::clock::{ManualClock, NANOS_PER_SEC};

    const GAP: Nanos = 2 * NANOS_PER_SEC;

    async fn settled<F: std::future::Future>(f: F) -> Option<F::Output> {
        tokio::time::timeout(Duration::from_millis(50), f).await.ok()
    }

    #[tokio::test]
    async fn turns_are_first_come_first_served_and_spaced_by_the_gap() {
        let clock = ManualClock::new();
        let queue = Arc::new(SpacedQueue::new(GAP, 10, clock.clone()));
        for id in ["a", "b", "c"] {
            queue.reserve().expect("room").enqueue(id);
        }
        assert_eq!(queue.position("c"), Some(Position { ahead: 2, wait: 2 * GAP }));
        assert_eq!(settled(queue.wait_turn("a")).await, Some(true), "the first goes at once");
        assert_eq!(settled(queue.wait_turn("b")).await, None, "b waits for the gap");
        clock.advance(Duration::from_nanos(GAP - 1));
        assert_eq!(settled(queue.wait_turn("b")).await, None, "one nanosecond short");
        clock.advance(Duration::from_nanos(1));
        assert_eq!(settled(queue.wait_turn("b")).await, Some(true));
        assert_eq!(queue.position("c"), Some(Position { ahead: 0, wait: GAP }));
    }

    #[tokio::test]
    async fn a_full_queue_refuses_with_the_wait_until_the_head_leaves_and_unused_places_come_back() {
        let clock = ManualClock::new();
        let queue = Arc::new(SpacedQueue::new(GAP, 2, clock.clone()));
        queue.reserve().expect("room").enqueue("a");
        assert_eq!(settled(queue.wait_turn("a")).await, Some(true));
        queue.reserve().expect("room").enqueue("b");
        let held = queue.reserve().expect("room");
        assert_eq!(queue.reserve().err(), Some(GAP), "b leaves when the gap has passed");
        drop(held);
        assert!(queue.reserve().is_ok(), "an unused reservation gives its place back");
    }

    #[tokio::test]
    async fn a_retry_keeps_its_place_at_the_front_and_waits_out_its_backoff() {
        let clock = ManualClock::new();
        let queue = Arc::new(SpacedQueue::new(GAP, 10, clock.clone()));
        queue.reserve().expect("room").enqueue("a");
        queue.reserve().expect("room").enqueue("b");
        assert_eq!(settled(queue.wait_turn("a")).await, Some(true));
        queue.requeue_front("a", 5 * NANOS_PER_SEC);
        clock.advance(Duration::from_secs(4));
        assert_eq!(settled(queue.wait_turn("b")).await, None, "b is behind a's retry");
        clock.advance(Duration::from_secs(1));
        assert_eq!(settled(queue.wait_turn("a")).await, Some(true));
        assert_eq!(queue.position("b").map(|p| p.wait), Some(GAP));
    }

    #[tokio::test]
    async fn a_removed_job_stops_waiting_and_the_next_moves_up() {
        let clock = ManualClock::new();
        let queue = Arc::new(SpacedQueue::new(GAP, 10, clock.clone()));
        for id in ["a", "b"] {
            queue.reserve().expect("room").enqueue(id);
        }
        let waiting_b = tokio::spawn({
            let queue = queue.clone();
            async move { queue.wait_turn("b").await }
        });
        assert!(queue.remove("b"));
        assert!(!waiting_b.await.expect("task"), "b left the line");
        assert_eq!(queue.position("a").map(|p| p.ahead), Some(0));
        assert_eq!(queue.len(), 1);
    }
}
