//! `[tools.NAME] cost = "20 + 2 * max(0, seconds - 5)"`: a price that follows a call's arguments.
//!
//! A fixed cost over- or under-charges whenever the work depends on what was asked: a 30-second
//! video is not a 5-second one. A formula prices each call from its own arguments before it
//! runs; the guard reserves that many units in every budget the call draws on, and the price is
//! settled once the upstream says what it used ([`Settle`]).
//!
//! The formula is an [`evalexpr`] expression over the tool's arguments by name: numbers, strings
//! (`len(prompt)`) and booleans, with `+ - * / % ^`, comparisons, `if(c, a, b)`, `min`, `max`,
//! `floor`, `ceil`, `round`, `len` and `math::abs`/`sqrt`/`pow`/`ln`/`log`. Nothing else: no
//! assignment, no other function (`random` among them), so a price is a pure function of the
//! call. It is checked when the config is read, and clamped when it is used: a result is rounded
//! up to whole units and held to `[cost_min, cost_max]` (`cost_min` is 1 unless set: arguments an
//! agent chose, say a negative length a proxied server does not check, never price a paid call
//! at nothing), and a call it cannot price (an argument it reads is missing or of another kind, a
//! division by zero, an overflow) reserves `cost_max`, the most the config allows. The check that
//! every cost fits every budget reads `cost_max`.
//!
//! A formula is at most [`MAX_LEN`] bytes and nests brackets at most [`MAX_NESTING`] deep, checked
//! before evalexpr reads it: evalexpr parses, evaluates and drops an expression recursively, one
//! stack frame per level, so a formula 10,000 brackets deep overflowed a tokio worker's stack on
//! its first call (and a reload to it aborted the server). Within these bounds the deepest
//! expression there is (255 unary minus signs in a row) needs about 512 KiB of stack in a debug
//! build, a quarter of a tokio worker's.

use evalexpr::{ContextWithMutableVariables, DefaultNumericTypes, HashMapContext, Node, Operator, Value};
use serde::Deserialize;

/// The functions a price may call: pure arithmetic, nothing random, nothing that reads the world.
const FUNCTIONS: &[&str] = &[
    "if",
    "min",
    "max",
    "floor",
    "ceil",
    "round",
    "len",
    "math::abs",
    "math::sqrt",
    "math::pow",
    "math::ln",
    "math::log",
];

/// The longest formula, in bytes.
pub const MAX_LEN: usize = 256;

/// The deepest brackets may nest in a formula (a function's brackets count).
pub const MAX_NESTING: usize = 32;

/// A price over a call's arguments, checked when the config is read.
#[derive(Clone)]
pub struct Formula {
    text: String,
    tree: Node<DefaultNumericTypes>,
    /// The arguments it reads, each once.
    reads: Vec<String>,
}

impl std::fmt::Debug for Formula {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Formula").field(&self.text).finish()
    }
}

impl std::fmt::Display for Formula {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl Formula {
    /// Reads `text`, or says what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, String> {
        bounded(text)?;
        let tree = evalexpr::build_operator_tree::<DefaultNumericTypes>(text)
            .map_err(|e| format!("`{text}` is not a formula: {e}"))?;
        if let Some(how) = first_write(&tree) {
            return Err(format!("`{text}` {how}; a price only reads the call's arguments"));
        }
        if let Some(unknown) = tree.iter_function_identifiers().find(|f| !FUNCTIONS.contains(f)) {
            return Err(format!("`{text}` calls `{unknown}`; a price may call {}", FUNCTIONS.join(", ")));
        }
        let mut reads: Vec<String> = tree.iter_read_variable_identifiers().map(str::to_owned).collect();
        reads.sort_unstable();
        reads.dedup();
        Ok(Self { text: text.to_owned(), tree, reads })
    }

    /// The arguments it reads, by name.
    pub fn reads(&self) -> &[String] {
        &self.reads
    }

    /// The units a call with `args` reserves: the formula's value rounded up, held to
    /// `[least, most]`; `most` when it cannot be priced (see the module doc).
    pub fn units(&self, args: &serde_json::Value, (least, most): (u64, u64)) -> u64 {
        self.value(args).map_or(most, |units| units.clamp(least.min(most), most))
    }

    /// The formula's value for `args` in whole units (rounded up, at least 0), if it has one.
    fn value(&self, args: &serde_json::Value) -> Option<u64> {
        let mut context = HashMapContext::<DefaultNumericTypes>::new();
        for name in &self.reads {
            let value = match args.get(name)? {
                serde_json::Value::Number(n) => match n.as_i64() {
                    Some(int) => Value::from_int(int),
                    None => Value::from_float(n.as_f64()?),
                },
                serde_json::Value::String(s) => Value::from(s.clone()),
                serde_json::Value::Bool(b) => Value::from(*b),
                _ => return None,
            };
            context.set_value(name.clone(), value).ok()?;
        }
        match self.tree.eval_with_context(&context).ok()? {
            Value::Int(units) => Some(u64::try_from(units).unwrap_or(0)),
            Value::Float(units) if units.is_finite() => Some(if units <= 0.0 { 0 } else { units.ceil() as u64 }),
            _ => None,
        }
    }
}

/// Whether `text` is within [`MAX_LEN`] and [`MAX_NESTING`]: what evalexpr, which recurses, may
/// be given. Read byte by byte, without recursion, whatever its size.
fn bounded(text: &str) -> Result<(), String> {
    if text.len() > MAX_LEN {
        return Err(format!("a formula of {} bytes: a price formula may be at most {MAX_LEN} bytes long", text.len()));
    }
    let (mut depth, mut deepest) = (0usize, 0usize);
    for byte in text.bytes() {
        match byte {
            b'(' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b')' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    if deepest > MAX_NESTING {
        return Err(format!(
            "`{text}` nests brackets {deepest} deep: a price formula may nest them at most {MAX_NESTING} deep"
        ));
    }
    Ok(())
}

/// The first assignment or chain in `node`, said in words.
fn first_write(node: &Node<DefaultNumericTypes>) -> Option<&'static str> {
    let how = match node.operator() {
        Operator::Assign
        | Operator::AddAssign
        | Operator::SubAssign
        | Operator::MulAssign
        | Operator::DivAssign
        | Operator::ModAssign
        | Operator::ExpAssign
        | Operator::AndAssign
        | Operator::OrAssign
        | Operator::VariableIdentifierWrite { .. } => Some("assigns a variable"),
        Operator::Chain => Some("chains expressions with `;`"),
        _ => None,
    };
    how.or_else(|| node.children().iter().find_map(first_write))
}

/// `[tools.NAME] settle`: what a call is charged in the end. Either way a call whose work never
/// started (a job that never left the queue, a proxied call never sent) is charged nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Settle {
    /// What the upstream reports it used (`usage.units` in the answer), the difference refunded
    /// or charged; the reservation when it reports nothing (its refusal or failure included).
    /// The default for a server's own tools, whose upstream bills them.
    #[default]
    Usage,
    /// Always what was reserved, whatever the upstream reports. The default for a proxied
    /// server's tools ([`Settle::default_for`]): their answers are not ours to trust with a price
    /// (an `echo` would let the caller name its own).
    Reserved,
}

impl Settle {
    /// What a tool that says nothing settles by: a proxied server's (in a catalogue learnt at run
    /// time) by its reservation, unless the operator trusts its usage reports
    /// (`settle = "usage"`); any other server's tools by their usage.
    pub fn default_for(catalogue: &super::Catalogue) -> Self {
        if catalogue.is_learned() { Settle::Reserved } else { Settle::Usage }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_formula_prices_by_the_arguments_rounded_up_and_held_to_its_most() {
        let video = Formula::parse("20 + 2 * max(0, seconds - 5)").expect("parses");
        assert_eq!(video.reads(), ["seconds"]);
        assert_eq!(video.units(&json!({"seconds": 5}), (1, 80)), 20);
        assert_eq!(video.units(&json!({"seconds": 10}), (1, 80)), 30);
        assert_eq!(video.units(&json!({"seconds": 1000}), (1, 80)), 80, "held to cost_max");
        let prompt = Formula::parse("len(prompt) / 100.0").expect("parses");
        assert_eq!(prompt.units(&json!({"prompt": "x".repeat(101)}), (1, 50)), 2, "1.01 rounds up");
        let below = Formula::parse("seconds - 10").expect("parses");
        assert_eq!(below.units(&json!({"seconds": 3}), (1, 80)), 1, "never below cost_min");
        assert_eq!(below.units(&json!({"seconds": -1e9}), (1, 80)), 1, "whatever an agent sends");
        assert_eq!(below.units(&json!({"seconds": 3}), (0, 80)), 0, "free only where cost_min says so");
    }

    #[test]
    fn a_call_it_cannot_price_reserves_the_most() {
        let video = Formula::parse("20 + 2 * seconds").expect("parses");
        for args in [json!({}), json!({"seconds": "ten"}), json!({"seconds": null}), json!({"seconds": [1]})] {
            assert_eq!(video.units(&args, (1, 80)), 80, "{args}");
        }
        let huge = Formula::parse("seconds * 9223372036854775807").expect("parses");
        assert_eq!(huge.units(&json!({"seconds": 2}), (1, 80)), 80, "an overflow");
        assert_eq!(Formula::parse("1 / seconds").expect("parses").units(&json!({"seconds": 0}), (1, 7)), 7);
        assert_eq!(Formula::parse("10 ^ 400").expect("parses").units(&json!({}), (1, 9)), 9, "infinite");
        let boolean = Formula::parse("seconds > 3").expect("parses");
        assert_eq!(boolean.units(&json!({"seconds": 4}), (1, 9)), 9, "a boolean");
    }

    #[test]
    fn a_formula_too_long_or_too_deep_is_refused_before_it_is_parsed() {
        let deep = |n: usize| format!("{}1{}", "(".repeat(n), ")".repeat(n));
        let error = Formula::parse(&deep(200_000)).expect_err("200,000 deep");
        assert!(error.contains("400001 bytes") && error.contains("at most 256 bytes"), "{error}");
        assert!(error.len() < 200, "the formula is not repeated back: {error}");
        let error = Formula::parse(&deep(MAX_NESTING + 1)).expect_err("one too deep");
        assert!(error.contains("33 deep") && error.contains("at most 32 deep"), "{error}");
        assert!(Formula::parse(&deep(MAX_NESTING)).is_ok());
        assert!(Formula::parse(&format!("{}1", "-".repeat(MAX_LEN - 1))).is_ok(), "the longest");
        assert!(Formula::parse(&format!("{}1", "-".repeat(MAX_LEN))).is_err(), "one byte too long");
    }

    #[test]
    fn only_a_pure_reading_formula_is_accepted() {
        for (text, said) in [
            ("seconds = 3", "assigns"),
            ("a = 1; a", "chains"),
            ("(seconds = 1) + 2", "assigns"),
            ("1; 2", "chains"),
            ("random()", "calls `random`"),
            ("str::to_lowercase(prompt)", "calls"),
            ("(20 + seconds", "not a formula"),
        ] {
            let error = Formula::parse(text).expect_err(text);
            assert!(error.contains(said), "{text}: {error}");
        }
    }
}
