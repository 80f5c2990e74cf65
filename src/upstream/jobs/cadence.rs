//! When to poll a running job: timed by how long the jobs of its class have been seen to take.
//!
//! A job holds one of the account's slots until the server *learns* that it ended, so every moment
//! between its end and the poll that sees it is a slot paid for and left idle. A fixed cadence (a
//! poll every `image_poll_seconds`) leaves half an interval idle on average; polling faster costs
//! polls of the paid API. Instead each class (image, video, …) keeps the durations its recent jobs
//! were seen to take, and a job is polled:
//!
//! - first at the **expected end**: the upper quartile of those durations, and a twentieth more —
//!   so most jobs are final at their first poll, one poll each;
//! - then, while it is not final, every **tenth of its age** — so a job is seen final within about
//!   a tenth of its length after it ends, and one that runs far past the typical length costs a
//!   poll per 10 % of its age, not one per fixed step.
//!
//! With webhooks on ([`Cadence::webhooks`]), the end is pushed to the server the moment it happens,
//! and the first background poll waits until **twice** the expected end: it is only the safety
//! net for a webhook that was lost.
//!
//! A duration is learnt from what the API says of a job that succeeded (`metrics.predict_time`,
//! as Replicate reports it), else from when its webhook came, else from the polls that bracket its
//! end (the middle of the last poll that found it running and the one that found it final). What
//! is kept is bounded ([`KEPT`] durations per class, each within a week), starts from the class's
//! configured hint before the first job ends, and is shared through Redis when one is configured,
//! so a restarted instance starts from what the others learnt ([`Cadence::learnt`]).
//!
//! The agents' hints (`next_poll_in_seconds`, `pollIntervalMs`) follow the same estimate.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use crate::clock::Nanos;
use crate::upstream::classes::{ClassId, JobClasses};

/// Durations kept per class: the most recent ones.
pub const KEPT: usize = 64;

/// The least time between two polls of one job.
const LEAST_STEP: Nanos = Nanos::from_millis(50);

/// The longest duration taken as learnt: a job this long has expired anyway.
const LONGEST: Nanos = Nanos::from_secs(7 * 86_400);

/// How long the jobs of each class take, as seen; see the module.
#[derive(Debug)]
pub struct Cadence {
    classes: Vec<Mutex<Learnt>>,
    names: Vec<&'static str>,
    webhooks: bool,
}

/// One class's recent durations, and the hint it starts from.
#[derive(Debug)]
struct Learnt {
    hint: Nanos,
    recent: VecDeque<Nanos>,
    /// The upper quartile of `recent`, kept current as it changes.
    expected: Option<Nanos>,
    /// Learnt something since [`Cadence::learnt`] was last read.
    changed: bool,
}

impl Learnt {
    fn learn(&mut self, took: Nanos) {
        if self.recent.len() >= KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(took.clamp(Nanos::new(1), LONGEST));
        let mut sorted: Vec<Nanos> = self.recent.iter().copied().collect();
        sorted.sort_unstable();
        // The upper quartile: the smallest duration at least three in four of them do not pass.
        let at = (sorted.len() * 3).div_ceil(4).saturating_sub(1);
        self.expected = sorted.get(at).copied();
        self.changed = true;
    }
}

impl Cadence {
    /// Nothing learnt yet: every class's jobs are polled at its configured hint until one ends.
    /// With `webhooks`, the end is expected by webhook and the first poll waits twice as long.
    pub fn new(classes: &JobClasses, webhooks: bool) -> Self {
        let learnt = |hint| Mutex::new(Learnt { hint, recent: VecDeque::new(), expected: None, changed: false });
        Self {
            classes: classes.iter().map(|(_, class)| learnt(class.poll_hint)).collect(),
            names: classes.iter().map(|(_, class)| class.name).collect(),
            webhooks,
        }
    }

    fn class(&self, class: ClassId) -> Option<MutexGuard<'_, Learnt>> {
        // A class's durations are changed in one push: a panic cannot leave them half-written.
        self.classes.get(class.index()).map(|learnt| learnt.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Whether ends come by webhook.
    pub fn webhooks(&self) -> bool {
        self.webhooks
    }

    /// How long after its submission a job of `class` is expected to be final: a twentieth past
    /// the upper quartile of the durations seen, or the configured hint before any was.
    pub fn expected(&self, class: ClassId) -> Nanos {
        self.class(class).map_or(LEAST_STEP, |learnt| match learnt.expected {
            Some(took) => (took + took / 20).max(LEAST_STEP),
            None => learnt.hint.max(LEAST_STEP),
        })
    }

    /// How long after its submission a job of `class` is first polled: at its expected end, or
    /// twice that when a webhook is expected first.
    pub fn first_poll(&self, class: ClassId) -> Nanos {
        let expected = self.expected(class);
        if self.webhooks { expected * 2 } else { expected }
    }

    /// How long after a poll that found a job of `class` still running, `age` after its
    /// submission, it is polled again: a tenth of its age, at least a tenth of the expected
    /// length (and 50 ms). Before anything is learnt, the configured hint.
    pub fn next_poll(&self, class: ClassId, age: Nanos) -> Nanos {
        let Some(learnt) = self.class(class) else { return LEAST_STEP };
        if learnt.expected.is_none() {
            return learnt.hint.max(LEAST_STEP);
        }
        drop(learnt);
        (age.max(self.expected(class)) / 10).max(LEAST_STEP)
    }

    /// Learns that a job of `class` took `took`.
    pub fn learn(&self, class: ClassId, took: Nanos) {
        if let Some(mut learnt) = self.class(class) {
            learnt.learn(took);
        }
    }

    /// What was learnt of each class, by name, in milliseconds, when anything was learnt since the
    /// last call: for a shared store, so another (or a restarted) instance starts from it.
    pub fn learnt(&self) -> Option<Learnings> {
        let mut changed = false;
        let mut classes = std::collections::BTreeMap::new();
        for (name, learnt) in self.names.iter().zip(&self.classes) {
            let mut learnt = learnt.lock().unwrap_or_else(|p| p.into_inner());
            changed |= std::mem::take(&mut learnt.changed);
            let ms = learnt.recent.iter().map(|took| took.as_u64() / crate::clock::NANOS_PER_MS).collect();
            classes.insert((*name).to_owned(), ms);
        }
        changed.then_some(Learnings { classes })
    }

    /// Starts from `learnings` (another instance's, or this one's before a restart): each class
    /// named there learns its durations, oldest first, before what this instance saw itself.
    pub fn start_from(&self, learnings: &Learnings) {
        for (name, learnt) in self.names.iter().zip(&self.classes) {
            let Some(durations) = learnings.classes.get(*name) else { continue };
            let mut learnt = learnt.lock().unwrap_or_else(|p| p.into_inner());
            let own: Vec<Nanos> = learnt.recent.drain(..).collect();
            let start = durations.len().saturating_sub(KEPT);
            for &ms in &durations[start..] {
                learnt.learn(Nanos::from_millis(ms));
            }
            for took in own {
                learnt.learn(took);
            }
            learnt.changed = false;
        }
    }
}

/// What [`Cadence`] learnt, as kept in a shared store: class name → recent durations in ms.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Learnings {
    /// Class name → its recent durations in milliseconds, oldest first.
    pub classes: std::collections::BTreeMap<String, Vec<u64>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::classes::{IMAGE, JobClass, VIDEO};

    fn classes() -> JobClasses {
        JobClasses::new(vec![
            JobClass { poll_hint: Nanos::from_secs(2), ..JobClass::plain("image") },
            JobClass { poll_hint: Nanos::from_secs(10), ..JobClass::plain("video") },
        ])
    }

    #[test]
    fn before_any_job_ends_each_class_is_polled_at_its_hint() {
        let cadence = Cadence::new(&classes(), false);
        assert_eq!(cadence.first_poll(IMAGE), Nanos::from_secs(2));
        assert_eq!(cadence.next_poll(IMAGE, Nanos::from_secs(2)), Nanos::from_secs(2));
        assert_eq!(cadence.first_poll(VIDEO), Nanos::from_secs(10));
    }

    #[test]
    fn once_jobs_end_the_first_poll_is_just_past_the_upper_quartile_then_a_tenth_of_the_age() {
        let cadence = Cadence::new(&classes(), false);
        for ms in [800, 900, 1_000, 1_000] {
            cadence.learn(IMAGE, Nanos::from_millis(ms));
        }
        assert_eq!(cadence.first_poll(IMAGE), Nanos::from_millis(945), "900 ms and a twentieth");
        assert_eq!(cadence.next_poll(IMAGE, Nanos::from_millis(945)), Nanos::from_micros(94_500));
        assert_eq!(cadence.next_poll(IMAGE, Nanos::from_secs(5)), Nanos::from_millis(500), "a tenth of its age");
        assert_eq!(cadence.first_poll(VIDEO), Nanos::from_secs(10), "the other class learnt nothing");
    }

    #[test]
    fn with_webhooks_the_first_poll_waits_twice_the_expected_end() {
        let cadence = Cadence::new(&classes(), true);
        cadence.learn(IMAGE, Nanos::from_secs(1));
        assert_eq!(cadence.expected(IMAGE), Nanos::from_millis(1_050));
        assert_eq!(cadence.first_poll(IMAGE), Nanos::from_millis(2_100));
    }

    #[test]
    fn what_is_kept_is_bounded_and_follows_the_recent_jobs() {
        let cadence = Cadence::new(&classes(), false);
        for _ in 0..1_000 {
            cadence.learn(IMAGE, Nanos::from_secs(30));
        }
        for _ in 0..KEPT {
            cadence.learn(IMAGE, Nanos::from_secs(1));
        }
        assert_eq!(cadence.expected(IMAGE), Nanos::from_millis(1_050));
        let learnt = cadence.learnt().expect("changed");
        assert_eq!(learnt.classes["image"].len(), KEPT);
        assert_eq!(cadence.learnt(), None, "nothing new since");
        cadence.learn(IMAGE, LONGEST * 10);
        assert_eq!(cadence.learnt().expect("changed").classes["image"].last(), Some(&(LONGEST.as_u64() / 1_000_000)));
    }

    #[test]
    fn a_restarted_instance_starts_from_what_was_learnt() {
        let before = Cadence::new(&classes(), false);
        for _ in 0..8 {
            before.learn(VIDEO, Nanos::from_secs(30));
        }
        let learnt = before.learnt().expect("changed");
        let after = Cadence::new(&classes(), false);
        after.start_from(&learnt);
        assert_eq!(after.expected(VIDEO), Nanos::from_millis(31_500));
        assert_eq!(after.first_poll(IMAGE), Nanos::from_secs(2));
        assert_eq!(after.learnt(), None, "what it started from is not new");
        let odd = Learnings { classes: [("nope".to_owned(), vec![1, 2])].into() };
        after.start_from(&odd);
        assert_eq!(after.expected(VIDEO), Nanos::from_millis(31_500));
    }
}
