//! What the queue shows of itself: where a waiting job stands, when a class may submit again, and
//! what it holds (for `rate_limit_status`, `/metrics` and the dashboard).

use super::round_robin::Waiting;
use super::{FairQueue, Occupancy, Position, Standing, TierOccupancy};
use crate::clock::Nanos;
use crate::upstream::classes::ClassId;

impl FairQueue {
    /// Where `id` stands, if it is waiting.
    pub fn position(&self, id: &str) -> Option<Position> {
        let rules = self.rules_now();
        let state = self.state();
        let (flow_key, index) =
            state.flows.iter().find_map(|(key, f)| f.jobs.iter().position(|w| w.id == id).map(|i| (key.clone(), i)))?;
        // Who goes first (see `State::pick`): a tier still owed reserved slots, then the highest
        // rank. A flow that goes before ours serves all its jobs first; one alike, as the round
        // robin stands: up to `index + 1` jobs if it is ahead of ours in the ring, `index` if
        // behind; one after ours, none.
        let precedence = |s: Standing| (state.owed_a_slot(s, &rules), s.rank);
        let ring_at = state.ring.iter().position(|k| *k == flow_key).unwrap_or(0);
        let mine = state.flows.get(&flow_key);
        let mut ahead = index;
        let me = mine.and_then(|f| f.jobs.get(index));
        let (class, standing) = (me.map(|w| w.class), me.map_or(Standing::PLAIN, |w| w.standing));
        let alike = |w: &Waiting| Some(w.class) == class;
        let mut alike_ahead = mine.map_or(0, |f| f.jobs.iter().take(index).filter(|w| alike(w)).count());
        for (i, key) in state.ring.iter().enumerate().filter(|(_, k)| **k != flow_key) {
            if let Some(flow) = state.flows.get(key) {
                let theirs = flow.jobs.front().map_or(Standing::PLAIN, |w| w.standing);
                let take = match precedence(theirs).cmp(&precedence(standing)) {
                    std::cmp::Ordering::Greater => flow.jobs.len(),
                    std::cmp::Ordering::Equal if i < ring_at => index + 1,
                    std::cmp::Ordering::Equal => index,
                    std::cmp::Ordering::Less => 0,
                };
                let served: Vec<&Waiting> = flow.jobs.iter().take(take).collect();
                ahead = ahead.saturating_add(served.len());
                alike_ahead = alike_ahead.saturating_add(served.iter().filter(|w| alike(w)).count());
            }
        }
        // Over a shared line, how many go before it on every instance, as the line last said.
        let ahead = me.and_then(|w| w.ahead).unwrap_or(ahead);
        Some(Position { ahead, alike_ahead: alike_ahead.min(ahead) })
    }

    /// When the next job of `class` may be submitted, if its gap is running.
    pub fn next_at(&self, class: ClassId) -> Nanos {
        self.state().of_class(class).next_at
    }

    /// How long until every class with jobs waiting may submit again: the longest gap still
    /// running among them (0 when none is).
    pub fn gaps_left(&self, now: Nanos) -> Nanos {
        let state = self.state();
        let waiting = state.waiting_per_class();
        let per_class = state.classes.iter().zip(waiting);
        per_class.filter(|(_, waiting)| *waiting > 0).map(|(of, _)| of.next_at - now).max().unwrap_or(Nanos::ZERO)
    }

    /// What the queue holds now.
    pub fn occupancy(&self) -> Occupancy {
        let rules = self.rules_now();
        let state = self.state();
        let per_tier = rules
            .tiers
            .iter()
            .enumerate()
            .map(|(i, tier)| TierOccupancy {
                tier: tier.name.clone(),
                rank: tier.rank,
                reserved_slots: rules.reserved_slots(i),
                reserved_places: rules.reserved_places(i),
                in_flight: state.in_flight_of(i),
                waiting: state.waiting_of_tier(i),
            })
            .collect();
        let mut per_flow: Vec<(String, usize)> = state.flows.iter().map(|(k, f)| (k.clone(), f.jobs.len())).collect();
        per_flow.sort();
        Occupancy {
            in_flight: state.in_flight,
            waiting: state.waiting(None),
            waiting_per_class: state.waiting_per_class(),
            per_flow,
            unverified_in_flight: state.unverified_in_flight,
            unverified_waiting: state.unverified_waiting(),
            per_tier,
        }
    }
}
