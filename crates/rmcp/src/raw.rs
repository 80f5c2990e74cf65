//! A tool call's result as another server sent it: its JSON, unparsed, with the few facts the one
//! guarded call reads of it (what kind of answer it is, the usage it reports in `_meta`, the task
//! it made, the state a request for input resumes with), read once when it arrives. The proxy's
//! relay lane passes such a result on as it came, adding only what the guard says (`_meta` keys
//! of ours, a warning a model reads) — never a parse into rmcp's types and back.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use rmcp::ErrorData;
use rmcp::model::{CallToolResponse, CallToolResult, CreateTaskResult, InputRequiredResult};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// The prefix of the `_meta` keys we add to a result we did not write
/// (`io.github.mcp-ratelimit/cached`, `…/coalesced`, `…/warnings`, `…/reserved`, `…/charged`):
/// a reverse-DNS name of our own, as the MCP spec asks of `_meta` keys.
pub const META_PREFIX: &str = "io.github.mcp-ratelimit/";

/// The result `_meta` key of 2026-07-28 that describes the answering server's connection, not its
/// answer: a proxy's callers are answered by the proxy.
pub const THEIR_CONNECTION: &str = "io.modelcontextprotocol/serverInfo";

/// What kind of answer a result is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawKind {
    /// A complete result (`isError` or not).
    Complete {
        /// Its `isError`.
        is_error: bool,
    },
    /// A task the call made: 2025-11-25's `{"task": {…}}`, or 2026-07-28's `resultType: "task"`.
    Task(TaskMade),
    /// MCP's `input_required`: the caller is asked for input and calls again with it.
    InputRequired {
        /// Its `requestState` (empty when it gave none).
        state: String,
    },
}

/// A task a call made, as its result describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskMade {
    /// Its id (the server's).
    pub id: String,
    /// How long the server keeps it (`ttl`, ms), if it says.
    pub ttl_ms: Option<u64>,
    /// How often it asks to be polled (`pollInterval`, ms), if it says.
    pub poll_ms: Option<u64>,
    /// Whether it is the 2025-11-25 shape (`{"task": {…}}`), polled with that era's `tasks/get`.
    pub legacy: bool,
}

/// A result as another server sent it: its JSON and what was read of it.
#[derive(Debug, Clone)]
pub struct RawResult {
    json: Arc<str>,
    kind: RawKind,
    /// `_meta.usage.units`, where it reports one.
    usage: Option<u64>,
    /// Its `resultType`, if it says one.
    result_type: Option<String>,
    /// Its `_meta` holds a key of ours or one describing its server's connection (taken out on
    /// the way to a caller).
    ours_in_meta: bool,
}

/// The top of a result, read without building it.
#[derive(Deserialize)]
struct Top<'a> {
    #[serde(rename = "_meta", borrow, default)]
    meta: Option<&'a RawValue>,
    #[serde(rename = "isError", default)]
    is_error: Option<bool>,
    #[serde(rename = "resultType", borrow, default)]
    result_type: Option<Cow<'a, str>>,
    #[serde(rename = "requestState", default)]
    request_state: Option<String>,
    #[serde(borrow, default)]
    task: Option<&'a RawValue>,
    #[serde(rename = "taskId", default)]
    task_id: Option<String>,
    #[serde(default)]
    ttl: Option<u64>,
    #[serde(rename = "pollInterval", default)]
    poll_interval: Option<u64>,
}

/// A 2025-11-25 task, as its result nests it.
#[derive(Deserialize)]
struct LegacyTask {
    #[serde(rename = "taskId")]
    task_id: String,
    #[serde(default)]
    ttl: Option<u64>,
    #[serde(rename = "pollInterval", default)]
    poll_interval: Option<u64>,
}

/// `_meta.usage.units`, read without building the rest.
#[derive(Deserialize)]
struct MetaUsage {
    #[serde(default)]
    usage: Option<Units>,
}

#[derive(Deserialize)]
struct Units {
    #[serde(default)]
    units: Option<Value>,
}

impl RawResult {
    /// `json` (a JSON-RPC response's `result`), read: an error when it is not a JSON object a
    /// tool call's result can be.
    pub fn read(json: &str) -> Result<Self, serde_json::Error> {
        // A struct reads from a JSON array too; a result is an object.
        if !json.trim_start().starts_with('{') {
            return Err(serde::de::Error::custom("a result is a JSON object"));
        }
        let top: Top<'_> = serde_json::from_str(json)?;
        let (usage, ours_in_meta) = match top.meta {
            Some(meta) => {
                let keys: BTreeMap<Cow<'_, str>, serde::de::IgnoredAny> = serde_json::from_str(meta.get())?;
                let ours = keys.keys().any(|key| key.starts_with(META_PREFIX) || key == THEIR_CONNECTION);
                let usage = serde_json::from_str::<MetaUsage>(meta.get()).ok().and_then(|m| m.usage?.units?.as_u64());
                (usage, ours)
            }
            None => (None, false),
        };
        let kind = match (top.result_type.as_deref(), top.task, top.task_id) {
            (Some("input_required"), _, _) => {
                RawKind::InputRequired { state: top.request_state.clone().unwrap_or_default() }
            }
            (Some("task"), _, Some(id)) => {
                RawKind::Task(TaskMade { id, ttl_ms: top.ttl, poll_ms: top.poll_interval, legacy: false })
            }
            (None, Some(task), _) => {
                let task: LegacyTask = serde_json::from_str(task.get())?;
                RawKind::Task(TaskMade {
                    id: task.task_id,
                    ttl_ms: task.ttl,
                    poll_ms: task.poll_interval,
                    legacy: true,
                })
            }
            _ => RawKind::Complete { is_error: top.is_error == Some(true) },
        };
        let result_type = top.result_type.map(Cow::into_owned);
        Ok(Self { json: Arc::from(json), kind, usage, result_type, ours_in_meta })
    }

    /// Its JSON, as it came.
    pub fn json(&self) -> &str {
        &self.json
    }

    /// What kind of answer it is.
    pub fn kind(&self) -> &RawKind {
        &self.kind
    }

    /// The units it reports in `_meta.usage.units`.
    pub fn usage_in_meta(&self) -> Option<u64> {
        self.usage
    }

    /// What a complete result says, for loop detection (as [`crate::limited::outcome_of`] reads a
    /// typed one): its `structuredContent` when it has one and is not an error, else whether it is
    /// an error and its content. Read now, from its JSON; `None` for anything else.
    pub fn outcome(&self) -> Option<Value> {
        let RawKind::Complete { is_error } = self.kind else { return None };
        #[derive(Deserialize)]
        struct Said {
            #[serde(rename = "structuredContent", default)]
            structured: Option<Value>,
            #[serde(default)]
            content: Option<Value>,
        }
        let said: Said = serde_json::from_str(&self.json).ok()?;
        match said.structured {
            Some(structured) if !is_error => Some(structured),
            _ => Some(serde_json::json!({
                "isError": is_error,
                "content": said.content.unwrap_or_else(|| Value::Array(Vec::new())),
            })),
        }
    }

    /// Its size, if it may be kept for identical calls: a complete result that is not an error.
    pub fn keepable(&self) -> Option<u64> {
        matches!(self.kind, RawKind::Complete { is_error: false }).then(|| self.json.len() as u64)
    }

    /// The same answer in rmcp's types (for a door that answers through rmcp: an identical call
    /// sharing this one's answer).
    pub fn to_response(&self) -> Result<CallToolResponse, ErrorData> {
        let unreadable = |e: serde_json::Error| {
            ErrorData::internal_error(format!("the proxied server's result could not be read: {e}"), None)
        };
        Ok(match &self.kind {
            RawKind::Complete { .. } => {
                CallToolResponse::Complete(serde_json::from_str::<CallToolResult>(&self.json).map_err(unreadable)?)
            }
            RawKind::InputRequired { .. } => CallToolResponse::InputRequired(
                serde_json::from_str::<InputRequiredResult>(&self.json).map_err(unreadable)?,
            ),
            RawKind::Task(_) => {
                CallToolResponse::Task(serde_json::from_str::<CreateTaskResult>(&self.json).map_err(unreadable)?)
            }
        })
    }

    /// Whether its `_meta` holds a key of ours, or one describing its server's connection.
    pub fn meta_holds_ours(&self) -> bool {
        self.ours_in_meta
    }

    /// Whether it says its `resultType`.
    pub fn says_result_type(&self) -> bool {
        self.result_type.is_some()
    }
}

/// What is changed of a [`RawResult`] on its way to a caller: `_meta` keys added or taken out,
/// text blocks appended to its `content`, its `resultType` added or taken out. Nothing else of it
/// is touched; with no change at all, its JSON is passed on byte for byte.
#[derive(Debug, Default)]
pub struct RawEdit {
    meta: Option<Map<String, Value>>,
    meta_changed: bool,
    texts: Vec<String>,
    result_type: Option<Option<&'static str>>,
}

impl RawEdit {
    /// The `_meta` of `result`, to change (read once, then kept here).
    pub fn meta(&mut self, result: &RawResult) -> &mut Map<String, Value> {
        self.meta_changed = true;
        self.meta.get_or_insert_with(|| {
            #[derive(Deserialize)]
            struct Meta {
                #[serde(rename = "_meta", default)]
                meta: Option<Map<String, Value>>,
            }
            serde_json::from_str::<Meta>(result.json()).ok().and_then(|m| m.meta).unwrap_or_default()
        })
    }

    /// Appends a text block to its `content`.
    pub fn push_text(&mut self, text: String) {
        self.texts.push(text);
    }

    /// Says `resultType: value` (`None`: says none).
    pub fn set_result_type(&mut self, value: Option<&'static str>) {
        self.result_type = Some(value);
    }

    /// `result` with the changes, as JSON.
    pub fn apply(self, result: &RawResult) -> Result<String, serde_json::Error> {
        if !self.meta_changed && self.texts.is_empty() && self.result_type.is_none() {
            return Ok(result.json().to_owned());
        }
        let mut fields: BTreeMap<Cow<'_, str>, &RawValue> = serde_json::from_str(result.json())?;
        // What replaces a member, owned here; the rest is borrowed from the result as it came.
        let meta = match self.meta.filter(|_| self.meta_changed) {
            Some(meta) if meta.is_empty() => {
                fields.remove("_meta");
                None
            }
            Some(meta) => Some(serde_json::value::to_raw_value(&meta)?),
            None => None,
        };
        let content = if self.texts.is_empty() {
            None
        } else {
            let mut content: Vec<&RawValue> = match fields.get("content") {
                Some(content) => serde_json::from_str(content.get())?,
                None => Vec::new(),
            };
            let texts = self
                .texts
                .iter()
                .map(|text| serde_json::value::to_raw_value(&serde_json::json!({"type": "text", "text": text})))
                .collect::<Result<Vec<_>, _>>()?;
            content.extend(texts.iter().map(AsRef::as_ref));
            Some(serde_json::value::to_raw_value(&content)?)
        };
        let result_type = match self.result_type {
            Some(Some(value)) => Some(serde_json::value::to_raw_value(value)?),
            Some(None) => {
                fields.remove("resultType");
                None
            }
            None => None,
        };
        for (key, value) in [("_meta", &meta), ("content", &content), ("resultType", &result_type)] {
            if let Some(value) = value {
                fields.insert(Cow::Borrowed(key), &**value);
            }
        }
        serde_json::to_string(&fields)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_result_is_told_apart_and_its_facts_read() {
        let done = RawResult::read(r#"{"content":[],"isError":true,"_meta":{"usage":{"units":3}}}"#).expect("reads");
        assert_eq!(done.kind(), &RawKind::Complete { is_error: true });
        assert_eq!((done.usage_in_meta(), done.keepable()), (Some(3), None));
        let legacy = RawResult::read(r#"{"task":{"taskId":"t1","status":"working","ttl":60000}}"#).expect("reads");
        let made = TaskMade { id: "t1".into(), ttl_ms: Some(60_000), poll_ms: None, legacy: true };
        assert_eq!(legacy.kind(), &RawKind::Task(made));
        let task = RawResult::read(r#"{"resultType":"task","taskId":"t2","status":"working","pollInterval":5}"#);
        let made = TaskMade { id: "t2".into(), ttl_ms: None, poll_ms: Some(5), legacy: false };
        assert_eq!(task.expect("reads").kind(), &RawKind::Task(made));
        let input = RawResult::read(r#"{"resultType":"input_required","requestState":"s"}"#).expect("reads");
        assert_eq!(input.kind(), &RawKind::InputRequired { state: "s".into() });
        for not in ["[]", "1", r#"{"isError":"yes"}"#, r#"{"task":{"status":"working"}}"#, "{"] {
            assert!(RawResult::read(not).is_err(), "{not}");
        }
    }

    #[test]
    fn an_edit_changes_only_what_it_says_and_nothing_passes_byte_for_byte() {
        let json = r#"{"content":[{"type":"text","text":"hi"}],"structuredContent":{"a": 1},"_meta":{"x":1}}"#;
        let result = RawResult::read(json).expect("reads");
        assert_eq!(RawEdit::default().apply(&result).expect("applies"), json, "untouched");
        let mut edit = RawEdit::default();
        edit.meta(&result).insert("io.github.mcp-ratelimit/cached".into(), true.into());
        edit.push_text("careful".into());
        edit.set_result_type(Some("complete"));
        let edited: Value = serde_json::from_str(&edit.apply(&result).expect("applies")).expect("JSON");
        assert_eq!(
            edited,
            serde_json::json!({
                "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "careful"}],
                "structuredContent": {"a": 1},
                "_meta": {"x": 1, "io.github.mcp-ratelimit/cached": true},
                "resultType": "complete",
            })
        );
        let mut emptied = RawEdit::default();
        emptied.meta(&result).clear();
        let edited: Value = serde_json::from_str(&emptied.apply(&result).expect("applies")).expect("JSON");
        assert!(edited.get("_meta").is_none(), "{edited}");
        assert_eq!(result.outcome(), Some(serde_json::json!({"a": 1})));
    }
}
