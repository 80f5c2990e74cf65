//! The one guarded call: what every door — the library's `LimitedRouter`, the reference server,
//! the proxy, the simulator — runs for a tool call, so a technique added here (or a hole fixed)
//! is added or fixed for all of them.
//!
//! ```text
//! (the server behind: shed, see `shed`)
//! check the arguments ─► before charging ─► admit (loops, every budget, slots) ─► the work, racing
//! (refused: invalid)     (upstream down,    (refused: rate_limited, busy, …)     the caller's cancel,
//!                         queue full)                                           shared with identical
//!                                                                               calls ─► settle ─► hear
//!                                                        the answer (loops by answers) ─► report
//! ```
//!
//! A door supplies only what differs ([`Door`]): how arguments are checked, what is known before
//! charging (and held until the work starts: a place in a queue), whether a call can be a loop, how
//! a refusal is explained, what an answer says it used. The work itself is the door's too, handed
//! what the call holds ([`Admitted`]): a job takes the admission (its in-flight slots) with it, any
//! other work leaves it, and its slots go back when the work returns — or at once when the caller
//! cancels: the work is raced against the cancellation and dropped, and every slot, lease and queue
//! place it holds is owned by a guard that gives it back when dropped (see `upstream::queue`).
//!
//! A call that asks its caller for input (MCP's `input_required`) and is sent again with it is one
//! call: the next round is neither charged again nor a loop ([`crate::guard::resume`]).
//!
//! Identical calls may share one piece of work (`[tools.NAME] coalesce`, `cache_ttl_ms`: see
//! [`crate::guard::reuse`]); each caller is still admitted and charged on its own. A priced call's
//! reservation is settled from what the answer says it used ([`crate::guard::settle`]). Every
//! refusal, whoever made it, is recorded for the dashboard on its way out.
//!
//! Nothing here knows MCP: the answer is the door's own type; the rmcp glue turns what comes out
//! ([`Called`]) into a tool result.

use std::borrow::Cow;
use std::future::Future;
use std::sync::{Arc, Mutex};

use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

use crate::guard::loops::NoProgress;
use crate::guard::reuse::{Reuse, Served, Sharing};
use crate::guard::shed::Shed;
use crate::guard::trace;
use crate::guard::{Admission, Guard, Refusal, Settled, ToolCall, Used, Warning};
use crate::identity::Caller;
use crate::metrics::Layer;

/// What a door decides around the one guarded call.
pub trait Door: Send + Sync {
    /// What the door's work answers (a tool result), shared by identical calls.
    type Answer: Clone + Send + Sync + 'static;
    /// What the door holds from before charging until its work starts (a place in a queue).
    type Place: Send + 'static;

    /// The arguments as the limits see them (loops compare them, formulas price them, identical
    /// calls are found by them), or why they are refused before anything is charged. By default
    /// they are taken as they are.
    fn check(&self, _tool: &str, args: &Map<String, Value>) -> Result<Value, Refusal> {
        Ok(Value::Object(args.clone()))
    }

    /// What is known before anything is charged — the upstream known down, its queue full — or
    /// what the call holds until its work starts.
    fn before_charging(&self, tool: &str, caller: &Caller) -> Result<Self::Place, Refusal>;

    /// Whether this call can never be a loop (polling a pending job at its hint). By default none.
    fn loop_exempt(&self, _tool: &str, _args: &Value, _caller: &Caller) -> bool {
        false
    }

    /// A refusal of the guard's, said better where the door knows more (a job cap that is full,
    /// with the jobs holding it). By default as it is.
    fn explain(&self, _tool: &str, refusal: Refusal, _caller: &Caller) -> Refusal {
        refusal
    }

    /// What `answer` says, for loop detection to compare with the tool's last answers to the
    /// same caller ([`crate::guard::progress`]): a tool result's structured content, else its
    /// content. `None` for an answer that is not the work's result (a job's receipt, a task, a
    /// request for input): such answers are never compared. By default none is.
    fn outcome<'a>(&self, _tool: &str, _answer: &'a Self::Answer) -> Option<Cow<'a, Value>> {
        None
    }

    /// Whether `tool` only reads (MCP's `readOnlyHint`): the same answer to a read again and again
    /// is no progress (`[loop_detection] no_progress`), while the same acknowledgement of a write
    /// is not (the write happened; a write repeated with the same arguments is still caught by
    /// its arguments). A tool that says its own `no_progress` is counted either way. By default
    /// none is known to.
    fn reads_only(&self, _tool: &str) -> bool {
        false
    }

    /// What `answer` says its work used, to settle the call's price by.
    fn used(&self, tool: &str, answer: &Self::Answer) -> Used;

    /// The size in bytes of `answer` if it may be kept for identical calls (a success), else `None`.
    fn keepable(answer: &Self::Answer) -> Option<u64>;

    /// The refusal an answer carries when the work itself refused (the upstream's 429), so it is
    /// recorded like the others. By default none.
    fn refusal_in(&self, _answer: &Self::Answer) -> Option<Refusal> {
        None
    }

    /// The state to resume with, if `answer` asks the caller for input and to call again with it
    /// (MCP's `input_required`: its `requestState`, empty when it gave none); that next call is
    /// then this one's continuation ([`crate::guard::resume`]). By default no answer does.
    fn asks_input(_answer: &Self::Answer) -> Option<&str> {
        None
    }
}

/// What an admitted call's work is handed: who asked, the admission (its in-flight slots; a job
/// takes it and holds it until it is final), and what the door held since before charging.
#[derive(Debug)]
pub struct Admitted<P> {
    /// Who asked.
    pub caller: Caller,
    /// The admission, for a job to take; any other work leaves it, and it is dropped when the work
    /// returns.
    pub admission: TakeOnce<Admission>,
    /// What [`Door::before_charging`] held.
    pub place: P,
}

/// What a call's work came to.
#[derive(Debug, Clone)]
pub enum Worked<A> {
    /// Its answer.
    Answer(A),
    /// The door refused it after all, having used `used` of what it reserved (an upstream that
    /// did not answer: the reservation stands; a call never sent: nothing).
    Refused(Refusal, Used),
}

/// How a guarded call ended.
#[derive(Debug)]
pub enum Called<A> {
    /// Refused before any work: its arguments, before charging, or by the guard.
    Refused(Refusal),
    /// The work answered.
    Answered {
        /// The answer (another identical call's, if `served` says so).
        answer: A,
        /// How: asked itself, coalesced with an identical call in flight, or a kept answer.
        served: Served,
        /// Its price, reserved and settled (`None`: free, or a job settles it when final).
        settled: Option<Settled>,
        /// The limits it took past their warning level.
        warnings: Vec<Warning>,
        /// The tool keeps giving the caller this same answer: the warning it must carry (one
        /// answer short of the stop, or with the answer that makes it).
        no_progress: Option<NoProgress>,
    },
    /// The door refused it after it was admitted (see [`Worked::Refused`]).
    RefusedAfter {
        /// Why.
        refusal: Refusal,
        /// Its price, settled for what the work came to.
        settled: Option<Settled>,
    },
    /// The caller cancelled it while it ran: its slots are back; its reservation stands.
    Cancelled,
    /// The identical call it waited for ended without an answer.
    Lost,
}

/// The call as its door received it.
#[derive(Debug, Clone)]
pub struct Call<'a> {
    /// The tool's name.
    pub tool: &'a str,
    /// Who calls.
    pub caller: &'a Caller,
    /// Its arguments as sent.
    pub args: &'a Map<String, Value>,
    /// Cancelled when the caller stops waiting (a client's `notifications/cancelled`, a session
    /// closing, a stateless request's connection dropped).
    pub cancelled: CancellationToken,
    /// The state this call says it resumes an earlier round with (MCP's `requestState`, empty
    /// when it sends `inputResponses` without one), or `None` for a call of its own. Believed only
    /// where the guard kept a mark for it ([`crate::guard::resume`]).
    pub resumes: Option<&'a str>,
    /// When its request arrived on the guard's clock ([`Arrived`](crate::guard::shed::Arrived)),
    /// if the door can tell: its queueing delay says whether the server is behind
    /// ([`crate::guard::shed`]).
    pub arrived: Option<crate::clock::Nanos>,
}

impl<'a> Call<'a> {
    /// A call of `tool` by `caller` with `args`, never cancelled, resuming nothing.
    pub fn new(tool: &'a str, caller: &'a Caller, args: &'a Map<String, Value>) -> Self {
        Self { tool, caller, args, cancelled: CancellationToken::new(), resumes: None, arrived: None }
    }
}

impl Guard {
    /// Runs `call` through the one pipeline at `door`: checked, refused before charging if it must
    /// be, admitted, `work` run (shared through `reuse` with identical calls where the tool allows),
    /// raced against the caller's cancellation, its price settled, and every refusal recorded.
    /// `work` gets what the call holds and a look at its checked arguments (they stay the
    /// pipeline's: an answer asking for input is resumed by them), and is run as a task of its own
    /// when it may be shared (a waiter that goes away cancels nothing).
    ///
    /// The call's caller and what it came to are recorded on the span current where it runs (a
    /// door's [`trace::call_span`]) when traces are on.
    pub async fn call<D, W, F>(
        &self,
        door: &D,
        reuse: Option<&Arc<Reuse<Worked<D::Answer>>>>,
        call: Call<'_>,
        work: W,
    ) -> Called<D::Answer>
    where
        D: Door,
        W: FnOnce(Admitted<D::Place>, &Value) -> F,
        F: Future<Output = Worked<D::Answer>> + Send + 'static,
    {
        let caller = call.caller;
        let called = self.called(door, reuse, call, work).await;
        trace::record(caller, &called);
        called
    }

    /// [`Guard::call`], but for the trace.
    async fn called<D, W, F>(
        &self,
        door: &D,
        reuse: Option<&Arc<Reuse<Worked<D::Answer>>>>,
        call: Call<'_>,
        work: W,
    ) -> Called<D::Answer>
    where
        D: Door,
        W: FnOnce(Admitted<D::Place>, &Value) -> F,
        F: Future<Output = Worked<D::Answer>> + Send + 'static,
    {
        let Call { tool, caller, args, cancelled, resumes, arrived } = call;
        let refused = |refusal: Refusal| {
            self.seen_refused(caller, tool, &refusal);
            Called::Refused(refusal)
        };
        // First, while it costs nothing: a server that is behind refuses the lowest priority.
        if let Some(shedder) = &self.shedder
            && let Shed::Refuse { wait } = shedder.judge(caller, arrived, self.clock.now())
        {
            self.metrics.shed(caller);
            return refused(Refusal::overloaded(tool, wait));
        }
        let args = match door.check(tool, args) {
            Ok(args) => args,
            Err(refusal) => return refused(refusal),
        };
        let place = match door.before_charging(tool, caller) {
            Ok(place) => place,
            Err(refusal) => return refused(refusal),
        };
        let policy = self.policy();
        let loop_exempt = door.loop_exempt(tool, &args, caller);
        // A round of a call answered "input required" is that call: its mark is taken once.
        let resumed = match resumes {
            Some(state) => self.take_resumed(caller, tool, &args, state).await,
            None => false,
        };
        let guarded = ToolCall { tool, args: &args, starts_job: policy.holds_slot(tool), loop_exempt, resumed };
        let admission = match self.admit(caller, &guarded).await {
            Ok(admission) => admission,
            Err(refusal) => {
                // Refused for now (its request limit, its slot), it may still be resumed later.
                if let (true, Some(state)) = (resumed, resumes) {
                    self.expect_resumed(caller, tool, &args, state).await;
                }
                return refused(door.explain(tool, refusal, caller));
            }
        };
        let warnings = admission.warnings().to_vec();
        let admission = TakeOnce::new(admission);
        // A round that answers input requests is its own: never shared, nor kept for others.
        let sharing = policy.tool(tool).filter(|_| resumes.is_none()).and_then(|p| Sharing::of(p, caller, tool, &args));
        let admitted = Admitted { caller: caller.clone(), admission: admission.clone(), place };
        let work = work(admitted, &args);
        let worked = async {
            match (sharing, reuse) {
                (Some(sharing), Some(reuse)) => reuse.answer(tool, sharing, keepable::<D>, work).await.ok(),
                _ => Some((work.await, Served::Asked)),
            }
        };
        // rmcp signals a client's cancellation (or the session closing) through this token but
        // keeps polling the handler; racing it drops the work at once, and with it every slot it
        // holds, instead of when the upstream finally answers.
        let worked = tokio::select! {
            worked = worked => worked,
            () = cancelled.cancelled() => return Called::Cancelled,
        };
        // A job took the admission and settles its price when it is final; any other call's
        // price is settled here, as its slots go back.
        let reservation = admission.take().and_then(|mut admission| admission.reserved());
        let settle = |used: Used| async move {
            match reservation {
                Some(reservation) => Some(reservation.settle_behind(used).await),
                None => None,
            }
        };
        match worked {
            None => Called::Lost,
            Some((Worked::Answer(answer), served)) => {
                let refused = door.refusal_in(&answer);
                if let Some(refusal) = &refused {
                    self.seen_refused(caller, tool, refusal);
                }
                if let Some(state) = D::asks_input(&answer) {
                    self.expect_resumed(caller, tool, &args, state).await;
                }
                let settled = settle(door.used(tool, &answer)).await;
                // An answer that is the upstream's refusal (its 429) is for backoff to deal with,
                // not an answer the caller keeps getting.
                let no_progress = match door.outcome(tool, &answer) {
                    Some(said) if !loop_exempt && resumes.is_none() && refused.is_none() => {
                        self.heard(caller, (tool, &args), &said, door.reads_only(tool)).await
                    }
                    _ => None,
                };
                Called::Answered { answer, served, settled, warnings, no_progress }
            }
            Some((Worked::Refused(refusal, used), _)) => {
                self.seen_refused(caller, tool, &refusal);
                Called::RefusedAfter { refusal, settled: settle(used).await }
            }
        }
    }

    /// Records a refused call of `tool` for the dashboard, whatever refused it.
    pub fn seen_refused(&self, caller: &Caller, tool: &str, refusal: &Refusal) {
        self.activity().refused(caller, refusal.seen(Layer::Tool, tool), self.clock.now());
    }
}

/// The size of a work's outcome that may be kept: an answer the door says may be.
fn keepable<D: Door>(worked: &Worked<D::Answer>) -> Option<u64> {
    match worked {
        Worked::Answer(answer) => D::keepable(answer),
        Worked::Refused(..) => None,
    }
}

/// A value handed from the pipeline to the work (through rmcp's request extensions, which carry
/// only `Clone` values): whoever takes it first owns it — a job tool takes its call's
/// [`Admission`] to hold until the job is final.
#[derive(Debug)]
pub struct TakeOnce<T>(Arc<Mutex<Option<T>>>);

impl<T> Clone for TakeOnce<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T> TakeOnce<T> {
    /// `value`, for whoever takes it first.
    pub fn new(value: T) -> Self {
        Self(Arc::new(Mutex::new(Some(value))))
    }

    /// The value, if nobody took it yet.
    pub fn take(&self) -> Option<T> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}
