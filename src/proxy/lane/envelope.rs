//! JSON-RPC messages as the relay lane reads and writes them: the envelope only (`serde_json`
//! with borrowed fields), the rest left as the sender wrote it.

use std::borrow::Cow;
use std::collections::BTreeMap;

use rmcp::ErrorData;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// A JSON-RPC message, read to its envelope: a request (`method` and `id`), a notification
/// (`method` alone), or a response (`id` with `result` or `error`).
#[derive(Deserialize)]
pub(crate) struct Envelope<'a> {
    #[serde(borrow, default)]
    pub(crate) jsonrpc: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(crate) id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(crate) method: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(crate) params: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(crate) result: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(crate) error: Option<&'a RawValue>,
}

impl<'a> Envelope<'a> {
    /// `json` read to its envelope: `None` unless it is one JSON-RPC 2.0 object (a batch, or
    /// anything else, is not the lane's).
    pub(crate) fn read(json: &'a [u8]) -> Option<Self> {
        let starts = json.iter().find(|b| !b.is_ascii_whitespace());
        if starts != Some(&b'{') {
            return None;
        }
        let envelope: Self = serde_json::from_slice(json).ok()?;
        (envelope.jsonrpc.as_deref() == Some("2.0")).then_some(envelope)
    }
}

/// A request's `params`, each member as the sender wrote it.
pub(super) type Params<'a> = BTreeMap<Cow<'a, str>, &'a RawValue>;

/// `params` read to its members: `None` when it is not an object.
pub(super) fn params(params: Option<&RawValue>) -> Option<Params<'_>> {
    match params {
        Some(params) if params.get().trim_start().starts_with('{') => serde_json::from_str(params.get()).ok(),
        Some(_) => None,
        None => Some(Params::new()),
    }
}

/// The member `name` of `params` read as `T`: `None` when it is absent, `Some(Err)` when it is not
/// a `T`.
pub(super) fn member<T: serde::de::DeserializeOwned>(params: &Params<'_>, name: &str) -> Option<Result<T, ()>> {
    params.get(name).map(|raw| serde_json::from_str(raw.get()).map_err(drop))
}

/// A request's `_meta`: an empty one when it has none; `None` when it is not an object.
pub(super) fn meta(params: &Params<'_>) -> Option<Map<String, Value>> {
    match member::<Map<String, Value>>(params, "_meta") {
        None => Some(Map::new()),
        Some(meta) => meta.ok(),
    }
}

/// A request: `{"jsonrpc":"2.0","id":ID,"method":METHOD,"params":{…}}`, its params `params`
/// but for `_meta`, which is `meta` (when there is one).
pub(super) fn request<'p>(
    id: &str,
    method: &str,
    params: impl IntoIterator<Item = (&'p str, &'p RawValue)>,
    meta: Option<&Map<String, Value>>,
) -> Vec<u8> {
    let mut params: BTreeMap<&str, Cow<'_, RawValue>> =
        params.into_iter().filter(|(key, _)| *key != "_meta").map(|(key, value)| (key, Cow::Borrowed(value))).collect();
    if let Some(meta) = meta.filter(|meta| !meta.is_empty())
        && let Ok(meta) = serde_json::value::to_raw_value(meta)
    {
        params.insert("_meta", Cow::Owned(meta));
    }
    #[derive(serde::Serialize)]
    struct Request<'a, P> {
        jsonrpc: &'static str,
        id: &'a str,
        method: &'a str,
        params: P,
    }
    serde_json::to_vec(&Request { jsonrpc: "2.0", id, method, params }).unwrap_or_default()
}

/// `params` as the lane keeps them while a call waits for its turn.
pub(super) type OwnedParams = BTreeMap<String, Box<RawValue>>;

/// `params`, owned.
pub(super) fn owned(params: &Params<'_>) -> OwnedParams {
    params.iter().map(|(key, value)| (key.to_string(), (*value).to_owned())).collect()
}

/// A response to request `id` (as its sender wrote it): `result` (JSON).
pub(super) fn result(id: &RawValue, result: &str) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{},"result":{result}}}"#, id.get())
}

/// An error response to request `id` (as its sender wrote it).
pub(super) fn error(id: &RawValue, error: &ErrorData) -> String {
    let error =
        serde_json::to_string(error).unwrap_or_else(|_| r#"{"code":-32603,"message":"internal error"}"#.to_owned());
    format!(r#"{{"jsonrpc":"2.0","id":{},"error":{error}}}"#, id.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_one_json_rpc_object_is_an_envelope_and_its_params_pass_as_written() {
        for not in [&b"[]"[..], b"{}", br#"{"jsonrpc":"1.0","method":"x"}"#, b"{", b"  7"] {
            assert!(Envelope::read(not).is_none(), "{}", String::from_utf8_lossy(not));
        }
        let json = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"a\u0062","arguments":{"x": [1, 2]},"_meta":{"progressToken":"p"}}}"#;
        let envelope = Envelope::read(json).expect("an envelope");
        assert_eq!((envelope.id.map(RawValue::get), envelope.method.as_deref()), (Some("7"), Some("tools/call")));
        let params = params(envelope.params).expect("an object");
        assert_eq!(member::<String>(&params, "name"), Some(Ok("ab".to_owned())), "escapes read");
        assert_eq!(meta(&params).expect("meta")["progressToken"], "p");
        let mut ours = Map::new();
        ours.insert("traceparent".into(), "t".into());
        let members = params.iter().map(|(key, value)| (key.as_ref(), *value));
        let sent: Value =
            serde_json::from_slice(&request("mcp-rl-1", "tools/call", members, Some(&ours))).expect("JSON");
        assert_eq!(
            sent,
            serde_json::json!({"jsonrpc": "2.0", "id": "mcp-rl-1", "method": "tools/call",
                "params": {"name": "ab", "arguments": {"x": [1, 2]}, "_meta": {"traceparent": "t"}}})
        );
        assert!(super::params(RawValue::from_string("[1]".into()).ok().as_deref()).is_none());
    }
}
