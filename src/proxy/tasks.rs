//! Whose each task is. The proxied server sees one client, the proxy, so it would answer
//! `tasks/get` and `tasks/cancel` for any task to anyone who names it; the proxy records the
//! caller each task was created for (a `CreateTaskResult` coming back from a proxied call) and
//! refuses every other caller as `serve` refuses another caller's job: "unknown task", without
//! saying whether it exists.
//!
//! The record is bounded: a task is forgotten when its `ttl` has passed on the server's clock (a
//! task without one, or with a longer one, after [`LONGEST`]), and at most [`MAX_TASKS`] are
//! kept. When they are all kept, a new task takes the place of one of whoever holds the most
//! (its task due to expire soonest goes), and a made-up key never takes the place of a task of a
//! caller that proved who it is (a configured key, a verified token, the local caller):
//!
//! - an unverified caller's new task (a made-up key, [`Caller::unverified_from`]) takes room from
//!   unverified callers' tasks only — the address holding the most (made-up keys of one address
//!   count together, the new task with them) — and, if there is none, it is not recorded;
//! - a verified caller's takes room from unverified callers' tasks first (the address holding the
//!   most), and only when there are none from the verified caller holding the most, itself counted
//!   with its new task.
//!
//! So a caller that floods the proxy with long-lived tasks forgets its own, never another's, and
//! 10,000 made-up keys holding one task each never push out a configured caller's. A forgotten
//! task, or one not recorded, is nobody's: refused to all.
//!
//! [`Caller::unverified_from`]: crate::identity::Caller::unverified_from

use std::collections::HashMap;
use std::sync::Mutex;

use crate::clock::{Nanos, SharedClock};

/// The most tasks whose owners are remembered at once.
pub const MAX_TASKS: usize = 10_000;
/// The longest a task's owner is remembered: a day.
pub const LONGEST: Nanos = Nanos::from_secs(24 * 3600);

/// Tasks created through the proxy, by id: their owner and when they are forgotten.
pub struct Owners {
    clock: SharedClock,
    tasks: Mutex<HashMap<String, Owned>>,
}

struct Owned {
    /// Its callers: the one its call was made for, and any whose identical call shared that call's
    /// request (`[tools.NAME] coalesce`, never across a tenant).
    callers: Vec<String>,
    /// The address its first caller came from, if that caller is unverified: whose room it is.
    unverified_from: Option<String>,
    until: Nanos,
}

/// The most callers one task is shared by.
const MAX_SHARERS: usize = 64;

impl std::fmt::Debug for Owners {
    /// How many, never whose (a caller id is a secret's hash).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owners").field("tasks", &self.tasks().len()).finish()
    }
}

impl Owners {
    /// Nobody's tasks yet; time read from `clock`.
    pub fn new(clock: SharedClock) -> Self {
        Self { clock, tasks: Mutex::new(HashMap::new()) }
    }

    fn tasks(&self) -> std::sync::MutexGuard<'_, HashMap<String, Owned>> {
        self.tasks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that task `id`, kept by the proxied server for `ttl_ms` (`None`: it says no end),
    /// was handed to `caller` (an identical call's task, shared within its tenant, is handed to
    /// each of them), unverified from the address `unverified_from` if it is
    /// ([`Caller::unverified_from`](crate::identity::Caller::unverified_from)). With the record
    /// full, a task makes room for it as the module says, or it is not recorded.
    pub fn record(&self, id: &str, ttl_ms: Option<u64>, caller: &str, unverified_from: Option<&str>) {
        let now = self.clock.now();
        let life = ttl_ms.map_or(LONGEST, |ms| Nanos::from_millis(ms).min(LONGEST));
        let until = now + life;
        let mut tasks = self.tasks();
        if let Some(task) = tasks.get_mut(id) {
            if task.callers.len() < MAX_SHARERS && !task.callers.iter().any(|c| c == caller) {
                task.callers.push(caller.to_owned());
            }
            return;
        }
        if tasks.len() >= MAX_TASKS {
            tasks.retain(|_, task| task.until > now);
        }
        if tasks.len() >= MAX_TASKS {
            match room_among(&tasks, caller, unverified_from) {
                Some(soonest) => tasks.remove(&soonest),
                // Nothing it may take: not recorded, the task is nobody's.
                None => return,
            };
        }
        let unverified_from = unverified_from.map(str::to_owned);
        tasks.insert(id.to_owned(), Owned { callers: vec![caller.to_owned()], unverified_from, until });
    }

    /// Whether task `id` is `caller`'s, and still remembered.
    pub fn is_owned_by(&self, id: &str, caller: &str) -> bool {
        let now = self.clock.now();
        let mut tasks = self.tasks();
        match tasks.get(id) {
            Some(task) if task.until <= now => {
                tasks.remove(id);
                false
            }
            Some(task) => task.callers.iter().any(|c| c == caller),
            None => false,
        }
    }

    /// How many tasks are remembered.
    pub fn len(&self) -> usize {
        self.tasks().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The task that makes room for one more of `caller`'s (unverified from the address
/// `unverified_from`, if it is): of unverified callers' tasks if it is unverified or if there are
/// any, else of verified callers'; of those, the soonest to expire of whoever holds the most —
/// an address for unverified callers' (its made-up keys together), else the caller each was
/// created for — the adder counted with its new task where its own are among them. `None`:
/// nothing it may take (an unverified caller, and no unverified caller's task kept).
fn room_among(tasks: &HashMap<String, Owned>, caller: &str, unverified_from: Option<&str>) -> Option<String> {
    let unverified = unverified_from.is_some() || tasks.values().any(|task| task.unverified_from.is_some());
    let whose = |task| holder(task, unverified);
    let mut held: HashMap<&str, usize> = HashMap::new();
    for task in tasks.values() {
        if let Some(holder) = whose(task) {
            *held.entry(holder).or_default() += 1;
        }
    }
    let adder = if unverified { unverified_from } else { Some(caller) };
    if let Some(adder) = adder {
        *held.entry(adder).or_default() += 1;
    }
    let most = held.values().copied().max()?;
    tasks
        .iter()
        .filter(|(_, task)| whose(task).is_some_and(|h| held.get(h) == Some(&most)))
        .min_by_key(|(_, task)| task.until)
        .map(|(id, _)| id.clone())
}

/// Whose room `task` is — its address, among unverified callers' tasks (`unverified`), else the
/// caller it was created for — or `None` when it is not among those that make room.
fn holder(task: &Owned, unverified: bool) -> Option<&str> {
    match (&task.unverified_from, unverified) {
        (Some(address), true) => Some(address),
        (None, false) => task.callers.first().map(String::as_str),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    #[test]
    fn a_task_is_its_creators_until_its_ttl_and_never_anothers() {
        let clock = ManualClock::new();
        let owners = Owners::new(clock.clone());
        owners.record("t1", Some(60_000), "tok:a", None);
        assert!(owners.is_owned_by("t1", "tok:a"));
        assert!(!owners.is_owned_by("t1", "tok:b"), "another caller");
        assert!(!owners.is_owned_by("t2", "tok:a"), "a task nobody created here");
        owners.record("t1", Some(60_000), "tok:c", None);
        assert!(owners.is_owned_by("t1", "tok:c"), "an identical call's, handed to it too");
        assert!(!owners.is_owned_by("t1", "tok:b"), "still not another's");
        clock.advance(std::time::Duration::from_millis(59_999));
        assert!(owners.is_owned_by("t1", "tok:a"));
        clock.advance(std::time::Duration::from_millis(1));
        assert!(!owners.is_owned_by("t1", "tok:a"), "forgotten when its ttl has passed");
        assert!(owners.is_empty());
    }

    #[test]
    fn at_most_max_tasks_are_remembered_the_soonest_to_expire_making_room() {
        let clock = ManualClock::new();
        let owners = Owners::new(clock.clone());
        owners.record("short", Some(1_000), "tok:a", None);
        for i in 0..MAX_TASKS {
            owners.record(&format!("t{i}"), None, "tok:a", None);
        }
        assert_eq!(owners.len(), MAX_TASKS);
        assert!(!owners.is_owned_by("short", "tok:a"), "the soonest to expire made room");
        assert!(owners.is_owned_by("t0", "tok:a") && owners.is_owned_by(&format!("t{}", MAX_TASKS - 1), "tok:a"));
        owners.record("u", Some(u64::MAX), "tok:a", None);
        clock.advance(LONGEST.to_duration());
        assert!(!owners.is_owned_by("u", "tok:a"), "a ttl past a day is a day");
    }

    #[test]
    fn a_caller_flooding_the_record_with_long_tasks_forgets_its_own_never_anothers() {
        let clock = ManualClock::new();
        let owners = Owners::new(clock.clone());
        owners.record("theirs", Some(1_000), "tok:victim", None);
        for i in 0..(MAX_TASKS + 50) {
            owners.record(&format!("flood{i}"), None, "tok:attacker", None);
        }
        assert_eq!(owners.len(), MAX_TASKS);
        assert!(owners.is_owned_by("theirs", "tok:victim"), "the victim's short task is kept");
        let kept = (0..(MAX_TASKS + 50)).filter(|i| owners.is_owned_by(&format!("flood{i}"), "tok:attacker")).count();
        assert_eq!(kept, MAX_TASKS - 1, "the flood made room from itself");
    }

    /// The address of the `i`th of many made-up keys, each from an address of its own.
    fn address(i: usize) -> String {
        format!("ip:10.{}.{}.{}", i / 65_536, (i / 256) % 256, i % 256)
    }

    #[test]
    fn made_up_keys_filling_the_record_never_evict_a_configured_callers_task() {
        let clock = ManualClock::new();
        let owners = Owners::new(clock.clone());
        owners.record("theirs", Some(1_000), "tok:configured", None);
        for i in 0..(MAX_TASKS - 1) {
            owners.record(&format!("made-up{i}"), None, &format!("tok:made-up{i}"), Some(&address(i)));
        }
        assert_eq!(owners.len(), MAX_TASKS);
        // Everyone holds one, a tie, and the configured caller's task is the soonest to expire.
        owners.record("one-more", None, "tok:one-more", Some(&address(MAX_TASKS)));
        assert!(owners.is_owned_by("theirs", "tok:configured"), "the configured caller's task is kept");
        assert!(owners.is_owned_by("one-more", "tok:one-more"), "room made from a made-up key's");
        assert_eq!(owners.len(), MAX_TASKS);
    }

    #[test]
    fn a_made_up_keys_task_takes_room_only_from_made_up_keys_those_of_one_address_counted_together() {
        let clock = ManualClock::new();
        let owners = Owners::new(clock.clone());
        // Three made-up keys of one address, one task each (the first due soonest); one of another.
        for key in 0..3 {
            owners.record(&format!("a{key}"), Some(60_000 + key), &format!("tok:a{key}"), Some("ip:10.0.0.1"));
        }
        owners.record("b", Some(1_000), "tok:b", Some("ip:10.0.0.2"));
        for i in 0..(MAX_TASKS - 4) {
            owners.record(&format!("c{i}"), Some(1), "tok:configured", None);
        }
        assert_eq!(owners.len(), MAX_TASKS);
        owners.record("b-too", None, "tok:b-too", Some("ip:10.0.0.2"));
        assert!(!owners.is_owned_by("a0", "tok:a0"), "its address holds the most: its soonest went");
        assert!(owners.is_owned_by("a1", "tok:a1") && owners.is_owned_by("b", "tok:b"));
        assert!(owners.is_owned_by("b-too", "tok:b-too"));
        let kept = (0..(MAX_TASKS - 4)).filter(|i| owners.is_owned_by(&format!("c{i}"), "tok:configured")).count();
        assert_eq!(kept, MAX_TASKS - 4, "a configured caller's tasks, the soonest to expire of all, are kept");
    }

    #[test]
    fn a_made_up_keys_task_is_not_recorded_when_only_configured_callers_tasks_are_kept() {
        let clock = ManualClock::new();
        let owners = Owners::new(clock.clone());
        for i in 0..MAX_TASKS {
            owners.record(&format!("c{i}"), Some(1), &format!("tok:c{}", i % 7), None);
        }
        owners.record("made-up", None, "tok:made-up", Some("ip:10.0.0.1"));
        assert!(!owners.is_owned_by("made-up", "tok:made-up"), "not recorded: nobody's");
        assert_eq!(owners.len(), MAX_TASKS);
        assert!((0..MAX_TASKS).all(|i| owners.is_owned_by(&format!("c{i}"), &format!("tok:c{}", i % 7))));
    }

    #[test]
    fn a_configured_callers_task_takes_room_from_made_up_keys_first() {
        let clock = ManualClock::new();
        let owners = Owners::new(clock.clone());
        owners.record("made-up", None, "tok:made-up", Some("ip:10.0.0.1"));
        for i in 0..(MAX_TASKS - 1) {
            owners.record(&format!("c{i}"), Some(1), "tok:configured", None);
        }
        // It holds the most itself, and its tasks expire soonest: the made-up key's goes all the same.
        owners.record("one-more", Some(1), "tok:configured", None);
        assert!(!owners.is_owned_by("made-up", "tok:made-up"));
        assert!(owners.is_owned_by("one-more", "tok:configured") && owners.is_owned_by("c0", "tok:configured"));
        // None of theirs left: it makes room from the configured caller holding the most, itself.
        owners.record("two-more", Some(1), "tok:configured", None);
        assert!(owners.is_owned_by("two-more", "tok:configured"));
        assert_eq!(owners.len(), MAX_TASKS);
    }
}
