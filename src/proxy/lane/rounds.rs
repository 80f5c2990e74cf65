//! A 2026-07-28 caller asked what a 2025-11-25 server asks: the server's requests bridged into
//! multi-round-trip calls (SEP-2322).
//!
//! A 2025-11-25 server — a stdio child, or one over HTTP of that era — asks its client, the proxy,
//! for sampling, elicitation or the client's roots while it serves a call. A 2025-11-25 caller is
//! asked on its session ([`crate::proxy::relay::Ask`]). A 2026-07-28 caller has no session and is
//! never sent a request: it is asked the 2026-07-28 way, in the answer to its call —
//! `resultType: "input_required"`, the server's requests in `inputRequests`, a `requestState` —
//! and sends the same call again with its `inputResponses` and that state.
//!
//! Between the two rounds the server's call stays open: the proxy *parks* it (`Rounds`) with its
//! place to the proxied server (its account slot) and the server's questions waiting for their
//! answers, under a `requestState` of its own (128 random bits; only its SHA-256 is kept). The
//! call that resumes it — that caller, that tool, those arguments, that state — hands the caller's
//! answers to the server's questions and waits for the server's answer as the first round did; a
//! server that asks again makes another round. The guard sees one call (its resume marks,
//! [`crate::guard::Guard::expect_resumed`]): charged once, never a loop.
//!
//! **Bounded.** A round waits for its caller's input at most `proxy.timeout_ms`, as a 2025-11-25
//! caller's answer must come within the call's time: then the proxied server is told to stop and
//! the slot comes back. One caller (the unverified callers of one address together) holds at most
//! [`ROUNDS_PER_CALLER`] rounds; past that, what the server asks for its further calls is answered
//! with an error, as for a caller that cannot be asked. Every round holds one of
//! `proxy.max_in_flight` slots. A state is taken once, and only by the caller, tool and arguments
//! it was given to; replayed, invented, another's, run out, or resumed with answers that are not
//! to what was asked, it is refused `-32602` before anything is charged, and changes nothing.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};

use rmcp::ErrorData;
use rmcp::model::ClientCapabilities;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};

use super::send::Relayed;
use crate::clock::{Nanos, SharedClock};
use crate::identity::Caller;
use crate::mcp::limited::Said;
use crate::mcp::raw::RawResult;
use crate::proxy::came::Came;
use crate::proxy::relay::{Asked, Reply};
use crate::proxy::scopes::Upstream;
use crate::proxy::{Proxied, Sending};
use crate::upstream::queue::AccountSlot;

/// How a `requestState` of the proxy's own begins (the rest is 32 hex digits).
pub(super) const PREFIX: &str = "mcp-rl-round-";

/// The most rounds one caller (the unverified callers of one address together) holds parked.
pub const ROUNDS_PER_CALLER: usize = 4;

/// Who may resume a round: its caller, with its tool and arguments (a SHA-256 of them).
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Binding {
    caller: String,
    /// Whose count of rounds it is in: the caller, or an unverified caller's address.
    holder: String,
    call: [u8; 32],
}

impl Binding {
    /// `caller`'s call of `tool` with `args`.
    pub(super) fn of(caller: &Caller, tool: &str, args: &Map<String, Value>) -> Self {
        let canonical = crate::guard::loops::canonical_call(tool, &Value::Object(args.clone()));
        Self {
            caller: caller.id().to_owned(),
            holder: caller.unverified_from().unwrap_or(caller.id()).to_owned(),
            call: Sha256::digest(canonical.as_bytes()).into(),
        }
    }
}

/// A 2026-07-28 caller's call through the lane, which can be asked in rounds: who it is, and the
/// round it resumes, if it does (what its client declared it can be asked is the call's
/// [`super::send::Hearing`]'s).
pub(crate) struct Bridge {
    pub(super) binding: Binding,
    pub(super) resume: Option<Resume>,
}

/// A call resuming a round: the state it sent, and its answers to the round's questions (read).
pub(crate) struct Resume {
    state: String,
    answers: Vec<(String, Reply)>,
}

/// The exchange with the proxied server for one call: its answer to come, and what the server
/// asks meanwhile.
pub(crate) struct Exchange {
    answer: Pin<Box<dyn Future<Output = Came> + Send>>,
    asks: mpsc::Receiver<Asked>,
}

/// Where an exchange got to.
enum Driven {
    /// The server's answer.
    Came(Came),
    /// Questions its caller must be asked first (each with where its answer goes), and the place
    /// among its caller's rounds the round asking them takes.
    Asked(Exchange, Vec<Asked>, Reserved),
}

impl Exchange {
    /// Drives the exchange to the server's answer, or to questions its caller can be asked. A
    /// question the caller's client did not declare it can be asked, or one that would park more
    /// rounds than `holder` may hold (its place is taken in `rounds` the moment it is asked), is
    /// answered with the reason here, and the exchange goes on.
    async fn drive(mut self, capabilities: Option<&ClientCapabilities>, rounds: &Arc<Rounds>, holder: &str) -> Driven {
        loop {
            let first = tokio::select! {
                came = &mut self.answer => return Driven::Came(came),
                Some(asked) = self.asks.recv() => asked,
            };
            let mut asking = Vec::new();
            let mut place = None;
            let more = std::iter::from_fn(|| self.asks.try_recv().ok());
            for (ask, reply) in std::iter::once(first).chain(more.collect::<Vec<_>>()) {
                if !ask.declared(capabilities) {
                    let _ = reply.send(Err(crate::proxy::relay::undeclared(ask.method())));
                    continue;
                }
                if place.is_none() {
                    place = rounds.reserve(holder);
                }
                if place.is_none() {
                    let _ = reply.send(Err(ErrorData::invalid_request(
                        format!(
                            "the caller has {ROUNDS_PER_CALLER} calls waiting for its input already: `{}` cannot be \
                             asked of it now",
                            ask.method()
                        ),
                        None,
                    )));
                } else {
                    asking.push((ask, reply));
                }
            }
            if let (false, Some(place)) = (asking.is_empty(), place) {
                return Driven::Asked(self, asking, place);
            }
        }
    }
}

/// A round waiting for its caller's input.
struct Parked {
    binding: Binding,
    exchange: Exchange,
    pending: Questions,
    slot: AccountSlot,
}

/// A round on its way to being parked: its state, and all but its slot (which the call's answer
/// gives back first).
pub(crate) struct Parking {
    state: String,
    binding: Binding,
    exchange: Exchange,
    pending: Questions,
    /// Its place among its caller's rounds, counted until it is parked (then it counts itself).
    place: Reserved,
}

/// A round's questions: the key each has in `inputRequests`, the method it asked, where its
/// answer goes.
type Questions = Vec<(String, &'static str, oneshot::Sender<Result<Reply, ErrorData>>)>;

/// The rounds waiting for their callers' input, by the SHA-256 of their state, and the places taken
/// by rounds about to be parked, by whose count they are in.
#[derive(Default)]
struct Ledger {
    parked: HashMap<[u8; 32], Parked>,
    reserved: HashMap<String, usize>,
}

/// A place among a caller's rounds, taken for a round about to be parked; given back when dropped.
pub(crate) struct Reserved {
    rounds: Arc<Rounds>,
    holder: String,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        let mut ledger = self.rounds.ledger();
        if let Some(count) = ledger.reserved.get_mut(&self.holder) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                ledger.reserved.remove(&self.holder);
            }
        }
    }
}

/// The rounds waiting for their callers' input.
pub(crate) struct Rounds {
    parked: Mutex<Ledger>,
    clock: SharedClock,
    /// How long a round waits for its input (`proxy.timeout_ms`).
    wait: Nanos,
}

impl std::fmt::Debug for Rounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rounds").field("parked", &self.ledger().parked.len()).finish()
    }
}

fn key_of(state: &str) -> [u8; 32] {
    Sha256::digest(state.as_bytes()).into()
}

/// The refusal of a resume the proxy holds no round for.
fn over() -> ErrorData {
    ErrorData::invalid_params(
        "the round this call resumes is not waiting: it was answered already, it waited longer than the call's \
         time, or its requestState was given to another call; call again without requestState",
        None,
    )
}

impl Rounds {
    /// No rounds; each waits at most `wait` on `clock`.
    pub(crate) fn new(clock: SharedClock, wait: Nanos) -> Self {
        Self { parked: Mutex::default(), clock, wait }
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.parked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many rounds are waiting for their input.
    fn waiting(&self) -> usize {
        self.ledger().parked.len()
    }

    /// What a call of `binding`'s that sent `state` (one of the proxy's) and `responses` (its
    /// `inputResponses`) resumes: refused when no round of that caller, tool and arguments waits
    /// under that state, or when its answers are not one to each of the round's questions, each
    /// of the shape its question's answer has.
    pub(super) fn resume_of(
        &self,
        state: &str,
        binding: &Binding,
        responses: Option<&Value>,
    ) -> Result<Resume, ErrorData> {
        let ledger = self.ledger();
        let parked = ledger.parked.get(&key_of(state)).filter(|parked| &parked.binding == binding).ok_or_else(over)?;
        let responses = responses.and_then(Value::as_object);
        let mut answers = Vec::with_capacity(parked.pending.len());
        for (key, method, _) in &parked.pending {
            let response = responses.and_then(|responses| responses.get(key)).ok_or_else(|| {
                ErrorData::invalid_params(format!("inputResponses has no answer to `{key}` ({method})"), None)
            })?;
            let reply = Reply::read(method, response.clone()).map_err(|error| {
                ErrorData::invalid_params(format!("the answer to `{key}` is not a {method} result: {error}"), None)
            })?;
            answers.push((key.clone(), reply));
        }
        Ok(Resume { state: state.to_owned(), answers })
    }

    /// A place for one more of `holder`'s rounds, if it holds fewer than [`ROUNDS_PER_CALLER`]
    /// (parked, or about to be): counted and taken under one lock, so two calls of one caller
    /// asked at once never take a fifth.
    fn reserve(self: &Arc<Self>, holder: &str) -> Option<Reserved> {
        let mut ledger = self.ledger();
        let parked = ledger.parked.values().filter(|parked| parked.binding.holder == holder).count();
        let reserved = ledger.reserved.get(holder).copied().unwrap_or(0);
        if parked.saturating_add(reserved) >= ROUNDS_PER_CALLER {
            return None;
        }
        *ledger.reserved.entry(holder.to_owned()).or_insert(0) += 1;
        Some(Reserved { rounds: self.clone(), holder: holder.to_owned() })
    }

    /// Parks `parking` with `slot`, until it is resumed or its time runs out.
    pub(crate) fn park(self: &Arc<Self>, parking: Parking, slot: AccountSlot) {
        let Parking { state, binding, exchange, pending, place } = parking;
        let key = key_of(&state);
        self.ledger().parked.insert(key, Parked { binding, exchange, pending, slot });
        // Parked, the round counts itself (for a moment it counts twice: never one too many).
        drop(place);
        let (rounds, until) = (Arc::downgrade(self), self.clock.now() + self.wait);
        let clock = self.clock.clone();
        tokio::spawn(async move {
            clock.sleep_until(until).await;
            // Dropped outside the lock: the proxied server is told to stop, the slot comes back.
            let expired = rounds.upgrade().and_then(|rounds| rounds.ledger().parked.remove(&key));
            drop(expired);
        });
    }

    /// Takes the round `resume` resumes and hands the server its caller's answers: the exchange to
    /// drive on, and the round's slot. `None` when it is no longer waiting.
    fn take(&self, resume: Resume) -> Option<(Exchange, AccountSlot)> {
        let Parked { exchange, pending, slot, .. } = self.ledger().parked.remove(&key_of(&resume.state))?;
        let mut answers = resume.answers;
        for (key, _, reply) in pending {
            let answer = answers.iter().position(|(k, _)| *k == key).map(|at| answers.swap_remove(at).1);
            let _ = reply.send(answer.ok_or_else(over));
        }
        Some((exchange, slot))
    }
}

/// The `input_required` result asking a caller `asked`, under a new state: the result as JSON,
/// and where each question's answer goes.
fn input_required(asked: Vec<Asked>) -> (String, String, Questions) {
    let state = format!("{PREFIX}{:032x}", rand::random::<u128>());
    let mut requests = Map::new();
    let mut pending = Vec::with_capacity(asked.len());
    for (n, (ask, reply)) in asked.into_iter().enumerate() {
        let key = format!("input-{n}");
        requests.insert(key.clone(), ask.request());
        pending.push((key, ask.method(), reply));
    }
    let result = serde_json::json!({
        "resultType": "input_required",
        "inputRequests": requests,
        "requestState": state,
    });
    (result.to_string(), state, pending)
}

impl Proxied {
    /// How many calls of 2026-07-28 callers wait for their callers' input (`Rounds`).
    pub fn rounds_waiting(&self) -> usize {
        self.rounds.waiting()
    }

    /// A call through the lane sent and answered within `deadline`: for a 2026-07-28 caller
    /// ([`Bridge`]), a round — the server's answer, or the `input_required` result asking what it
    /// asked, with the round to park once the call has its answer ([`Rounds::park`]). `resumed`:
    /// the exchange of the round this call resumes.
    pub(in crate::proxy) async fn lane_answer(
        &self,
        mut relayed: Relayed,
        resumed: Option<Exchange>,
        upstream: &Arc<Upstream>,
        meta: rmcp::model::RequestMetaObject,
        deadline: Nanos,
    ) -> (Option<Came>, Option<Parking>) {
        let Some(bridge) = relayed.bridge.take() else {
            return (self.by(deadline, relayed.send(upstream, meta)).await, None);
        };
        let capabilities = relayed.hearing.capabilities.clone();
        let exchange = match resumed {
            Some(exchange) => exchange,
            None => {
                let (to, asks) = mpsc::channel(4);
                relayed.hearing.rounds = Some(to);
                let upstream = upstream.clone();
                Exchange { answer: Box::pin(async move { relayed.send(&upstream, meta).await }), asks }
            }
        };
        let driven = exchange.drive(capabilities.as_ref(), &self.rounds, &bridge.binding.holder);
        match self.by(deadline, driven).await {
            None => (None, None),
            Some(Driven::Came(came)) => (Some(came), None),
            Some(Driven::Asked(exchange, asked, place)) => {
                let (result, state, pending) = input_required(asked);
                match RawResult::read(&result) {
                    Ok(raw) => {
                        let parking = Parking { state, binding: bridge.binding, exchange, pending, place };
                        (Some(Came::Result(Said::Raw(raw))), Some(parking))
                    }
                    Err(error) => {
                        (Some(Came::Failed(format!("the input it asks for could not be written: {error}"))), None)
                    }
                }
            }
        }
    }

    /// The exchange and slot of the round `sending` resumes, if it resumes one; refused when that
    /// round is no longer waiting.
    pub(in crate::proxy) fn resumed(
        &self,
        sending: &mut Sending,
    ) -> Result<Option<(Exchange, AccountSlot)>, ErrorData> {
        let Sending::Lane(relayed) = sending else { return Ok(None) };
        let Some(resume) = relayed.bridge.as_mut().and_then(|bridge| bridge.resume.take()) else { return Ok(None) };
        self.rounds.take(resume).map(Some).ok_or_else(over)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Places are counted and taken under one lock: however many of a caller's calls are asked at
    /// once, at most four take a place; one given back is free again; another caller's are its own.
    #[test]
    fn a_caller_never_takes_more_than_its_places_even_asked_at_once() {
        let rounds = Arc::new(Rounds::new(crate::clock::ManualClock::new(), Nanos::from_millis(1000)));
        let taken: Vec<Reserved> = std::thread::scope(|threads| {
            let asked: Vec<_> = (0..16).map(|_| threads.spawn(|| rounds.reserve("tok:a"))).collect();
            asked.into_iter().filter_map(|asked| asked.join().ok().flatten()).collect()
        });
        assert_eq!(taken.len(), ROUNDS_PER_CALLER);
        assert!(rounds.reserve("tok:a").is_none() && rounds.reserve("tok:b").is_some());
        drop(taken);
        assert!(rounds.ledger().reserved.is_empty(), "every place given back");
        assert!(rounds.reserve("tok:a").is_some());
    }
}
