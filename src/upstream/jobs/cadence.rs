//! When to poll a running job: timed by how long the jobs of its class have been seen to take.
//!
//! A job holds one of the account's slots until the server *learns* that it ended, so every moment
//! between its end and the poll that sees it is a slot paid for and left idle. A fixed cadence (a
//! poll every `image_poll_seconds`) leaves half an interval idle on average; polling faster costs
//! polls of the paid API. Instead each class (image, video, …) keeps the lengths its recent jobs
//! were seen to take, and polls a job at the **marks** those lengths set: their sixths (the
//! lengths a sixth, two sixths, … all of them do not pass), marks closer than a tenth of
//! themselves merged, counted from when the answer to its submission arrived (the upstream had
//! started it by then). Then:
//!
//! - jobs of one length (a model that always takes 1 s) have one mark: each is polled once, as it
//!   ends;
//! - jobs of spread lengths are polled where their ends are likely, at most six times up to the
//!   longest seen (about three and a half on average for lengths spread evenly);
//! - a job past the longest is polled every **tenth of its age**, so it is seen final within about
//!   a tenth of its length, and one that runs far long costs a poll per 10 % of its age.
//!
//! With webhooks on ([`Cadence::webhooks`]), the end is pushed to the server the moment it happens,
//! and the first background poll waits until **twice** the longest length seen: it is only the
//! safety net for a webhook that was lost.
//!
//! A length is learnt from when the job's webhook came, else from the polls that bracket its end:
//! what the API says it ran (`metrics.predict_time`, as Replicate reports it) if it ran at least as
//! long as the last poll that found it running (a time the API measures leaves out its own queue),
//! else the middle of that poll and the one that found it final. What is kept is bounded ([`KEPT`]
//! lengths per class, each within a week), starts from the class's configured hint before the
//! first job ends, and is shared through Redis when one is configured, so a restarted instance
//! starts from what the others learnt ([`Cadence::learnt`]).
//!
//! The agents' hints (`next_poll_in_seconds`, `pollIntervalMs`) follow the same marks.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use crate::clock::Nanos;
use crate::upstream::classes::{ClassId, JobClasses};

/// Lengths kept per class: the most recent ones.
pub const KEPT: usize = 64;

/// The marks a class's lengths are cut into.
const MARKS: usize = 6;

/// The least time between two polls of one job.
const LEAST_STEP: Nanos = Nanos::from_millis(50);

/// The longest length taken as learnt: a job this long has expired anyway.
const LONGEST: Nanos = Nanos::from_secs(7 * 86_400);

/// How long the jobs of each class take, as seen; see the module.
#[derive(Debug)]
pub struct Cadence {
    classes: Vec<Mutex<Learnt>>,
    names: Vec<&'static str>,
    webhooks: bool,
}

/// One class's recent lengths, and the hint it starts from.
#[derive(Debug)]
struct Learnt {
    hint: Nanos,
    recent: VecDeque<Nanos>,
    /// When a job is polled, after its submission: the marks `recent` sets, ascending (empty
    /// while nothing is learnt).
    marks: Vec<Nanos>,
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
        self.marks.clear();
        for sixth in 1..=MARKS {
            // The smallest length at least `sixth` sixths of them do not pass.
            let at = (sorted.len() * sixth).div_ceil(MARKS).saturating_sub(1);
            let Some(&length) = sorted.get(at) else { continue };
            let mark = length.max(LEAST_STEP);
            match self.marks.last() {
                // Closer than a tenth of itself to the one before: one poll for both, the later.
                Some(&last) if mark - last < mark / 10 => {
                    if let Some(last) = self.marks.last_mut() {
                        *last = mark;
                    }
                }
                _ => self.marks.push(mark),
            }
        }
        self.changed = true;
    }

    /// The last mark: by then the jobs seen had all ended.
    fn longest(&self) -> Nanos {
        self.marks.last().copied().unwrap_or(self.hint).max(LEAST_STEP)
    }
}

impl Cadence {
    /// Nothing learnt yet: every class's jobs are polled at its configured hint until one ends.
    /// With `webhooks`, the end is expected by webhook and the first poll waits twice as long.
    pub fn new(classes: &JobClasses, webhooks: bool) -> Self {
        let learnt = |hint| Mutex::new(Learnt { hint, recent: VecDeque::new(), marks: Vec::new(), changed: false });
        Self {
            classes: classes.iter().map(|(_, class)| learnt(class.poll_hint)).collect(),
            names: classes.iter().map(|(_, class)| class.name).collect(),
            webhooks,
        }
    }

    fn class(&self, class: ClassId) -> Option<MutexGuard<'_, Learnt>> {
        // A class's lengths are changed in one push: a panic cannot leave them half-written.
        self.classes.get(class.index()).map(|learnt| learnt.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Whether ends come by webhook.
    pub fn webhooks(&self) -> bool {
        self.webhooks
    }

    /// How long after its submission a job of `class` is expected to be final: the last mark
    /// (every job seen had ended by then), or the configured hint before any job ended. A job running past it is most likely idle, the server yet to learn it.
    pub fn expected(&self, class: ClassId) -> Nanos {
        self.class(class).map_or(LEAST_STEP, |learnt| learnt.longest())
    }

    /// How long after its submission a job of `class` is first polled: at the first mark (the
    /// hint before anything is learnt), or with webhooks at twice the expected end.
    pub fn first_poll(&self, class: ClassId) -> Nanos {
        let Some(learnt) = self.class(class) else { return LEAST_STEP };
        if self.webhooks {
            return learnt.longest() * 2;
        }
        learnt.marks.first().copied().unwrap_or(learnt.hint).max(LEAST_STEP)
    }

    /// How long after a poll that found a job of `class` still running, `age` after its
    /// submission, it is polled again: at the next mark at least a tenth of its age later, past
    /// the last mark a tenth of its age (never within 50 ms). Before anything is learnt, the hint.
    pub fn next_poll(&self, class: ClassId, age: Nanos) -> Nanos {
        let Some(learnt) = self.class(class) else { return LEAST_STEP };
        if learnt.marks.is_empty() {
            return learnt.hint.max(LEAST_STEP);
        }
        let step = (age / 10).max(LEAST_STEP);
        match learnt.marks.iter().find(|&&mark| mark >= age + step) {
            Some(&mark) => mark - age,
            None => step,
        }
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
    /// named there learns its lengths, oldest first, before what this instance saw itself.
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

/// What [`Cadence`] learnt, as kept in a shared store: class name → recent lengths in ms.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Learnings {
    /// Class name → its recent lengths in milliseconds, oldest first.
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
    fn jobs_of_one_length_are_polled_once_as_they_end_then_a_tenth_of_their_age() {
        let cadence = Cadence::new(&classes(), false);
        for _ in 0..4 {
            cadence.learn(IMAGE, Nanos::from_secs(1));
        }
        assert_eq!(cadence.first_poll(IMAGE), Nanos::from_secs(1));
        assert_eq!(cadence.expected(IMAGE), Nanos::from_secs(1));
        assert_eq!(cadence.next_poll(IMAGE, Nanos::from_secs(1)), Nanos::from_millis(100));
        assert_eq!(cadence.next_poll(IMAGE, Nanos::from_secs(5)), Nanos::from_millis(500), "a tenth of its age");
        assert_eq!(cadence.first_poll(VIDEO), Nanos::from_secs(10), "the other class learnt nothing");
    }

    #[test]
    fn spread_lengths_are_polled_at_their_sixths_and_close_marks_merge() {
        let cadence = Cadence::new(&classes(), false);
        for s in 1..=6 {
            cadence.learn(IMAGE, Nanos::from_secs(s * 10));
        }
        let marks: Vec<u64> = (0..6)
            .scan(Nanos::ZERO, |age, _| {
                let next =
                    if *age == Nanos::ZERO { cadence.first_poll(IMAGE) } else { *age + cadence.next_poll(IMAGE, *age) };
                *age = next;
                Some(next.as_u64() / 1_000_000)
            })
            .collect();
        assert_eq!(marks, [10_000, 20_000, 30_000, 40_000, 50_000, 60_000], "each sixth");
        let close = Cadence::new(&classes(), false);
        for ms in [1_000, 1_010, 1_020, 1_030, 1_040, 1_050] {
            close.learn(IMAGE, Nanos::from_millis(ms));
        }
        assert_eq!(close.first_poll(IMAGE), Nanos::from_millis(1_050), "one mark for lengths within a tenth");
        assert_eq!(close.next_poll(IMAGE, Nanos::from_millis(1_050)), Nanos::from_millis(105));
    }

    #[test]
    fn with_webhooks_the_first_poll_waits_twice_the_expected_end() {
        let cadence = Cadence::new(&classes(), true);
        assert_eq!(cadence.first_poll(IMAGE), Nanos::from_secs(4), "twice the hint before anything is learnt");
        cadence.learn(IMAGE, Nanos::from_secs(1));
        assert_eq!(cadence.expected(IMAGE), Nanos::from_secs(1));
        assert_eq!(cadence.first_poll(IMAGE), Nanos::from_secs(2));
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
        assert_eq!(cadence.expected(IMAGE), Nanos::from_secs(1));
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
        assert_eq!(after.expected(VIDEO), Nanos::from_secs(30));
        assert_eq!(after.first_poll(IMAGE), Nanos::from_secs(2));
        assert_eq!(after.learnt(), None, "what it started from is not new");
        let odd = Learnings { classes: [("nope".to_owned(), vec![1, 2])].into() };
        after.start_from(&odd);
        assert_eq!(after.expected(VIDEO), Nanos::from_secs(30));
    }
}
