//! How a [`Refusal`] reaches an MCP client.
//!
//! A limit hit inside a tool call is a *tool result* with `isError: true`, never a JSON-RPC
//! error: the text lands in the model's context and says, in whole seconds, how long to wait,
//! and the same facts are in `structuredContent.error` for programs. A refused method that has
//! no tool result to carry it (`tools/list`, `ping`, `tasks/get`) is a JSON-RPC error with the
//! same structured data.

use rmcp::ErrorData;
use rmcp::model::{CallToolResult, ContentBlock, ErrorCode};

use mcp_ratelimit_core::guard::loops::NoProgress;
use mcp_ratelimit_core::guard::reuse::Served;
use mcp_ratelimit_core::guard::{Refusal, Settled, Warning};

use crate::raw::{RawEdit, RawKind, RawResult};

/// The `isError: true` tool result carrying the refusal's message and its structured error.
pub fn tool_result(refusal: &Refusal) -> CallToolResult {
    let mut result = CallToolResult::error(vec![ContentBlock::text(refusal.message.clone())]);
    result.structured_content = Some(refusal.to_json());
    result
}

/// The refusal an `isError` tool result carries (what [`tool_result`] wrote), for whoever sees
/// only results; `None` for any other result.
pub fn refusal_in(result: &CallToolResult) -> Option<Refusal> {
    if result.is_error != Some(true) {
        return None;
    }
    Refusal::from_json(result.structured_content.as_ref()?)
}

/// A refused method as a JSON-RPC error (`-32000`) with the structured error as its data.
pub fn method_error(refusal: &Refusal) -> ErrorData {
    let data = refusal.to_json().get("error").cloned();
    ErrorData::new(ErrorCode(-32000), refusal.message.clone(), data)
}

/// Where what the guard adds to a result goes (warnings, a settled price, whether it was
/// shared), which depends on add_to result it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddTo {
    /// Its `structuredContent` (and warnings in its text too): for one of the reference server's
    /// own tools, add_to `outputSchema` admits what we add.
    StructuredContent,
    /// Its `_meta`, under [`META_PREFIX`]: for another server's result (behind the proxy) or a
    /// forker's tool's (through `LimitedRouter`), add_to `content` and `structuredContent` are
    /// left exactly as they were (they must still validate against its `outputSchema`).
    Meta,
}

pub use crate::raw::{META_PREFIX, THEIR_CONNECTION};

/// A tool result the guard adds to: one in rmcp's types ([`CallToolResult`]), or another server's
/// as it came ([`Editing`]: the proxy's relay lane), each changed only where [`AddTo`] says.
pub trait Addable {
    /// Whether it is an `isError` result.
    fn is_error(&self) -> bool;
    /// Its `structuredContent`, when it is an object (only one of our own tools' is added to).
    fn structured(&mut self) -> Option<&mut serde_json::Map<String, serde_json::Value>>;
    /// Its `_meta`, made if it has none.
    fn meta(&mut self) -> &mut serde_json::Map<String, serde_json::Value>;
    /// Appends a text block to its `content`.
    fn push_text(&mut self, text: String);
}

impl Addable for CallToolResult {
    fn is_error(&self) -> bool {
        self.is_error == Some(true)
    }

    fn structured(&mut self) -> Option<&mut serde_json::Map<String, serde_json::Value>> {
        match &mut self.structured_content {
            Some(serde_json::Value::Object(structured)) => Some(structured),
            _ => None,
        }
    }

    fn meta(&mut self) -> &mut serde_json::Map<String, serde_json::Value> {
        &mut self.meta.get_or_insert_with(Default::default).0
    }

    fn push_text(&mut self, text: String) {
        self.content.push(ContentBlock::text(text));
    }
}

/// Another server's result as it came, and what is being changed of it.
#[derive(Debug)]
pub struct Editing {
    /// The result.
    pub result: RawResult,
    /// The changes.
    pub edit: RawEdit,
}

impl Editing {
    /// `result`, unchanged so far; what describes the proxied server's connection
    /// (`io.modelcontextprotocol/serverInfo`) and any key under our [`META_PREFIX`] it put in its
    /// `_meta` taken out, as [`without_ours`] does to a typed one.
    pub fn of(result: RawResult) -> Self {
        let mut editing = Self { result, edit: RawEdit::default() };
        if editing.result.meta_holds_ours() {
            editing.meta().retain(|key, _| !key.starts_with(META_PREFIX) && key != THEIR_CONNECTION);
        }
        editing
    }
}

impl Addable for Editing {
    fn is_error(&self) -> bool {
        matches!(self.result.kind(), RawKind::Complete { is_error: true })
    }

    /// Never: another server's `structuredContent` must still validate against its `outputSchema`.
    fn structured(&mut self) -> Option<&mut serde_json::Map<String, serde_json::Value>> {
        None
    }

    fn meta(&mut self) -> &mut serde_json::Map<String, serde_json::Value> {
        self.edit.meta(&self.result)
    }

    fn push_text(&mut self, text: String) {
        self.edit.push_text(text);
    }
}

/// A tool result that also tells the agent which limits it is close to, so it can plan before
/// it is refused: ours in its text and as `structuredContent.warnings`; theirs as
/// `_meta["io.github.mcp-ratelimit/warnings"]`.
pub fn with_warnings(done: &mut impl Addable, warnings: &[Warning], add_to: AddTo) {
    if add_to == AddTo::StructuredContent {
        for warning in warnings {
            done.push_text(warning.sentence());
        }
    }
    said(done, &[("warnings", serde_json::json!(warnings))], add_to);
}

/// A result whose tool keeps giving the caller the same answer, with the warning a model reads:
/// a text block appended to its `content` (a model reads `content`), and the same facts for
/// programs where `add_to` says: one of our own tools' answers as an entry of its
/// `structuredContent.warnings` (beside the limits' [`with_warnings`], which its `outputSchema`
/// admits), anyone else's as `_meta["io.github.mcp-ratelimit/no_progress"]`, its
/// `structuredContent` left as it was so it still validates against its `outputSchema`. The
/// text is the one change to another's `content` we make, because a warning no model reads is no
/// warning.
pub fn with_no_progress(done: &mut impl Addable, no_progress: &NoProgress, add_to: AddTo) {
    done.push_text(no_progress.sentence());
    let warning = serde_json::json!(no_progress);
    if add_to == AddTo::StructuredContent
        && let Some(structured) = done.structured()
    {
        let warnings = structured.entry("warnings").or_insert_with(|| serde_json::Value::Array(Vec::new()));
        if let serde_json::Value::Array(warnings) = warnings {
            warnings.push(warning);
            return;
        }
        // Ours always say `warnings` as a list; anything else is not ours to add to.
    }
    said(done, &[("no_progress", warning)], AddTo::Meta);
}

/// The size of `done`'s JSON when it may be kept for identical calls (`cache_ttl_ms`): a
/// successful result only, never an `isError` one (a refusal or the upstream's failure).
pub fn keepable(done: &CallToolResult) -> Option<u64> {
    if done.is_error == Some(true) {
        return None;
    }
    serde_json::to_vec(done).ok().map(|json| json.len() as u64)
}

/// A result another call's request answered says so: `cached: true` (a kept answer) or
/// `coalesced: true` (an identical call's, in flight), where `said` puts it.
pub fn reused(done: &mut impl Addable, served: Served, add_to: AddTo) {
    let Some(how) = served.saved() else { return };
    said(done, &[(how, serde_json::Value::Bool(true))], add_to);
}

/// A result that says what its call reserved and was charged (`reserved`, `charged`), where
/// `said` puts it.
pub fn priced(done: &mut impl Addable, settled: Settled, add_to: AddTo) {
    said(done, &[("reserved", settled.reserved.into()), ("charged", settled.charged.into())], add_to);
}

/// `done` with `facts` added where `add_to` says: an answer of ours in its `structuredContent`
/// (an object: ours always is); anything else in `_meta`, each key prefixed with
/// [`META_PREFIX`], beside whatever `_meta` it had.
fn said(done: &mut impl Addable, facts: &[(&str, serde_json::Value)], add_to: AddTo) {
    if add_to == AddTo::StructuredContent
        && let Some(structured) = done.structured()
    {
        for (key, value) in facts {
            structured.insert((*key).into(), value.clone());
        }
        return;
    }
    let meta = done.meta();
    for (key, value) in facts {
        meta.insert(format!("{META_PREFIX}{key}"), value.clone());
    }
}

/// `done` without any `_meta` key under our [`META_PREFIX`]: what a proxied server says there is
/// not ours to vouch for (a `charged: 0` of its own would read as our price), so only what we
/// add (`said`) is there.
pub fn without_ours(mut done: CallToolResult) -> CallToolResult {
    if let Some(meta) = &mut done.meta {
        meta.0.retain(|key, _| !key.starts_with(META_PREFIX));
    }
    done
}

/// The units the upstream reports a result used: `structuredContent.usage.units`, else
/// `_meta.usage.units` (where a server that has no structured output can say it).
pub fn usage_in(done: &CallToolResult) -> Option<u64> {
    let structured = done.structured_content.as_ref().and_then(|s| s.get("usage"));
    structured.or_else(|| meta_usage(done))?.get("units")?.as_u64()
}

/// The units a result reports in `_meta.usage.units` only: where a proxied server that the
/// operator trusts to bill (`[tools.NAME] settle = "usage"`) says it. Never its
/// `structuredContent`, which may echo what the caller sent.
pub fn usage_in_meta(done: &CallToolResult) -> Option<u64> {
    meta_usage(done)?.get("units")?.as_u64()
}

fn meta_usage(done: &CallToolResult) -> Option<&serde_json::Value> {
    done.meta.as_ref().and_then(|m| m.0.get("usage"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_gives_back_the_refusal_it_carries() {
        let busy = Refusal::busy("generate_image", "in_flight:caller:x".into(), 5);
        let rate = Refusal::rate_limited(
            "list_articles",
            "caller:x".into(),
            60,
            0,
            mcp_ratelimit_core::clock::Nanos::from_secs(1),
        );
        for refusal in [busy, rate] {
            let result = tool_result(&refusal);
            assert_eq!(result.is_error, Some(true));
            assert_eq!(refusal_in(&result), Some(refusal));
        }
        let ok = CallToolResult::success(vec![ContentBlock::text("fine")]);
        assert_eq!(refusal_in(&ok), None);
    }

    #[test]
    fn usage_is_read_from_structured_content_or_meta_and_the_price_is_said_beside_it() {
        let mut structured = CallToolResult::structured(serde_json::json!({"usage": {"units": 7}}));
        assert_eq!(usage_in(&structured), Some(7));
        assert_eq!(usage_in_meta(&structured), None, "a proxied server's structured content may echo its caller");
        priced(&mut structured, Settled { reserved: 9, charged: 7 }, AddTo::StructuredContent);
        let said = structured.structured_content.as_ref().expect("structured");
        assert_eq!((said["reserved"].clone(), said["charged"].clone()), (9.into(), 7.into()));
        let mut text = CallToolResult::success(vec![ContentBlock::text("fine")]);
        assert_eq!(usage_in(&text), None, "nothing reported");
        let mut meta = rmcp::model::MetaObject::default();
        meta.0.insert("usage".into(), serde_json::json!({"units": 3}));
        text.meta = Some(meta);
        assert_eq!(usage_in(&text), Some(3));
        assert_eq!(usage_in_meta(&text), Some(3));
        priced(&mut text, Settled { reserved: 5, charged: 3 }, AddTo::Meta);
        assert_eq!(text.structured_content, None, "another server's result keeps its shape");
        let charged = text.meta.as_ref().map(|m| m.0["io.github.mcp-ratelimit/charged"].clone());
        assert_eq!(charged, Some(3.into()));
        let negative = CallToolResult::structured(serde_json::json!({"usage": {"units": -2}}));
        assert_eq!(usage_in(&negative), None, "not a count of units");
    }
}
