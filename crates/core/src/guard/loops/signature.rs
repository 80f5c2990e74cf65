//! Call signatures: the keyed hash of a tool name and its canonical JSON arguments, what makes
//! two calls "the same call", and the signature a tool's answers are counted under.

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// The signature of a tool's answers ([`Pattern::NoProgress`]): its stop matches every call of
/// the tool. It never equals a call's signature: a call's canonical form is the quoted name and
/// JSON arguments, and `#answers` is not JSON.
///
/// [`Pattern::NoProgress`]: super::Pattern::NoProgress
pub fn tool_signature(seed: u64, tool: &str) -> u128 {
    let mut text = String::new();
    push_json_string(&mut text, tool);
    text.push_str("#answers");
    xxh3_128_with_seed(text.as_bytes(), seed)
}

/// The xxh3-128, keyed by `seed`, of the tool name and the canonical arguments: what makes two
/// calls "the same call".
pub fn signature(seed: u64, tool: &str, args: &Value) -> u128 {
    xxh3_128_with_seed(canonical_call(tool, args).as_bytes(), seed)
}

/// The tool name, quoted, and the arguments as canonical JSON (keys sorted at every depth, no
/// whitespace): equal for two calls exactly when they are the same call. A quoted name ends
/// unambiguously, so no tool/arguments split can collide with another.
pub fn canonical_call(tool: &str, args: &Value) -> String {
    let mut text = String::new();
    push_json_string(&mut text, tool);
    push_canonical(&mut text, args);
    text
}

/// What is left to write while canonicalising.
enum Step<'a> {
    Value(&'a Value),
    Key(&'a str),
    Text(&'static str),
}

/// Appends `value` as canonical JSON: object keys sorted by their bytes at every depth, arrays
/// in order, no whitespace. Iterative, so a deeply nested argument cannot overflow the stack.
pub(super) fn push_canonical(out: &mut String, value: &Value) {
    let mut todo = vec![Step::Value(value)];
    while let Some(step) = todo.pop() {
        match step {
            Step::Text(text) => out.push_str(text),
            Step::Key(key) => {
                push_json_string(out, key);
                out.push(':');
            }
            Step::Value(Value::Null) => out.push_str("null"),
            Step::Value(Value::Bool(b)) => out.push_str(if *b { "true" } else { "false" }),
            Step::Value(Value::Number(n)) => out.push_str(&n.to_string()),
            Step::Value(Value::String(s)) => push_json_string(out, s),
            Step::Value(Value::Array(items)) => {
                out.push('[');
                todo.push(Step::Text("]"));
                for (i, item) in items.iter().enumerate().rev() {
                    todo.push(Step::Value(item));
                    if i > 0 {
                        todo.push(Step::Text(","));
                    }
                }
            }
            Step::Value(Value::Object(map)) => {
                out.push('{');
                todo.push(Step::Text("}"));
                // Sorted here, not trusted to the map: serde_json's order depends on its features.
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                for (i, (key, item)) in entries.into_iter().enumerate().rev() {
                    todo.push(Step::Value(item));
                    todo.push(Step::Key(key));
                    if i > 0 {
                        todo.push(Step::Text(","));
                    }
                }
            }
        }
    }
}

/// Appends `s` as a quoted JSON string.
fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    // The runs between characters that need escaping are copied whole; those are ASCII, so every
    // cut falls on a character boundary.
    let mut start = 0;
    for (i, byte) in s.bytes().enumerate() {
        let escaped = match byte {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b if b < 0x20 => "",
            _ => continue,
        };
        out.push_str(s.get(start..i).unwrap_or_default());
        if escaped.is_empty() {
            out.push_str(&format!("\\u{byte:04x}"));
        } else {
            out.push_str(escaped);
        }
        start = i + 1;
    }
    out.push_str(s.get(start..).unwrap_or_default());
    out.push('"');
}
