//! How a [`Refusal`] reaches an MCP client.
//!
//! A limit hit inside a tool call is a *tool result* with `isError: true`, never a JSON-RPC
//! error: the text lands in the model's context and says, in whole seconds, how long to wait,
//! and the same facts are in `structuredContent.error` for programs. A refused method that has
//! no tool result to carry it (`tools/list`, `ping`, `tasks/get`) is a JSON-RPC error with the
//! same structured data.

use rmcp::ErrorData;
use rmcp::model::{CallToolResult, ContentBlock, ErrorCode};

use crate::guard::{Refusal, Settled, Warning};
use crate::reuse::Served;

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

/// A tool result that also tells the agent which limits it is close to (in its text, and as
/// `structuredContent.warnings`), so it can plan before it is refused.
pub fn with_warnings(mut done: CallToolResult, warnings: &[Warning]) -> CallToolResult {
    for warning in warnings {
        done.content.push(ContentBlock::text(warning.sentence()));
    }
    if let Some(serde_json::Value::Object(structured)) = &mut done.structured_content {
        structured.insert("warnings".into(), serde_json::json!(warnings));
    }
    done
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
/// `coalesced: true` (an identical call's, in flight) in `structuredContent` when it is an object,
/// else in `_meta`.
pub fn reused(done: CallToolResult, served: Served) -> CallToolResult {
    let Some(how) = served.saved() else { return done };
    said(done, &[(how, serde_json::Value::Bool(true))])
}

/// A result that says what its call reserved and was charged: `reserved` and `charged` in
/// `structuredContent` when it is an object, else in `_meta`.
pub fn priced(done: CallToolResult, settled: Settled) -> CallToolResult {
    said(done, &[("reserved", settled.reserved.into()), ("charged", settled.charged.into())])
}

/// A result of another server's whose price moved from its reservation: `reserved` and
/// `charged` in `_meta`, its content and `structuredContent` left as they were.
pub fn priced_in_meta(mut done: CallToolResult, settled: Settled) -> CallToolResult {
    let mut meta = done.meta.take().unwrap_or_default();
    meta.0.insert("reserved".into(), settled.reserved.into());
    meta.0.insert("charged".into(), settled.charged.into());
    done.meta = Some(meta);
    done
}

/// `done` with `facts` added where a client reads them: `structuredContent` when it is an
/// object (ours always is), else `_meta` (another server's result, left as it was).
fn said(mut done: CallToolResult, facts: &[(&str, serde_json::Value)]) -> CallToolResult {
    match &mut done.structured_content {
        Some(serde_json::Value::Object(structured)) => {
            for (key, value) in facts {
                structured.insert((*key).into(), value.clone());
            }
        }
        _ => {
            let mut meta = done.meta.take().unwrap_or_default();
            for (key, value) in facts {
                meta.0.insert((*key).into(), value.clone());
            }
            done.meta = Some(meta);
        }
    }
    done
}

/// The units the upstream reports a result used: `structuredContent.usage.units`, else
/// `_meta.usage.units` (where a server that has no structured output can say it).
pub fn usage_in(done: &CallToolResult) -> Option<u64> {
    let structured = done.structured_content.as_ref().and_then(|s| s.get("usage"));
    let meta = done.meta.as_ref().and_then(|m| m.0.get("usage"));
    structured.or(meta)?.get("units")?.as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_gives_back_the_refusal_it_carries() {
        let busy = Refusal::busy("generate_image", "in_flight:caller:x".into(), 5);
        let rate = Refusal::rate_limited("list_articles", "caller:x".into(), 60, 0, 1_000_000_000);
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
        structured = priced(structured, Settled { reserved: 9, charged: 7 });
        let said = structured.structured_content.as_ref().expect("structured");
        assert_eq!((said["reserved"].clone(), said["charged"].clone()), (9.into(), 7.into()));
        let mut text = CallToolResult::success(vec![ContentBlock::text("fine")]);
        assert_eq!(usage_in(&text), None, "nothing reported");
        let mut meta = rmcp::model::MetaObject::default();
        meta.0.insert("usage".into(), serde_json::json!({"units": 3}));
        text.meta = Some(meta);
        assert_eq!(usage_in(&text), Some(3));
        let text = priced(text, Settled { reserved: 5, charged: 3 });
        assert_eq!(text.structured_content, None, "another server's result keeps its shape");
        assert_eq!(text.meta.as_ref().map(|m| m.0["charged"].clone()), Some(3.into()));
        let negative = CallToolResult::structured(serde_json::json!({"usage": {"units": -2}}));
        assert_eq!(usage_in(&negative), None, "not a count of units");
    }
}
