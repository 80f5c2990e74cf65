//! The guard's loop stage ([`Loops`]): this instance's detector, and the shared history of a
//! store when there is one, with what each tool's answers are compared by.

use std::sync::Arc;

use serde_json::Value;

use super::{LoopDetector, Looping, Recorded, Streaked, signature, tool_signature};
use crate::clock::Nanos;
use crate::guard::ToolCall;
use crate::guard::after::progress::answer_hash;
use crate::guard::scope::{Scope, loop_owner};
use crate::identity::Caller;
use crate::store::{LoopAnswered, LoopCall, LoopHistory};

/// The seed of call signatures kept in a shared store: every instance must compute the same
/// signature for the same call. (A known seed lets a caller craft two calls that collide; that
/// only ever stops its own calls, since histories are per caller.)
const SHARED_SIGNATURE_SEED: u64 = 0x6d63_702d_726c_6f6f;

/// The loop stage of the guard: in this instance's memory, and over a shared store in its
/// [`LoopHistory`], so that every instance sees one history per caller. The shared history
/// checks a call in the same step as its budgets ([`Loops::shared_call`]) and hears its answer
/// in a round trip of its own ([`Loops::answered`]); this instance's detector does both when
/// there is no shared history, or while it cannot decide.
#[derive(Debug)]
pub struct Loops {
    local: LoopDetector,
    shared: Option<Arc<dyn LoopHistory>>,
    repeats: u32,
    window: Nanos,
    /// `[loop_detection] no_progress` and `volatile_fields`: what a tool without its own compares.
    no_progress: u32,
    volatile_fields: Vec<String>,
}

/// A call as the shared loop history checks it: in the caller's history, by its signature.
#[derive(Debug)]
pub struct SharedLoopCall {
    history: Arc<dyn LoopHistory>,
    key: Scope,
    signature: u128,
    tool_signature: u128,
    window: Nanos,
    repeats: u32,
}

impl SharedLoopCall {
    /// The history to check the call in, and the call as it is checked.
    pub fn parts(&self) -> (&dyn LoopHistory, LoopCall<'_>) {
        let call = LoopCall {
            key: self.key.key(),
            signature: self.signature,
            tool_signature: self.tool_signature,
            window: self.window,
            repeats: self.repeats,
        };
        (&*self.history, call)
    }
}

impl Loops {
    /// Loop detection with `repeats` identical calls in `window`, in `shared` too when given.
    pub fn new(repeats: u32, window: Nanos, shared: Option<Arc<dyn LoopHistory>>) -> Self {
        Self {
            local: LoopDetector::new(repeats, window),
            shared,
            repeats,
            window,
            no_progress: 0,
            volatile_fields: Vec::new(),
        }
    }

    /// These loops comparing answers too: `no_progress` identical ones of a tool in a row stop it
    /// (0: answers are not compared), `volatile_fields` left out; for a tool that does not say
    /// its own.
    pub fn comparing(mut self, no_progress: u32, volatile_fields: Vec<String>) -> Self {
        (self.no_progress, self.volatile_fields) = (no_progress, volatile_fields);
        self
    }

    /// What `policy` (the tool's own, if it has one) compares of a tool's answers: how many
    /// identical ones stop it (0: none) and which fields are left out. A tool without its own
    /// `no_progress` has `[loop_detection]`'s if it `reads_only`, else none: the same
    /// acknowledgement of a write is not a loop.
    pub fn answers_of<'a>(
        &'a self,
        policy: Option<&'a crate::config::ToolPolicy>,
        reads_only: bool,
    ) -> (u32, &'a [String]) {
        let default = if reads_only { self.no_progress } else { 0 };
        let no_progress = policy.and_then(|p| p.no_progress).unwrap_or(default);
        let volatile = policy.and_then(|p| p.volatile_fields.as_deref()).unwrap_or(&self.volatile_fields);
        (no_progress, volatile)
    }

    /// How many identical calls in a row make a loop.
    pub fn repeats(&self) -> u32 {
        self.repeats
    }

    /// `call` by `caller` as the shared history checks it, when there is one.
    pub fn shared_call(&self, caller: &Caller, call: &ToolCall<'_>) -> Option<SharedLoopCall> {
        Some(SharedLoopCall {
            history: self.shared.clone()?,
            key: Scope::loops(caller),
            signature: signature(SHARED_SIGNATURE_SEED, call.tool, call.args),
            tool_signature: tool_signature(SHARED_SIGNATURE_SEED, call.tool),
            window: self.window,
            repeats: self.repeats,
        })
    }

    /// Records `call` by `caller` at `now` in this instance's detector, or says it repeats a loop.
    pub fn check_locally(&self, caller: &Caller, call: &ToolCall<'_>, now: Nanos) -> Result<Recorded, Looping> {
        self.local.check(loop_owner(caller), call.tool, call.args, now)
    }

    /// Records the answer `caller`'s call of `tool` with `args` got at `now`, where its call was
    /// checked: in the shared history when there is one (this instance's detector while it cannot
    /// answer), else here. `answer` is what the answer says ([`crate::guard::Answer::outcome`]),
    /// compared without `volatile` fields; with `no_progress` (0: off) the tool's answers are
    /// counted whatever the arguments.
    pub async fn answered(
        &self,
        caller: &Caller,
        (tool, args): (&str, &Value),
        (answer, volatile): (&Value, &[String]),
        no_progress: u32,
        now: Nanos,
    ) -> Streaked {
        if let Some(shared) = &self.shared {
            let key = Scope::loops(caller);
            let heard = LoopAnswered {
                key: key.key(),
                signature: signature(SHARED_SIGNATURE_SEED, tool, args),
                tool_signature: tool_signature(SHARED_SIGNATURE_SEED, tool),
                answer: answer_hash(SHARED_SIGNATURE_SEED, answer, volatile),
                window: self.window,
                repeats: self.repeats,
                no_progress,
            };
            match shared.answered(heard).await {
                Ok(streaked) => return streaked,
                Err(error) => tracing::debug!(%error, "the shared loop history did not hear an answer; kept here"),
            }
        }
        let answer = answer_hash(self.local.seed, answer, volatile);
        self.local.answered(loop_owner(caller), (tool, args), answer, no_progress, now)
    }

    /// Takes back a call this instance's detector recorded (a later step refused it).
    pub fn forget(&self, caller: &Caller, recorded: Recorded) {
        self.local.forget(loop_owner(caller), recorded);
    }

    /// Forgets idle histories of this instance; how many went.
    pub fn sweep(&self, now: Nanos) -> usize {
        self.local.sweep(now)
    }
}
