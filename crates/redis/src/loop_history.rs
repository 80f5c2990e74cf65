//! A caller's loop history checked alone, and the answers its calls got heard
//! (`loop_history.lua`, `loop_answer.lua`): the shared twin of the guard's loop detector.

use mcp_ratelimit_kernel::clock::Nanos;
use mcp_ratelimit_kernel::store::{Lease, LoopAnswered, LoopCall, StoreError, Streaked, Verdict};

use crate::batch::Invocation;
use crate::errors::bounded;
use crate::scripts::{hex, micros};
use crate::{LoopAnswer, RedisStore};

impl RedisStore {
    /// Checks a caller's call (its `signature`) against the history under `key`, as
    /// the guard's `LoopDetector::check` does, and records it if it is not a loop;
    /// at an explicit clock reading when `now` is given. The very script a call's decision runs
    /// ([`LoopHistory::decide_after_loop_check`](mcp_ratelimit_kernel::store::LoopHistory::decide_after_loop_check)),
    /// with nothing else to decide.
    pub async fn loop_check(&self, call: LoopCall<'_>, now: Option<Nanos>) -> Result<LoopAnswer, StoreError> {
        let now_us = now.map(micros).transpose()?;
        match self.run_unless_blocked(&[], &[], Some(call), now_us, Lease::new()).await? {
            Verdict::Looping { retry_after, pattern } => Ok(LoopAnswer::Looping { retry_after, pattern }),
            Verdict::Decided(_) => Ok(LoopAnswer::Recorded),
            Verdict::Blocked { .. } => Err(self.malformed("a block answered a loop check that named none".into())),
        }
    }

    /// Hears the answer a checked call got, as
    /// the guard's `LoopDetector::answered` does (`loop_answer.lua`); at an
    /// explicit clock reading when `now` is given.
    pub async fn loop_answered(&self, heard: LoopAnswered<'_>, now: Option<Nanos>) -> Result<Streaked, StoreError> {
        let now_us = now.map(micros).transpose()?;
        let mut invocation = Invocation::of(&self.loop_answer);
        invocation.key(heard.key);
        invocation.arg(now_us.map_or_else(String::new, |us| us.to_string()));
        invocation.arg(heard.window.as_u64().div_ceil(1_000)).arg(heard.repeats.max(2));
        let (signature, tool, answer) = (hex(heard.signature), hex(heard.tool_signature), hex(heard.answer));
        let said = |h: &[u8; 32]| String::from_utf8_lossy(h).into_owned();
        invocation.arg(format!("{} {} {} {}", said(&signature), said(&tool), said(&answer), heard.no_progress));
        let reply: Vec<i64> = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        match reply[..] {
            [same, stopped_for_us] => Ok(Streaked {
                same: u32::try_from(same).unwrap_or(u32::MAX).max(1),
                stopped_for: (stopped_for_us > 0)
                    .then(|| Nanos::from_micros(u64::try_from(stopped_for_us).unwrap_or(0))),
            }),
            _ => Err(self.malformed(format!("loop_answer.lua answered {reply:?}"))),
        }
    }
}
