//! Progress: what an answer says, for telling whether a tool keeps giving a caller the same one
//! ([`crate::guard::loops`]).
//!
//! Two answers are the same when their canonical JSON is, once what changes on every call without
//! saying anything new is left out: the **volatile fields**, object keys named in
//! `volatile_fields` (timestamps, request ids), at any depth — also inside a text that is itself
//! JSON (a tool without structured output often answers with a JSON document as text).
//!
//! Nothing else is guessed at: an answer that echoes its query in prose ("No results for
//! “zebras”") differs from one query to the next. Taking the arguments' words out of answers
//! would make every acknowledgement of a write that names what it wrote ("Created notes.md")
//! the same answer; a tool that wants its empty answers compared answers in structured content.
//!
//! Keys are sorted at every depth, as for call signatures; the hash is the keyed xxh3-128 of an
//! unambiguous encoding of what is left (no JSON text is written: it is fed to the hasher as it
//! is walked). The walk is iterative, so a deeply nested answer cannot overflow the stack.

use std::borrow::Cow;

use serde_json::Value;
use xxhash_rust::xxh3::Xxh3;

/// The hash, keyed by `seed`, of what `answer` says, `volatile` fields left out: equal for two
/// answers exactly when they say the same.
pub fn answer_hash(seed: u64, answer: &Value, volatile: &[String]) -> u128 {
    let mut hasher = Xxh3::with_seed(seed);
    feed(&mut hasher, answer, volatile);
    hasher.digest128()
}

/// What is left to feed the hasher.
enum Step<'a> {
    Value(Cow<'a, Value>),
    Key(&'a str),
    Mark(u8),
}

/// Feeds `hasher` what `value` says, in an encoding that is unambiguous without escaping
/// anything: a tag byte per value, strings and keys by their length and bytes, numbers by their
/// kind and bits, containers closed by a mark; object keys sorted, `volatile` keys left out, and
/// a string that is a JSON object or array read as that JSON. No text is built: the bytes go to
/// the hasher as they are found.
fn feed(hasher: &mut Xxh3, value: &Value, volatile: &[String]) {
    let mut todo = vec![Step::Value(Cow::Borrowed(value))];
    while let Some(step) = todo.pop() {
        match step {
            Step::Mark(mark) => hasher.update(&[mark]),
            Step::Key(key) => bytes(hasher, b'k', key),
            Step::Value(Cow::Borrowed(value)) => feed_value(hasher, value, &mut todo, volatile),
            // A parsed text owns what it holds: fed whole here (its depth is bounded by the
            // parser's recursion limit, and each level of JSON inside a string needs its quotes
            // escaped again, so few levels fit in any answer).
            Step::Value(Cow::Owned(value)) => feed(hasher, &value, volatile),
        }
    }
}

/// `text` as a tag, its length and its bytes.
fn bytes(hasher: &mut Xxh3, tag: u8, text: &str) {
    hasher.update(&[tag]);
    hasher.update(&(text.len() as u64).to_le_bytes());
    hasher.update(text.as_bytes());
}

/// One value of [`feed`]: a scalar fed, a container's parts pushed on `todo` (last first).
fn feed_value<'a>(hasher: &mut Xxh3, value: &'a Value, todo: &mut Vec<Step<'a>>, volatile: &[String]) {
    match value {
        Value::Null => hasher.update(b"n"),
        Value::Bool(b) => hasher.update(if *b { b"t" } else { b"f" }),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                hasher.update(b"u");
                hasher.update(&u.to_le_bytes());
            } else if let Some(i) = n.as_i64() {
                hasher.update(b"i");
                hasher.update(&i.to_le_bytes());
            } else {
                hasher.update(b"d");
                hasher.update(&n.as_f64().unwrap_or(f64::NAN).to_bits().to_le_bytes());
            }
        }
        Value::String(s) => match json_text(s) {
            Some(parsed) => todo.push(Step::Value(Cow::Owned(parsed))),
            None => bytes(hasher, b's', s),
        },
        Value::Array(items) => {
            hasher.update(b"[");
            todo.push(Step::Mark(b']'));
            todo.extend(items.iter().rev().map(|item| Step::Value(Cow::Borrowed(item))));
        }
        Value::Object(map) => {
            hasher.update(b"{");
            todo.push(Step::Mark(b'}'));
            let kept = |(key, _): &(&String, &Value)| !volatile.iter().any(|v| v == *key);
            let mut push = |(key, item): (&'a String, &'a Value)| {
                todo.push(Step::Value(Cow::Borrowed(item)));
                todo.push(Step::Key(key));
            };
            if map.keys().is_sorted() {
                // A map that keeps its keys sorted (serde_json's default): no copy to sort.
                map.iter().rev().filter(kept).for_each(&mut push);
            } else {
                let mut entries: Vec<_> = map.iter().filter(kept).collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                entries.into_iter().rev().for_each(&mut push);
            }
        }
    }
}

/// `text` as JSON, when it is a JSON object or array (whitespace around it allowed).
fn json_text(text: &str) -> Option<Value> {
    let trimmed = text.trim();
    if !(trimmed.starts_with('{') || trimmed.starts_with('[')) {
        return None;
    }
    serde_json::from_str::<Value>(trimmed).ok().filter(|v| v.is_object() || v.is_array())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn hash(answer: &Value) -> u128 {
        let volatile = vec!["timestamp".to_owned(), "request_id".to_owned()];
        answer_hash(7, answer, &volatile)
    }

    #[test]
    fn volatile_fields_are_left_out_at_any_depth_and_inside_json_text() {
        let a = json!({"results": [], "meta": {"timestamp": "2026-12-04T05:00:00Z", "request_id": "r1"}});
        let b = json!({"meta": {"request_id": "r2", "timestamp": "2026-12-04T05:00:07Z"}, "results": []});
        assert_eq!(hash(&a), hash(&b));
        let text = |t: &str, id: &str| json!([{"type": "text", "text": format!(r#"{{"hits": 0, "timestamp": "{t}", "request_id": "{id}"}}"#)}]);
        assert_eq!(hash(&text("1", "x")), hash(&text("2", "y")));
        let moved = json!({"results": [{"title": "new"}], "meta": {"timestamp": "t"}});
        assert_ne!(hash(&a), hash(&moved), "a real change is progress");
    }

    #[test]
    fn prose_is_compared_as_it_is() {
        let none = |q: &str| json!([{"type": "text", "text": format!("No results for \"{q}\".")}]);
        assert_ne!(hash(&none("zebras")), hash(&none("migrating zebras")), "no guessing at echoes");
        assert_eq!(hash(&none("zebras")), hash(&none("zebras")));
    }

    #[test]
    fn key_order_and_seed() {
        assert_eq!(
            hash(&json!({"a": 1, "b": [2, {"d": 3, "c": 4}]})),
            hash(&json!({"b": [2, {"c": 4, "d": 3}], "a": 1}))
        );
        assert_ne!(answer_hash(1, &json!(1), &[]), answer_hash(2, &json!(1), &[]));
        // Scalars are told apart from strings that look like them.
        assert_ne!(hash(&json!(1)), hash(&json!("1")));
    }

    #[test]
    fn a_deeply_nested_answer_does_not_overflow_the_stack() {
        // Deeper than any answer off the wire (serde_json stops at 128 levels).
        let mut deep = json!(0);
        for _ in 0..1_000 {
            deep = json!([deep]);
        }
        let _ = hash(&deep);
        let mut text = String::new();
        for _ in 0..10_000 {
            text.push('[');
        }
        let _ = hash(&json!(text));
    }
}
