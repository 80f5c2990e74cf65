//! Shedding under overload: when the server itself falls behind, the lowest priority is refused
//! first, with the wait, before anything is charged.
//!
//! **Behind is measured.** Every tool call's queueing delay is the time from when its request
//! arrived ([`Arrived`]: stamped as the HTTP request came in, or by a trusted proxy's
//! `X-Request-Start`) to when the guard takes it up. A burst makes some calls wait and is gone in
//! a moment; a server that cannot keep up makes *every* call wait. So, as CoDel judges a queue by
//! its standing delay, the server is behind when even the least delayed call of a whole interval
//! (`server.shedding.interval_ms`) waited longer than `target_ms`.
//!
//! **The lowest priority goes first.** Callers fall into classes by their tier's rank
//! (`[upstream.priority]`; a tier not named ranks 0), unverified callers below the verified ones
//! of the same rank. Each interval that ends behind refuses one more class, from the lowest; each
//! that ends on time (or with no call at all) gives one back. The highest class is never refused
//! here: the other limits hold it.
//!
//! **The wait is one to believe.** The shedding gives back one class at the end of an interval,
//! so a caller whose class is `k` below the lowest served one is refused for at least the rest of
//! this interval and `k - 1` more: that is the wait it is told.
//!
//! The decision takes one small lock and no store round trip; it is made before the call's
//! arguments are read, so a refused call costs the server as little as it can.

use std::sync::Mutex;

use crate::clock::Nanos;
use crate::config::LimitsConfig;
use crate::identity::Caller;

/// When a request arrived, on the guard's clock: put in the request's extensions by the HTTP
/// layer, read by the door into [`Call::arrived`](super::call::Call::arrived).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrived(pub Nanos);

/// A class of callers: their tier's rank, and whether they proved a key.
type Class = (i64, bool);

/// Where the server stands: the interval being measured and how many classes are refused.
#[derive(Debug, Default)]
struct Standing {
    /// When the interval being measured started.
    started: Nanos,
    /// The least queueing delay seen in it, if any call came.
    least: Option<Nanos>,
    /// The least delay of the last interval that ended (0 for one that saw no call).
    last_least: Nanos,
    /// How many of the lowest classes are refused.
    level: usize,
    /// Whether `started` was set by a first call.
    begun: bool,
}

/// Where the server stands, as `/metrics` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overload {
    /// The least queueing delay of the last interval that ended.
    pub least_delay: Nanos,
    /// How many of the lowest classes are refused now.
    pub level: usize,
}

/// The shedding of one server: its rules, and where the server stands.
#[derive(Debug)]
pub struct Shedder {
    target: Nanos,
    interval: Nanos,
    /// Tier → rank.
    ranks: std::collections::BTreeMap<String, i64>,
    /// Every class callers can be in, lowest first.
    classes: Vec<Class>,
    standing: Mutex<Standing>,
}

impl Shedder {
    /// The shedding `config` asks for (`None`: off): its classes are those its tiers and callers
    /// can be in (unverified ones only where a key is not required).
    pub fn configured(config: &LimitsConfig) -> Option<Self> {
        let shedding = &config.shedding;
        if !shedding.enabled {
            return None;
        }
        let rank = |tier: &str| shedding.ranks.get(tier).copied().unwrap_or(0);
        let mut classes: Vec<Class> = config.tiers.keys().map(|tier| (rank(tier), true)).collect();
        if !config.auth.required {
            classes.push((rank(&config.auth.anonymous_tier), false));
        }
        classes.sort_unstable();
        classes.dedup();
        Some(Self {
            target: shedding.target,
            interval: shedding.interval.max(Nanos::new(1)),
            ranks: shedding.ranks.clone(),
            classes,
            standing: Mutex::new(Standing::default()),
        })
    }

    fn class_of(&self, caller: &Caller) -> usize {
        let class = (self.ranks.get(caller.tier()).copied().unwrap_or(0), caller.unverified_from().is_none());
        self.classes.partition_point(|c| *c < class)
    }

    /// Takes the queueing delay of a call of `caller` that `arrived` (`None`: its door cannot
    /// tell) and was taken up `now`, and says whether it goes on: `None`, or refused, with how
    /// long at least before its class (among the lowest `level`) is served again.
    pub fn judge(&self, caller: &Caller, arrived: Option<Nanos>, now: Nanos) -> Option<Nanos> {
        let class = self.class_of(caller);
        let mut s = self.standing.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !s.begun {
            s.begun = true;
            s.started = now;
        }
        self.roll(&mut s, now);
        if let Some(arrived) = arrived {
            let delay = now - arrived;
            s.least = Some(s.least.map_or(delay, |least| least.min(delay)));
        }
        if class >= s.level {
            return None;
        }
        // One class comes back at the end of this interval, and one at the end of each after it.
        let behind = (s.level - class - 1) as u64;
        let left = s.started + self.interval - now;
        Some((left + self.interval * behind).max(Nanos::new(1)))
    }

    /// Ends the intervals that are over at `now`: the first by its least delay, the others (no
    /// call came in them) as on time.
    fn roll(&self, s: &mut Standing, now: Nanos) {
        let elapsed = (now - s.started) / self.interval;
        if elapsed == 0 {
            return;
        }
        let most = self.classes.len().saturating_sub(1);
        let least = s.least.take();
        s.level = match least {
            Some(least) if least > self.target => (s.level + 1).min(most),
            _ => s.level.saturating_sub(1),
        };
        s.last_least = if elapsed == 1 { least.unwrap_or(Nanos::ZERO) } else { Nanos::ZERO };
        let quiet = usize::try_from(elapsed - 1).unwrap_or(usize::MAX);
        s.level = s.level.saturating_sub(quiet);
        s.started += self.interval * elapsed;
    }

    /// Where the server stands at `now`.
    pub fn overload(&self, now: Nanos) -> Overload {
        let mut s = self.standing.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if s.begun {
            self.roll(&mut s, now);
        }
        Overload { least_delay: s.last_least, level: s.level }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Catalogue, LimitsConfig};
    use crate::identity::{Identifier, Identity};

    const MS: Nanos = Nanos::from_millis(1);

    /// A shedder of target 100 ms and interval 1 s, with `pro` ranked 1 and `guest` -1; callers
    /// of each tier, and an unverified one (of the default tier, rank 0).
    fn setup(extra: &str) -> (Shedder, [Caller; 4]) {
        let toml = format!(
            "[tools.search]\ncost = 1\n[upstream.priority]\npro = 1\nguest = -1\n[tiers]\npro = 2.0\n\
             [[auth.keys]]\nkey = \"p\"\ntier = \"pro\"\n[[auth.keys]]\nkey = \"d\"\n\
             [[auth.keys]]\nkey = \"g\"\ntier = \"guest\"\n{extra}"
        );
        let config = LimitsConfig::from_toml(&toml, &Catalogue::new().tool("search")).expect("config");
        let identifier = Identifier::new(&config);
        let named = |key: Option<&str>| {
            let mut headers = http::HeaderMap::new();
            if let Some(key) = key {
                headers.insert("x-api-key", key.parse().expect("header"));
            }
            identifier
                .identify(&headers, Some("10.0.0.1".parse().expect("ip")))
                .map(Identity::without_verifying)
                .expect("caller")
        };
        let shedder = Shedder::configured(&config).expect("on");
        (shedder, [named(Some("g")), named(None), named(Some("d")), named(Some("p"))])
    }

    fn goes(shedder: &Shedder, caller: &Caller, delay: Nanos, now: Nanos) -> bool {
        shedder.judge(caller, Some(now - delay), now).is_none()
    }

    #[test]
    fn classes_run_guest_then_unverified_then_the_verified_of_rank_zero_then_pro() {
        let (shedder, [guest, unverified, plain, pro]) = setup("");
        let classes: Vec<usize> = [&guest, &unverified, &plain, &pro].iter().map(|c| shedder.class_of(c)).collect();
        assert_eq!(classes, [0, 1, 2, 3]);
        assert_eq!(shedder.classes, [(-1, true), (0, false), (0, true), (1, true)]);
    }

    #[test]
    fn a_burst_that_leaves_one_call_on_time_in_an_interval_sheds_nobody() {
        let (shedder, [guest, ..]) = setup("");
        let mut now = 10_000 * MS;
        for _ in 0..5 {
            for delay in [900 * MS, 700 * MS, 40 * MS, 800 * MS] {
                assert!(goes(&shedder, &guest, delay, now));
                now += 200 * MS;
            }
            now += 200 * MS;
        }
        assert_eq!(shedder.overload(now).level, 0);
    }

    #[test]
    fn each_interval_behind_refuses_one_more_class_from_the_lowest_and_never_the_highest() {
        let (shedder, callers) = setup("");
        let mut now = 10_000 * MS;
        // Every call waits 300 ms, interval after interval.
        let mut refused_after = Vec::new();
        for interval in 0..6 {
            let refused: Vec<bool> = callers.iter().map(|c| !goes(&shedder, c, 300 * MS, now)).collect();
            refused_after.push((interval, refused));
            now += 1000 * MS;
        }
        let expected = [
            [false, false, false, false],
            [true, false, false, false],
            [true, true, false, false],
            [true, true, true, false],
            [true, true, true, false],
            [true, true, true, false],
        ];
        for ((interval, refused), expected) in refused_after.iter().zip(expected) {
            assert_eq!(refused, &expected, "interval {interval}");
        }
        let overload = shedder.overload(now - Nanos::new(1));
        assert_eq!((overload.level, overload.least_delay), (3, 300 * MS));
    }

    #[test]
    fn the_wait_told_is_never_shorter_than_the_shedding_lasts_and_is_exact_when_the_delay_goes() {
        let (shedder, [guest, unverified, plain, _]) = setup("");
        let mut now = 10_000 * MS;
        for _ in 0..3 {
            shedder.judge(&plain, Some(now - 500 * MS), now);
            now += 1000 * MS;
        }
        // Level 3 from 13 s: guest is 3 classes below, unverified 2, plain 1.
        now += 250 * MS;
        let wait = |c: &Caller, now: Nanos| shedder.judge(c, Some(now), now).unwrap_or(Nanos::ZERO);
        assert_eq!(wait(&plain, now), 750 * MS);
        assert_eq!(wait(&unverified, now), 1750 * MS);
        assert_eq!(wait(&guest, now), 2750 * MS);
        // Calls keep coming on time: each is served once its wait is over, not a moment before.
        for (caller, told) in [(&plain, 750 * MS), (&unverified, 1750 * MS), (&guest, 2750 * MS)] {
            let mut at = now + Nanos::new(1);
            while at < now + told {
                assert_ne!(wait(caller, at), Nanos::ZERO, "served early at {at:?}");
                at += 100 * MS;
            }
            assert_eq!(wait(caller, now + told), Nanos::ZERO, "served when told");
        }
    }

    #[test]
    fn quiet_intervals_give_back_one_class_each() {
        let (shedder, [guest, ..]) = setup("");
        let mut now = 10_000 * MS;
        for _ in 0..4 {
            shedder.judge(&guest, Some(now - 500 * MS), now);
            now += 1000 * MS;
        }
        assert_eq!(shedder.overload(now).level, 3);
        assert_eq!(shedder.overload(now + 2000 * MS).level, 1, "two quiet intervals later");
        assert_eq!(shedder.overload(now + 9000 * MS).level, 0);
    }

    #[test]
    fn a_call_whose_door_cannot_tell_when_it_arrived_is_judged_but_adds_no_delay() {
        let (shedder, [guest, ..]) = setup("");
        let mut now = 10_000 * MS;
        for _ in 0..3 {
            assert_eq!(shedder.judge(&guest, None, now), None);
            now += 1000 * MS;
        }
        // An arrival stamped after the call was taken up is no delay (a clock a proxy set ahead).
        assert_eq!(shedder.judge(&guest, Some(now + 5000 * MS), now), None);
        assert_eq!(shedder.overload(now + 1000 * MS).least_delay, Nanos::ZERO);
    }

    #[test]
    fn shedding_is_off_when_disabled_and_its_keys_are_checked() {
        let tools = Catalogue::new().tool("search");
        let off = LimitsConfig::from_toml("[tools.search]\ncost = 1\n[server.shedding]\nenabled = false\n", &tools)
            .expect("config");
        assert!(Shedder::configured(&off).is_none());
        for bad in ["target_ms = 0", "interval_ms = 0", "interval_ms = 60001", "target_ms = 100000"] {
            let err = LimitsConfig::from_toml(&format!("[tools.search]\ncost = 1\n[server.shedding]\n{bad}\n"), &tools)
                .expect_err(bad);
            assert!(err.to_string().contains("server.shedding."), "{err}");
        }
        let unknown = LimitsConfig::from_toml("[tools.search]\ncost = 1\n[server.shedding]\ntarget = 5\n", &tools)
            .expect_err("unknown key");
        assert!(unknown.to_string().contains("target"), "{unknown}");
    }

    #[test]
    fn with_a_key_required_there_is_no_unverified_class() {
        let toml = "[tools.search]\ncost = 1\n[upstream.priority]\npro = 1\nguest = -1\n[tiers]\npro = 2.0\n\
                    [auth]\nrequired = true\n[[auth.keys]]\nkey = \"p\"\ntier = \"pro\"\n";
        let config = LimitsConfig::from_toml(toml, &Catalogue::new().tool("search")).expect("config");
        let shedder = Shedder::configured(&config).expect("on");
        assert_eq!(shedder.classes, [(-1, true), (0, true), (1, true)]);
    }
}
