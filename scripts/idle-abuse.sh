#!/usr/bin/env bash
# Idle abuse at full size: 10,000 MCP sessions opened (one made-up key each) and left idle,
# 25 clients sending headers a byte at a time and 25 sending bodies a byte at a time, against
# a `serve` process with max_sessions = the session count; prints the memory per session, the
# 503s past the cap, when the idle sessions were reaped, when the slow clients were cut off,
# and a well-behaved caller's p50/p99 without and during the abuse. It is tests/idle_abuse.rs
# (which `make test` runs with 1,000 sessions) at another size, so it fails on the same bounds.
#
#   scripts/idle-abuse.sh [SESSIONS]      (default 10000)
#   MCP_RATELIMIT_BIN=target/release/mcp-ratelimit scripts/idle-abuse.sh   (serve from another build)
set -euo pipefail
cd "$(dirname "$0")/.."

export IDLE_ABUSE_SESSIONS=${1:-10000}
cargo test --test idle_abuse idle_sessions -- --nocapture 2>&1 | grep -v '^running\|^$'
