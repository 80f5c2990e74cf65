//! The slices' own unit tests, on a manual clock: how big, how long, how many at once.

use std::sync::Arc;

use mcp_ratelimit_kernel::clock::{Clock, ManualClock};
use mcp_ratelimit_kernel::limit::{FixedWindow, TokenBucket};

use super::*;

const LASTS: Duration = Duration::from_secs(10);

fn slices() -> (Slices, Arc<ManualClock>) {
    let clock = ManualClock::new();
    (Slices::new(SliceRules { most: 64, lasts: LASTS }, clock.clone()), clock)
}

fn decision(allowed: bool, limit: u64, remaining: u64, at: Nanos) -> Decision {
    Decision { allowed, limit, remaining, retry_after: Nanos::ZERO, reset_after: Nanos::from_secs(1), at }
}

/// Redis's answer to one call of `check` with a top-up of `want` it grants (remaining `left`
/// after both), at `at` on Redis's clock.
fn granted(slices: &Slices, check: Check<'_>, want: u64, left: u64, at: Nanos) -> Vec<(String, u64)> {
    let now = slices.clock().now();
    let mut decisions = [decision(true, check.limiter.capacity(), left + want, at)];
    let top_ups = [decision(true, check.limiter.capacity(), left, at)];
    slices.took(&[check], &[want], &mut decisions, &top_ups, now).0
}

#[test]
fn a_bucket_slice_is_spent_only_until_the_bucket_would_be_full_again() {
    let (slices, clock) = slices();
    // 100 units, one back every 100 ms; 60 left beside a slice of 20: the bucket, had the
    // slice stayed, holds 80 (and less than one more) and is full after 19 periods, 1.9 s.
    let limiter = Limiter::TokenBucket(TokenBucket::new(100, 10.0));
    let check = Check { key: "k", limiter: &limiter, cost: 1, shadow: false };
    assert_eq!(granted(&slices, check, 20, 60, Nanos::ZERO).len(), 1);
    assert!(slices.spend(&[check], clock.now()).is_some(), "spent from at once");
    clock.advance(Duration::from_millis(1_899));
    assert!(slices.spend(&[check], clock.now()).is_some(), "until just before");
    clock.advance(Duration::from_millis(1));
    assert!(slices.spend(&[check], clock.now()).is_none(), "never once the bucket could be full");
}

#[test]
fn a_window_slice_is_spent_only_in_the_window_it_was_counted_in() {
    let (slices, clock) = slices();
    let limiter = Limiter::FixedWindow(FixedWindow::new(1_000, Nanos::from_secs(60)));
    let check = Check { key: "w", limiter: &limiter, cost: 1, shadow: false };
    // Counted 59.5 s into a minute's window: spendable half a second.
    granted(&slices, check, 30, 500, Nanos::from_millis(59_500));
    clock.advance(Duration::from_millis(499));
    assert!(slices.spend(&[check], clock.now()).is_some());
    clock.advance(Duration::from_millis(1));
    assert!(slices.spend(&[check], clock.now()).is_none(), "the window it was counted in is over");
}

#[test]
fn a_slice_is_spent_only_under_the_limiter_it_was_cut_under_and_to_the_unit() {
    let (slices, clock) = slices();
    let limiter = Limiter::FixedWindow(FixedWindow::new(1_000, Nanos::from_secs(3_600)));
    let lowered = Limiter::FixedWindow(FixedWindow::new(10, Nanos::from_secs(3_600)));
    let check = Check { key: "w", limiter: &limiter, cost: 3, shadow: false };
    granted(&slices, check, 10, 900, Nanos::ZERO);
    assert!(slices.spend(&[Check { limiter: &lowered, ..check }], clock.now()).is_none(), "another limiter");
    let spent: Vec<u64> =
        (0..3).filter_map(|_| slices.spend(&[check], clock.now())).map(|(d, _)| d[0].remaining).collect();
    assert_eq!(spent, [907, 904, 901], "what Redis holds and what is left here");
    assert!(slices.spend(&[check], clock.now()).is_none(), "one unit left: not enough for a call of 3");
    assert_eq!(slices.held(), (1, 1));
}

#[test]
fn a_refusal_gives_every_slice_of_its_key_back_and_asks_for_none_after_it() {
    let (slices, clock) = slices();
    let limiter = Limiter::FixedWindow(FixedWindow::new(1_000, Nanos::from_secs(3_600)));
    let check = Check { key: "w", limiter: &limiter, cost: 50, shadow: false };
    granted(&slices, check, 40, 400, Nanos::ZERO);
    let mut refused = [decision(false, 1_000, 10, Nanos::ZERO)];
    let (taken, back) = slices.took(&[check], &[0], &mut refused, &[], clock.now());
    assert!(taken.is_empty());
    assert_eq!(back.iter().map(|(_, _, units, _)| *units).collect::<Vec<_>>(), [40]);
    assert_eq!(slices.held(), (0, 0));
    assert_eq!(slices.wants(&[check], clock.now()).wants, [0], "nearly empty: exact decisions");
}

#[test]
fn a_key_never_holds_more_than_a_slices_worth_however_often_another_key_runs_short() {
    let (slices, clock) = slices();
    let limiter = Limiter::FixedWindow(FixedWindow::new(1_000_000, Nanos::from_secs(3_600)));
    let a = Check { key: "a", limiter: &limiter, cost: 1, shadow: false };
    let b = Check { key: "b", cost: 2, ..a };
    granted(&slices, a, 1, 999_000, Nanos::ZERO);
    granted(&slices, b, 2, 999_000, Nanos::ZERO);
    for _ in 0..20 {
        // b, spent twice as fast, runs short first: the call goes to Redis and asks a top-up
        // of both, while a still holds half of its own.
        let both = [a, b];
        while slices.spend(&both, clock.now()).is_some() {}
        let asking = slices.wants(&both, clock.now());
        let wants = &asking.wants;
        let now = clock.now();
        let mut decisions = [decision(true, 1_000_000, 990_000, Nanos::ZERO); 2];
        let top_ups: Vec<Decision> =
            wants.iter().filter(|w| **w > 0).map(|_| decision(true, 1_000_000, 990_000, Nanos::ZERO)).collect();
        slices.took(&[a, b], wants, &mut decisions, &top_ups, now);
        let keys = slices.keys();
        assert!(keys.values().all(|held| held.live(now) <= 64), "a key holds at most a slice's worth");
    }
}

#[test]
fn calls_of_one_key_in_flight_at_once_ask_for_one_slice_between_them() {
    let (slices, clock) = slices();
    let limiter = Limiter::FixedWindow(FixedWindow::new(1_000_000, Nanos::from_secs(3_600)));
    let a = Check { key: "a", limiter: &limiter, cost: 1, shadow: false };
    granted(&slices, a, 1, 999_000, Nanos::ZERO);
    granted(&slices, a, 32, 999_000, Nanos::ZERO);
    let now = clock.now();
    // Eight calls in flight at once: the first asks for the room there is, the others for
    // nothing while its answer is awaited (none a top-up to send back: on a bucket charged
    // since, what goes back is lost).
    let one = [a];
    let asked: Vec<Asking<'_, '_>> = (0..8).map(|_| slices.wants(&one, now)).collect();
    let wants: Vec<u64> = asked.iter().map(|asking| asking.wants[0]).collect();
    assert_eq!(wants, [31, 0, 0, 0, 0, 0, 0, 0], "one slice between them, within the most");
    let mut back = 0;
    for asking in &asked {
        let mut decisions = [decision(true, 1_000_000, 990_000, Nanos::ZERO)];
        let top_up: Vec<Decision> =
            asking.wants.iter().filter(|w| **w > 0).map(|_| decision(true, 1_000_000, 990_000, Nanos::ZERO)).collect();
        let (_, given) = slices.took(&[a], &asking.wants, &mut decisions, &top_up, now);
        back += given.iter().map(|(_, _, units, _)| units).sum::<u64>();
    }
    drop(asked);
    assert_eq!((slices.held_of("a", &limiter), back), (64, 0), "a slice's worth held, nothing sent back");
    // A call that asked and failed (its answer never came) leaves the room as it was.
    while slices.spend(&[a], now).is_some() {}
    drop(slices.wants(&[a], now));
    assert!(slices.wants(&[a], now).wants[0] > 0, "the room an unanswered top-up took is free again");
}

#[test]
fn the_keys_remembered_are_bounded_however_many_callers_arrive() {
    let (slices, clock) = slices();
    let limiter = Limiter::FixedWindow(FixedWindow::new(1_000, Nanos::from_secs(3_600)));
    for n in 0..KEYS_KEPT + 10 {
        let key = format!("invented:{n}");
        let check = Check { key: &key, limiter: &limiter, cost: 1, shadow: false };
        let mut decided = [decision(true, 1_000, 999, Nanos::ZERO)];
        slices.took(&[check], &[0], &mut decided, &[], clock.now());
        assert_eq!(decided[0].remaining, 999, "a key beyond the bound is decided as Redis said");
    }
    assert_eq!(slices.keys().len(), KEYS_KEPT);
}

#[test]
fn a_quiet_keys_slice_goes_back_after_a_quarter_of_its_life() {
    let (slices, clock) = slices();
    let limiter = Limiter::FixedWindow(FixedWindow::new(1_000, Nanos::from_secs(3_600)));
    let check = Check { key: "w", limiter: &limiter, cost: 1, shadow: false };
    let taken = granted(&slices, check, 16, 800, Nanos::ZERO);
    let [(key, id)] = &taken[..] else { panic!("one slice") };
    let (key, id) = (key.as_str(), *id);
    let Due::Wait(at) = slices.due(key, id, clock.now()) else { panic!("not due at once") };
    assert_eq!(at, clock.now() + Nanos::from(LASTS / 4), "looked at again when the key has been quiet");
    clock.advance(LASTS / 4);
    let Due::Back((_, _, units, _)) = slices.due(key, id, clock.now()) else { panic!("due") };
    assert_eq!(units, 16);
    assert!(matches!(slices.due(key, id, clock.now()), Due::Gone));
}
/// Redis's answer to `check` decided there with no top-up: admitted, `left` remaining.
fn decided_in_redis(slices: &Slices, check: Check<'_>, left: u64) {
    let mut decisions = [decision(true, check.limiter.capacity(), left, Nanos::ZERO)];
    slices.took(&[check], &[0], &mut decisions, &[], slices.clock().now());
}

#[test]
fn a_slice_is_sized_to_what_its_key_spends_here_before_it_would_go_back() {
    let (slices, clock) = slices();
    let limiter = Limiter::FixedWindow(FixedWindow::new(100_000, Nanos::from_secs(3_600)));
    // A key called every 3 s, a slice's life 10 s: less than one call comes in the 2.5 s of
    // quiet that sends a slice back, so none is asked for: each call is decided in Redis.
    let slow = Check { key: "slow", limiter: &limiter, cost: 1, shadow: false };
    for _ in 0..5 {
        decided_in_redis(&slices, slow, 90_000);
        clock.advance(Duration::from_secs(3));
        assert_eq!(slices.wants(&[slow], clock.now()).wants, [0], "a slow key holds nothing");
    }
    // A key called every 100 ms: about 25 calls in a quarter of a slice's life, so its slices
    // double to that and no further, however long it keeps the pace.
    let steady = Check { key: "steady", limiter: &limiter, cost: 1, shadow: false };
    decided_in_redis(&slices, steady, 90_000);
    let mut sizes = Vec::new();
    for _ in 0..200 {
        clock.advance(Duration::from_millis(100));
        if slices.spend(&[steady], clock.now()).is_none() {
            let [want] = slices.wants(&[steady], clock.now()).wants[..] else { panic!("one check") };
            granted(&slices, steady, want, 90_000, clock.now());
            sizes.push(want);
        }
    }
    assert_eq!(sizes[..4], [1, 2, 4, 8], "doubling while its demand is above: {sizes:?}");
    assert!(sizes.iter().all(|want| (1..=25).contains(want)), "never past the demand: {sizes:?}");
    assert!(sizes.iter().rev().take(5).all(|want| *want >= 16), "and at about it: {sizes:?}");
    // Calls at one instant, as under load: the slice grows to the most.
    let hot = Check { key: "hot", limiter: &limiter, cost: 1, shadow: false };
    decided_in_redis(&slices, hot, 90_000);
    let mut want = 0;
    for _ in 0..200 {
        if slices.spend(&[hot], clock.now()).is_none() {
            want = slices.wants(&[hot], clock.now()).wants[0];
            granted(&slices, hot, want, 90_000, clock.now());
        }
    }
    assert_eq!(want, 64, "a key spent at one instant is limited by the most alone");
}

#[test]
fn a_check_allowed_in_a_call_refused_elsewhere_is_no_reading_of_its_key() {
    let (slices, clock) = slices();
    // 100 units, one back every 100 ms; a slice of 20 taken, Redis's reading 1 s from full.
    let limiter = Limiter::TokenBucket(TokenBucket::new(100, 10.0));
    let other = Limiter::TokenBucket(TokenBucket::new(10, 1.0));
    let check = Check { key: "k", limiter: &limiter, cost: 5, shadow: false };
    granted(&slices, check, 20, 60, Nanos::ZERO);
    // A call of k and j: k would have been charged (its answer says the level that would have
    // left, 0.5 s further from full), j refused it, so nothing was written.
    let checks = [check, Check { key: "j", limiter: &other, cost: 1, shadow: false }];
    let would = Decision { reset_after: Nanos::from_millis(1_500), ..decision(true, 100, 55, Nanos::ZERO) };
    let mut answered = [would, decision(false, 10, 0, Nanos::ZERO)];
    slices.took(&checks, &[0, 0], &mut answered, &[], clock.now());
    // A call spent from the slice is settled by the key's reading: the real one, not the level a
    // charge never made would have left (which would give a refund more than its units owe).
    let (spent, _) = slices.spend(&[check], clock.now()).expect("the slice holds 20");
    assert_eq!(spent[0].reset_after, Nanos::from_secs(1), "the last reading Redis wrote");
    assert_eq!(spent[0].remaining, 60 + 15, "what Redis holds and what is left here");
}

#[test]
fn a_check_allowed_in_a_call_refused_elsewhere_adds_nothing_to_its_keys_demand() {
    let (slices, clock) = slices();
    let limiter = Limiter::FixedWindow(FixedWindow::new(100_000, Nanos::from_secs(60)));
    let other = Limiter::TokenBucket(TokenBucket::new(10, 1.0));
    let one = Check { key: "k", limiter: &limiter, cost: 1, shadow: false };
    slices.took(&[one], &[0], &mut [decision(true, 100_000, 90_000, Nanos::ZERO)], &[], clock.now());
    clock.advance(Duration::from_secs(1));
    // Fifty calls of k, four units each, and of j: k would have been charged, j refused them all.
    let four = Check { cost: 4, ..one };
    let checks = [four, Check { key: "j", limiter: &other, cost: 1, shadow: false }];
    for _ in 0..50 {
        let mut answered = [decision(true, 100_000, 89_996, Nanos::ZERO), decision(false, 10, 0, Nanos::ZERO)];
        slices.took(&checks, &[0, 0], &mut answered, &[], clock.now());
    }
    // k was spent one unit in a second: at that pace a slice of four would go back about unspent
    // (counting the refused calls, 201 units, it was cut).
    assert_eq!(slices.wants(&[four], clock.now()).wants[0], 0, "a slice cut for calls never admitted");
}
