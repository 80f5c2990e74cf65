//! Every algorithm against a simple reference model, in memory: the algorithm suite
//! (`common/algorithm_suite.rs`, reference models that share no code with what they check) on
//! the Rust algorithms with a local state, as the memory store keeps it, on a clock that steps
//! in nanoseconds. `tests/limits/algorithms_redis.rs` runs the same suite on the Redis store.

use crate::algorithm_suite;
use crate::algorithm_suite::{Backend, Key};
use mcp_ratelimit::clock::Nanos;
use mcp_ratelimit::limit::{Adjustment, Decision, Limiter, LimiterState, Taken};

/// The state in this process: forking clones it.
struct Memory;

/// A limiter and the state one key has under it.
#[derive(Clone)]
struct MemoryKey {
    limiter: Limiter,
    state: LimiterState,
}

impl Backend for Memory {
    type Key = MemoryKey;

    fn longest_span(&self) -> u64 {
        mcp_ratelimit::limit::params::LONGEST_SPAN.as_u64()
    }

    fn resolution(&self) -> u64 {
        1
    }

    fn start(&self, limiter: &Limiter, now: u64) -> MemoryKey {
        MemoryKey { limiter: limiter.clone(), state: limiter.fresh(Nanos::new(now)) }
    }
}

impl Key for MemoryKey {
    type State = LimiterState;

    fn acquire(&mut self, now: u64, cost: u64) -> Decision {
        self.limiter.acquire(&mut self.state, Nanos::new(now), cost)
    }

    fn fork(&self) -> Self {
        self.clone()
    }

    fn release(&mut self, cost: u64) {
        self.limiter.release(&mut self.state, cost);
    }

    fn give_back(&mut self, now: u64, units: u64, taken: Taken) {
        self.limiter.adjust(&mut self.state, Nanos::new(now), Adjustment::Return { units, taken });
    }

    fn relimit(&mut self, limiter: &Limiter) {
        self.limiter = limiter.clone();
    }

    fn state(&self) -> LimiterState {
        self.state.clone()
    }
}

#[test]
fn token_bucket_matches_the_replay_model() {
    algorithm_suite::token_bucket_matches_the_replay_model(&Memory, 300);
}

#[test]
fn gcra_and_leaky_bucket_decide_exactly_like_the_token_bucket() {
    algorithm_suite::gcra_and_leaky_bucket_decide_exactly_like_the_token_bucket(&Memory, 300);
}

#[test]
fn fixed_window_matches_a_count_per_window() {
    algorithm_suite::fixed_window_matches_a_count_per_window(&Memory, 300);
}

#[test]
fn sliding_log_matches_the_full_history() {
    algorithm_suite::sliding_log_matches_the_full_history(&Memory, 300);
}

#[test]
fn sliding_window_matches_the_weighted_estimate() {
    algorithm_suite::sliding_window_matches_the_weighted_estimate(&Memory, 300);
}

#[test]
fn refusals_never_charge() {
    algorithm_suite::refusals_never_charge(&Memory, 300);
}

#[test]
fn retry_after_is_exact() {
    algorithm_suite::retry_after_is_exact(&Memory, 300);
}

#[test]
fn concurrency_counts_slots_exactly() {
    algorithm_suite::concurrency_counts_slots_exactly(&Memory, 300);
}

#[test]
fn fixed_window_lets_twice_the_limit_through_across_an_edge() {
    algorithm_suite::fixed_window_lets_twice_the_limit_through_across_an_edge(&Memory);
}

#[test]
fn sliding_log_never_lets_more_than_the_limit_through_an_edge() {
    algorithm_suite::sliding_log_never_lets_more_than_the_limit_through_an_edge(&Memory);
}

#[test]
fn sliding_window_stays_within_its_documented_error_at_an_edge() {
    algorithm_suite::sliding_window_stays_within_its_documented_error_at_an_edge(&Memory);
}

#[test]
fn sliding_window_never_exceeds_twice_the_limit_in_any_window() {
    algorithm_suite::sliding_window_never_exceeds_twice_the_limit_in_any_window(&Memory, 200);
}

#[test]
fn changed_limits_keep_every_number_believable() {
    algorithm_suite::changed_limits_keep_every_number_believable(&Memory, 1_000);
}

#[test]
fn every_rate_is_decided_exactly_or_refused_naming_its_key() {
    algorithm_suite::every_rate_is_decided_exactly_or_refused_naming_its_key(&Memory, 300);
}

#[test]
fn late_refunds_go_back_only_where_they_were_taken() {
    algorithm_suite::late_refunds_go_back_only_where_they_were_taken(&Memory, 1_000);
}

#[test]
fn every_registered_algorithm_has_a_reference_model() {
    algorithm_suite::every_registered_algorithm_has_a_reference_model();
}
