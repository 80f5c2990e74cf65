//! Checks of the repository itself: the README and the pages under `docs/` stay true to it.
//!
//! A test binary of modules, so a check of another file joins it without a link of its own.

// The shared helpers: the README's walk-through runs against a server of the tests' own.
#[path = "../common/mod.rs"]
mod common;

mod readme;
mod scripts;
