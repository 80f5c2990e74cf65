//! The binary and the examples as a user runs them: the command line, the examples in `examples/`,
//! `simulate`, and the soak (ignored here: `scripts/soak.sh` runs it).
//!
//! One test binary of modules (one per subject), so the crate is linked once for all of them.

// The shared helpers, one copy each in this binary.
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/otlp.rs"]
mod otlp;
#[path = "../common/process.rs"]
mod process;
#[path = "../common/python.rs"]
mod python;
#[path = "../common/redis.rs"]
mod test_redis;

mod cli;
mod examples;
mod simulate;
mod soak;
