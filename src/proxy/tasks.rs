//! Whose each task is. The proxied server sees one client, the proxy, so it would answer
//! `tasks/get` and `tasks/cancel` for any task to anyone who names it; the proxy records the
//! caller each task was created for (a `CreateTaskResult` coming back from a proxied call) and
//! refuses every other caller as `serve` refuses another caller's job: "unknown task", without
//! saying whether it exists.
//!
//! The record is bounded: a task is forgotten when its `ttl` has passed on the server's clock (a
//! task without one, or with a longer one, after [`LONGEST`]), and at most [`MAX_TASKS`] are
//! kept. When they are all kept, the caller with the most tasks makes room (its task due to
//! expire soonest goes): a caller that floods the proxy with long-lived tasks forgets its own,
//! never another's. A forgotten task is nobody's: refused to all.

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
    /// each of them).
    pub fn record(&self, id: &str, ttl_ms: Option<u64>, caller: &str) {
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
        if tasks.len() >= MAX_TASKS
            && let Some(soonest) = room_among(&tasks, caller)
        {
            tasks.remove(&soonest);
        }
        tasks.insert(id.to_owned(), Owned { callers: vec![caller.to_owned()], until });
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

/// The task that makes room for one more of `caller`'s: the soonest to expire of whoever holds
/// the most (by the caller each was created for), `caller` counted with the one it is adding.
fn room_among(tasks: &HashMap<String, Owned>, caller: &str) -> Option<String> {
    let mut held: HashMap<&str, usize> = HashMap::new();
    for task in tasks.values() {
        if let Some(first) = task.callers.first() {
            *held.entry(first.as_str()).or_default() += 1;
        }
    }
    *held.entry(caller).or_default() += 1;
    let most = held.values().copied().max()?;
    let evicted: Vec<&str> = held.iter().filter(|(_, n)| **n == most).map(|(c, _)| *c).collect();
    tasks
        .iter()
        .filter(|(_, task)| task.callers.first().is_some_and(|c| evicted.contains(&c.as_str())))
        .min_by_key(|(_, task)| task.until)
        .map(|(id, _)| id.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    #[test]
    fn a_task_is_its_creators_until_its_ttl_and_never_anothers() {
        let clock = ManualClock::new();
        let owners = Owners::new(clock.clone());
        owners.record("t1", Some(60_000), "tok:a");
        assert!(owners.is_owned_by("t1", "tok:a"));
        assert!(!owners.is_owned_by("t1", "tok:b"), "another caller");
        assert!(!owners.is_owned_by("t2", "tok:a"), "a task nobody created here");
        owners.record("t1", Some(60_000), "tok:c");
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
        owners.record("short", Some(1_000), "tok:a");
        for i in 0..MAX_TASKS {
            owners.record(&format!("t{i}"), None, "tok:a");
        }
        assert_eq!(owners.len(), MAX_TASKS);
        assert!(!owners.is_owned_by("short", "tok:a"), "the soonest to expire made room");
        assert!(owners.is_owned_by("t0", "tok:a") && owners.is_owned_by(&format!("t{}", MAX_TASKS - 1), "tok:a"));
        owners.record("u", Some(u64::MAX), "tok:a");
        clock.advance(LONGEST.to_duration());
        assert!(!owners.is_owned_by("u", "tok:a"), "a ttl past a day is a day");
    }

    #[test]
    fn a_caller_flooding_the_record_with_long_tasks_forgets_its_own_never_anothers() {
        let clock = ManualClock::new();
        let owners = Owners::new(clock.clone());
        owners.record("theirs", Some(1_000), "tok:victim");
        for i in 0..(MAX_TASKS + 50) {
            owners.record(&format!("flood{i}"), None, "tok:attacker");
        }
        assert_eq!(owners.len(), MAX_TASKS);
        assert!(owners.is_owned_by("theirs", "tok:victim"), "the victim's short task is kept");
        let kept = (0..(MAX_TASKS + 50)).filter(|i| owners.is_owned_by(&format!("flood{i}"), "tok:attacker")).count();
        assert_eq!(kept, MAX_TASKS - 1, "the flood made room from itself");
    }
}
