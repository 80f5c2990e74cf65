//! Loop detection: a stuck agent repeats the exact same call, or keeps getting the same answer;
//! a working one varies its calls and gets somewhere.
//!
//! Each caller (a caller id, never a raw credential) has a short history of its recent calls,
//! across sessions, as signatures of the tool name and its canonicalised arguments, and of the
//! answers they got (hashed by [`crate::guard::after::progress`], volatile fields left out). Three
//! patterns are refused, with `repeats` (default 5), `no_progress` (default 5) and `window`
//! (default 60 s):
//!
//! - **Repetition**: the same signature `repeats` times in a row within the window. The
//!   `repeats`-th call is refused.
//! - **Oscillation**: a trailing run of calls alternating strictly between two signatures
//!   (A B A B …). The call that would be the `repeats`-th occurrence of its signature in that
//!   run, within the window, is refused.
//! - **No progress**: the same answer from the same tool `no_progress` times in a row within the
//!   window, whatever the arguments (an agent paraphrasing a search that keeps coming back
//!   empty). That answer still reaches the caller, with a warning the model reads (the one
//!   before it warns too: [`NoProgress`]); the tool's next call is refused.
//!
//! A refused pattern becomes a hard stop: every identical call (for an oscillation, a call of
//! either signature; for no progress, any call of the tool) is refused with the time left until
//! `window` has passed since the refusal, and is not recorded. Anything else resets: a different
//! call in between breaks a run, calls older than the window do not count, a change of any
//! argument makes a different signature, and **an answer that changed is never a loop**: when a
//! call's answer differs from the one its signature got last, the earlier calls of that
//! signature stop counting (polling something that moves is progress, for any tool).
//!
//! Checking and recording are one atomic step; a recorded call can be taken back with
//! [`LoopDetector::forget`] when a later guard step refuses it, so that a call refused for
//! budget never counts as a repetition. Its answer is recorded when it comes
//! ([`LoopDetector::answered`]).

mod answers;
mod calls;
mod history;
mod signature;
mod stage;
#[cfg(test)]
mod tests;

pub use answers::NoProgress;
pub use calls::LoopDetector;
pub use history::{Looping, Recorded};
pub use signature::{canonical_call, signature, tool_signature};
pub use stage::{Loops, SharedLoopCall};

pub use crate::store::{Pattern, Streaked};
