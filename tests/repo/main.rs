//! Checks of the repository itself: the README and the pages under `docs/` stay true to it.
//!
//! A test binary of modules, so a check of another file joins it without a link of its own.

mod readme;
