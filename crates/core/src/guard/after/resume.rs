//! A call answered "input required" and sent again with that input is one call, not two.
//!
//! MCP 2026-07-28's multi-round-trip requests (SEP-2322): a tool may answer a call with
//! `input_required` (an elicitation, a sampling request, the client's roots) and an opaque
//! `requestState`; the client then sends the same call again with its `inputResponses` and that
//! state. Charged again, every round of one booking would cost the booking's price, and the
//! rounds — the same tool with the same arguments — would soon be refused as a loop.
//!
//! So when an answer asks for input, the guard keeps a mark for *that caller*, *that tool*, *those
//! arguments* and *that state* ([`Guard::expect_resumed`]), for [`RESUME_WITHIN`]; a call that
//! claims to resume ([`Call::resumes`](crate::guard::Call::resumes)) and matches a mark takes it
//! ([`Guard::take_resumed`]) and is admitted as a continuation: not charged its price or its
//! tool's budget again, and not a loop — but still counted as a request (`limits.method`), and a
//! `holds_slot` tool still takes its slot while it runs. A mark is taken once: replaying a state,
//! or inventing one, is charged as a new call. Another caller, a tool or arguments changed on the
//! way, or a mark run out: a new call too.
//!
//! The mark is a SHA-256 of what it binds, kept in the store's [`Blocks`](crate::store::Blocks)
//! (a key that holds for a while and can be taken once): over Redis, a round answered by one
//! instance continues on any other. A store that cannot be reached charges the call as new: a
//! failure never makes a call free.

use std::time::Duration;

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::guard::Guard;
use crate::guard::loops::canonical_call;
use crate::guard::scope::Scope;
use crate::identity::Caller;

/// How long a call answered "input required" may be resumed at no charge: time for a person to
/// answer an elicitation. Resumed later, it is charged as a new call.
pub const RESUME_WITHIN: Duration = Duration::from_secs(600);

/// The mark of `caller`'s call of `tool` with `args` (canonical), to be resumed with `state`:
/// SHA-256, so nobody can craft another call that takes it.
fn mark(caller: &Caller, tool: &str, args: &Value, state: &str) -> Scope {
    let mut hash = Sha256::new();
    hash.update(canonical_call(tool, args).as_bytes());
    // The state after the call, its length first: no split of the two can collide with another.
    hash.update(state.len().to_le_bytes());
    hash.update(state.as_bytes());
    let digest = hash.finalize();
    let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
    Scope::resume(caller, &hex)
}

impl Guard {
    /// Keeps the mark that lets `caller` resume its call of `tool` with `args` once, with `state`
    /// (the answer's `requestState`, empty when it gave none). A store that cannot keep it only
    /// means the next round is charged.
    pub async fn expect_resumed(&self, caller: &Caller, tool: &str, args: &Value, state: &str) {
        let mark = mark(caller, tool, args, state);
        if let Err(error) = self.store().block(mark.key(), RESUME_WITHIN).await {
            tracing::debug!(target: "mcp_ratelimit::guard", %error, tool, "could not keep a resumable call's mark; its next round is charged");
        }
    }

    /// Whether `caller`'s call of `tool` with `args`, sent again with `state`, resumes a call
    /// answered "input required": its mark taken (once) if so.
    pub async fn take_resumed(&self, caller: &Caller, tool: &str, args: &Value, state: &str) -> bool {
        let mark = mark(caller, tool, args, state);
        match self.store().unblock(mark.key()).await {
            Ok(taken) => taken,
            Err(error) => {
                tracing::debug!(target: "mcp_ratelimit::guard", %error, tool, "could not read a resumed call's mark; it is charged as a new call");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_mark_binds_the_caller_the_tool_the_arguments_and_the_state() {
        let (alice, bob) = (Caller::from_token("alice"), Caller::from_token("bob"));
        let args = json!({"city": "Oslo", "nights": 2});
        let reordered = json!({"nights": 2, "city": "Oslo"});
        let base = mark(&alice, "book", &args, "s1");
        assert_eq!(base, mark(&alice, "book", &reordered, "s1"), "the same call, keys in any order");
        for other in [
            mark(&bob, "book", &args, "s1"),
            mark(&alice, "cancel", &args, "s1"),
            mark(&alice, "book", &json!({"city": "Oslo", "nights": 3}), "s1"),
            mark(&alice, "book", &args, "s2"),
            mark(&alice, "book", &args, ""),
        ] {
            assert_ne!(base, other);
        }
        assert!(base.name().starts_with("resume:") && !base.name().contains("alice"), "{base:?}");
    }
}
