//! What a tier is owed in the queue: a reserved share of the account's slots and places
//! (`[upstream.reserved]`) and a rank when the account is full (`[upstream.priority]`), and where
//! one job stands by them ([`Standing`]).
//!
//! **Places are reserved outright.** A place is held for as long as its job waits, which no
//! clock bounds, so a caller of another tier may never take a place that would leave a reserved
//! tier fewer free places than it is still owed: free-tier callers flooding the queue leave the
//! pro tier's places empty for it.
//!
//! **Slots are lent, for one job at most.** Keeping a reserved slot empty while nobody of its tier
//! waits would idle capacity the account pays for, so any job may take a free slot; but when a
//! slot frees, a waiting job of a tier below its reserved slots goes first, before any rank. A
//! lent slot therefore comes back to its tier when the job that borrowed it ends: a pro caller
//! waits one job's length at most, however many free-tier jobs wait.
//!
//! **Ranks order the rest.** When no tier is owed a slot, the waiting jobs of the highest rank go
//! first (round robin among their flows); a tier no rank names ranks 0.
//!
//! An unverified caller (no configured key, or a made-up one) proves no tier, so its jobs never
//! draw on a reservation; they rank as the anonymous tier (`auth.anonymous_tier`) does.

/// One tier's standing in the queue.
#[derive(Debug, Clone, PartialEq)]
pub struct TierRule {
    /// The tier's name, as `[tiers]` has it.
    pub name: String,
    /// The share (0 to 1) of the account's slots and of the queue's places it may always count
    /// on.
    pub reserved: f64,
    /// Its rank when the account is full: higher goes first.
    pub rank: i64,
}

impl TierRule {
    /// The tiers `[upstream.reserved]` and `[upstream.priority]` name, each once, by name.
    pub fn from_config(up: &crate::config::UpstreamConfig) -> Vec<TierRule> {
        let mut names: Vec<&String> = up.reserved.keys().chain(up.priority.keys()).collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|name| TierRule {
                name: name.clone(),
                reserved: up.reserved.get(name).copied().unwrap_or(0.0),
                rank: up.priority.get(name).copied().unwrap_or(0),
            })
            .collect()
    }

    /// Its share of `whole` (slots or places), rounded down: a share never grants what it does
    /// not cover.
    pub fn share_of(&self, whole: usize) -> usize {
        if self.reserved >= 1.0 { whole } else { (whole as f64 * self.reserved.max(0.0)).floor() as usize }
    }
}

/// Where a job stands in the queue beside its flow: held to the unverified callers' share, the
/// tier whose reservation it draws on, and its rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Standing {
    /// An unverified caller's job: held to their share, drawing on no reservation.
    pub unverified: bool,
    /// The tier whose reserved slots and places it draws on, as an index into
    /// [`QueueRules::tiers`](super::QueueRules::tiers).
    pub(super) reserved: Option<usize>,
    /// Its rank when the account is full.
    pub rank: i64,
}

impl Standing {
    /// A configured caller's job of a tier with neither reservation nor rank.
    pub const PLAIN: Standing = Standing { unverified: false, reserved: None, rank: 0 };

    /// A job of a tier with neither reservation nor rank, of an unverified caller or not.
    pub fn plain(unverified: bool) -> Self {
        Standing { unverified, ..Standing::PLAIN }
    }

    /// The tier whose reservation it draws on, if any.
    pub fn reserved_tier(self) -> Option<usize> {
        self.reserved
    }
}

/// The places owed to reserved tiers that hold fewer than their share, given the places each
/// holds (`held(i)`, waiting or promised), after one more place for a job of `standing`: what a
/// new place must leave free.
pub(super) fn places_owed(
    tiers: &[TierRule],
    max_waiting: usize,
    standing: Standing,
    held: impl Fn(usize) -> usize,
) -> usize {
    tiers.iter().enumerate().fold(0usize, |owed, (i, tier)| {
        let mine = usize::from(standing.reserved == Some(i));
        owed.saturating_add(tier.share_of(max_waiting).saturating_sub(held(i).saturating_add(mine)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pro(reserved: f64) -> TierRule {
        TierRule { name: "pro".into(), reserved, rank: 1 }
    }

    #[test]
    fn a_share_rounds_down_and_a_whole_share_is_the_whole() {
        assert_eq!(pro(0.5).share_of(5), 2);
        assert_eq!(pro(0.5).share_of(1), 0, "half of one slot is none");
        assert_eq!(pro(1.0).share_of(7), 7);
        assert_eq!(pro(0.0).share_of(7), 0);
    }

    #[test]
    fn a_place_of_the_reserved_tier_uses_its_own_share_and_others_leave_it_free() {
        let tiers = [pro(0.5)];
        let of_pro = Standing { reserved: Some(0), ..Standing::PLAIN };
        // 10 places, 5 owed to pro, which holds 2: 3 still owed.
        assert_eq!(places_owed(&tiers, 10, Standing::PLAIN, |_| 2), 3);
        assert_eq!(places_owed(&tiers, 10, of_pro, |_| 2), 2, "its own place is one of its five");
        assert_eq!(places_owed(&tiers, 10, of_pro, |_| 7), 0, "past its share it owes nothing");
        assert_eq!(places_owed(&tiers, 10, Standing::plain(true), |_| 0), 5, "an unverified job draws on none");
    }
}
