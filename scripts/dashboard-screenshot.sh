#!/usr/bin/env bash
# The picture of the live dashboard in docs/observability.md, docs/dashboard.png: runs the browser test
# (tests/server/dashboard.rs), which opens /dashboard in headless Chromium, has agents refused over MCP
# (a loop, an empty budget, a busy image) on the server's manual clock, and screenshots the page
# once it shows them; this copies that screenshot into docs/.
#
#   scripts/dashboard-screenshot.sh      # or: make dashboard-screenshot
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p docs
DASHBOARD_SCREENSHOT="$PWD/docs/dashboard.png" cargo test --quiet --test server -- \
  --exact dashboard::a_browser_sees_which_tool_is_refused_for_whom_and_why --nocapture
echo "wrote docs/dashboard.png"
