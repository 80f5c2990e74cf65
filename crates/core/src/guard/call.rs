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
//! A door supplies only what differs ([`Door`]): how arguments are checked (and whether a call can
//! be a loop), what is known before charging (and held until the work starts: a place in a queue),
//! how a refusal is explained; the answer says what its work used ([`Answer`]). The work itself is
//! the door's too, handed what the call holds ([`Admitted`]): a job takes the admission (its
//! in-flight slots) with it, any other work leaves it, and its slots go back when the work returns
//! — or at once when the caller cancels: the work is raced against the cancellation and dropped,
//! and every slot, lease and queue place it holds is owned by a guard that gives it back when
//! dropped (see `upstream::queue`).
//!
//! A call that asks its caller for input (MCP's `input_required`) and is sent again with it is one
//! call: the next round is neither charged again nor a loop ([`crate::guard::after::resume`]).
//!
//! Identical calls may share one piece of work (`[tools.NAME] coalesce`, `cache_ttl_ms`: see
//! [`crate::guard::reuse`]); each caller is still admitted and charged on its own. A priced call's
//! reservation is settled from what the answer says it used ([`crate::guard::after::settle`]). Every
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
use crate::guard::trace;
use crate::guard::{Admission, Guard, Refusal, Reserved, Settled, ToolCall, Used, Warning};
use crate::identity::Caller;
use crate::ops::metrics::Layer;

/// What a door decides around the one guarded call: three questions, each with an answer that
/// holds for most doors ([`Plain`] takes every default), the way tower's retry `Policy` says only
/// what to retry. What the work answers is the [`Answer`]'s to say.
pub trait Door: Send + Sync {
    /// What the door holds from before charging until its work starts (a place in a queue).
    type Place: Send + 'static;

    /// The call as the limits see it: its arguments (loops compare them, formulas price them,
    /// identical calls are found by them) and what the door knows of it ([`Checked`]), or why it is
    /// refused before anything is charged. By default the arguments as they are, nothing more.
    fn check(&self, _tool: &str, args: &Map<String, Value>, _caller: &Caller) -> Result<Checked, Refusal> {
        Ok(Checked::new(Value::Object(args.clone())))
    }

    /// What is known before anything is charged — the upstream known down, its queue full — or
    /// what the call holds until its work starts.
    fn before_charging(&self, tool: &str, caller: &Caller) -> Result<Self::Place, Refusal>;

    /// A refusal of the guard's, said better where the door knows more (a job cap that is full,
    /// with the jobs holding it). By default as it is.
    fn explain(&self, _tool: &str, refusal: Refusal, _caller: &Caller) -> Refusal {
        refusal
    }
}

/// A call's arguments as the limits see them, and what its door knows of the call.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    /// The arguments.
    pub args: Value,
    /// The call can never be a loop (polling a pending job at its hint).
    pub loop_exempt: bool,
    /// Its answer is a receipt (a job's fresh id), not its work's result: never compared with the
    /// tool's last answers (loops by answers).
    pub receipt: bool,
}

impl Checked {
    /// `args`, a call like any other.
    pub fn new(args: Value) -> Self {
        Self { args, loop_exempt: false, receipt: false }
    }
}

/// The door with nothing of its own: arguments as they are, nothing known before charging,
/// refusals as the guard says them. A library's tools, the simulator's agents.
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain;

impl Door for Plain {
    type Place = ();

    fn before_charging(&self, _tool: &str, _caller: &Caller) -> Result<(), Refusal> {
        Ok(())
    }
}

/// What a door's work answers, as the one guarded call reads it: shared by identical calls, so
/// `Clone`. Implemented once for a tool result (`mcp-ratelimit-rmcp`'s `ToolAnswer`); every
/// method's default says nothing, as `()` does.
pub trait Answer: Clone + Send + Sync + 'static {
    /// What it says its work used, to settle the call's price by. By default unreported: the
    /// reservation stands.
    fn used(&self) -> Used {
        Used::Unreported
    }

    /// What it says, for loop detection to compare with the tool's last answers to the same
    /// caller ([`crate::guard::after::progress`]): a tool result's structured content, else its content.
    /// `None` for an answer that is not a result (a task, a request for input): never compared.
    fn outcome(&self) -> Option<Cow<'_, Value>> {
        None
    }

    /// Its size in bytes if it may be kept for identical calls (a success), else `None`.
    fn keepable(&self) -> Option<u64> {
        None
    }

    /// The refusal it carries when the work itself refused (the upstream's 429), so it is
    /// recorded like the others.
    fn refusal_in(&self) -> Option<Refusal> {
        None
    }

    /// The state to resume with, if it asks the caller for input and to call again with it (MCP's
    /// `input_required`: its `requestState`, empty when it gave none); that next call is then this
    /// one's continuation ([`crate::guard::after::resume`]).
    fn asks_input(&self) -> Option<&str> {
        None
    }
}

impl Answer for () {}

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
    /// where the guard kept a mark for it ([`crate::guard::after::resume`]).
    pub resumes: Option<&'a str>,
    /// When its request arrived on the guard's clock ([`Arrived`](crate::guard::shed::Arrived)),
    /// if the door can tell: its queueing delay says whether the server is behind
    /// ([`crate::guard::shed`]).
    pub arrived: Option<crate::clock::Nanos>,
    /// The tool only reads (MCP's `readOnlyHint`): the same answer to a read again and again is no
    /// progress (`[loop_detection] no_progress`), while the same acknowledgement of a write is not
    /// (the write happened; a write repeated with the same arguments is still caught by its
    /// arguments). A tool that says its own `no_progress` is counted either way.
    pub reads_only: bool,
}

impl<'a> Call<'a> {
    /// A call of `tool` by `caller` with `args`, never cancelled, resuming nothing, not known to
    /// only read.
    pub fn new(tool: &'a str, caller: &'a Caller, args: &'a Map<String, Value>) -> Self {
        Self {
            tool,
            caller,
            args,
            cancelled: CancellationToken::new(),
            resumes: None,
            arrived: None,
            reads_only: false,
        }
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
    pub async fn call<D, A, W, F>(
        &self,
        door: &D,
        reuse: Option<&Arc<Reuse<Worked<A>>>>,
        call: Call<'_>,
        work: W,
    ) -> Called<A>
    where
        D: Door,
        A: Answer,
        W: FnOnce(Admitted<D::Place>, &Value) -> F,
        F: Future<Output = Worked<A>> + Send + 'static,
    {
        let caller = call.caller;
        let called = self.called(door, reuse, call, work).await;
        trace::record(caller, &called);
        called
    }

    /// [`Guard::call`], but for the trace.
    async fn called<D, A, W, F>(
        &self,
        door: &D,
        reuse: Option<&Arc<Reuse<Worked<A>>>>,
        call: Call<'_>,
        work: W,
    ) -> Called<A>
    where
        D: Door,
        A: Answer,
        W: FnOnce(Admitted<D::Place>, &Value) -> F,
        F: Future<Output = Worked<A>> + Send + 'static,
    {
        let Call { tool, caller, args, cancelled, resumes, arrived, reads_only } = call;
        let refused = |refusal: Refusal| {
            self.seen_refused(caller, tool, &refusal);
            Called::Refused(refusal)
        };
        let (Checked { args, loop_exempt, receipt }, place) = match self.at_the_door(door, tool, args, caller, arrived)
        {
            Ok(at_the_door) => at_the_door,
            Err(refusal) => return refused(refusal),
        };
        let policy = self.policy();
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
                (Some(sharing), Some(reuse)) => reuse.answer(tool, sharing, keepable::<A>, work).await.ok(),
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
        let reserved = admission.take().and_then(|mut admission| admission.reserved());
        // An answer that is the upstream's refusal (its 429) is for backoff to deal with, not an
        // answer the caller keeps getting; a receipt is not the work's result.
        // Nobody compares answers where loop detection is off (or every limit is): the answer is
        // not read for it.
        let listened = self.loops.is_some() && self.live.load().enabled;
        let compared = listened && !loop_exempt && !receipt && resumes.is_none();
        let after = After { caller, tool, args: &args, reads_only, compared, warnings };
        match worked {
            None => Called::Lost,
            Some((worked, served)) => self.after_work(after, worked, served, reserved).await,
        }
    }

    /// What a call meets before anything is charged: a server that is behind refuses the lowest
    /// priority first (while it costs nothing), then the door checks the call and takes its place.
    fn at_the_door<D: Door>(
        &self,
        door: &D,
        tool: &str,
        args: &Map<String, Value>,
        caller: &Caller,
        arrived: Option<crate::clock::Nanos>,
    ) -> Result<(Checked, D::Place), Refusal> {
        if let Some(shedder) = &self.shedder
            && let Some(wait) = shedder.judge(caller, arrived, self.clock.now())
        {
            self.metrics.shed(caller);
            return Err(Refusal::overloaded(tool, wait));
        }
        let checked = door.check(tool, args, caller)?;
        let place = door.before_charging(tool, caller)?;
        Ok((checked, place))
    }

    /// A worked call's ending: its price settled (unless a job took it), a refusal in its answer
    /// seen, a request for input marked for its next round, its answer compared with the ones
    /// before it.
    async fn after_work<A: Answer>(
        &self,
        after: After<'_>,
        worked: Worked<A>,
        served: Served,
        reserved: Option<Reserved>,
    ) -> Called<A> {
        let After { caller, tool, args, reads_only, compared, warnings } = after;
        let settle = |used: Used| async move {
            match reserved {
                Some(reserved) => Some(reserved.settle_behind(used).await),
                None => None,
            }
        };
        match worked {
            Worked::Answer(answer) => {
                let refused = answer.refusal_in();
                if let Some(refusal) = &refused {
                    self.seen_refused(caller, tool, refusal);
                }
                if let Some(state) = answer.asks_input() {
                    self.expect_resumed(caller, tool, args, state).await;
                }
                let settled = settle(answer.used()).await;
                // Read only where it is compared: an answer as another server sent it is parsed to
                // say it.
                let outcome = if compared && refused.is_none() { answer.outcome() } else { None };
                let no_progress = match outcome {
                    Some(said) => self.heard(caller, (tool, args), &said, reads_only).await,
                    None => None,
                };
                Called::Answered { answer, served, settled, warnings, no_progress }
            }
            Worked::Refused(refusal, used) => {
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

/// What a call's ending needs to know of it.
struct After<'a> {
    caller: &'a Caller,
    tool: &'a str,
    args: &'a Value,
    reads_only: bool,
    /// Whether its answer is compared with the ones before it (not a loop-exempt call, a receipt,
    /// or a round answering input requests).
    compared: bool,
    warnings: Vec<Warning>,
}

/// The size of a work's outcome that may be kept: an answer the door says may be.
fn keepable<A: Answer>(worked: &Worked<A>) -> Option<u64> {
    match worked {
        Worked::Answer(answer) => answer.keepable(),
        Worked::Refused(..) => None,
    }
}

/// A value the pipeline shares with the work: whoever takes it first owns it. A job (or a proxied
/// task) takes its call's [`Admission`] once it exists, to hold until it is final
/// ([`Held::taking`](crate::guard::Held::taking)); what nobody took the guard settles when the
/// work returns.
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
