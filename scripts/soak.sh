#!/usr/bin/env bash
# The soak: three `serve` instances sharing one Redis (killed and restarted every 2 minutes,
# at least once), one `mock-upstream` answering 5 % of requests 429 and 5 % 503, and 50
# callers offering about twice their budget with a mix of every tool. Prints a report — panics,
# each instance's RSS after the warm-up and at the end, cost admitted per caller against its
# budget (and what the insurance limiter let through while Redis was down, apart),
# predictions never final, in-flight slots still held, refusals by code and by tool, p50/p99
# of tool calls — and fails on any violated bound. It is tests/binary/soak.rs, run on the debug build
# `make test` made (ignored there); CI runs `scripts/soak.sh --minutes 1`.
#
#   scripts/soak.sh [--minutes N]      (default 10; needs redis-server)
set -euo pipefail
cd "$(dirname "$0")/.."

minutes=10
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes=${2:?--minutes needs a number}; shift 2 ;;
    --minutes=*) minutes=${1#--minutes=}; shift ;;
    *) echo "usage: scripts/soak.sh [--minutes N]" >&2; exit 2 ;;
  esac
done
command -v redis-server >/dev/null || { echo "needs redis-server (apt-get install redis-server)" >&2; exit 1; }
SOAK_MINUTES=$minutes cargo test --test binary soak:: -- --ignored --nocapture 2>&1 | grep -v '^running\|^$'
