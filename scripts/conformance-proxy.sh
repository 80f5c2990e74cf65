#!/usr/bin/env bash
# The official MCP conformance suite (server mode) against an MCP server nobody here wrote, twice,
# each time a fresh instance over streamable HTTP: once directly, once through
# `mcp-ratelimit proxy` with the default limits. Every scenario that passes directly must pass
# through the proxy, except those listed in KNOWN below with their reason; and the proxy must
# refuse the suite (a legitimate client) nothing. Two passes, one per protocol era on both sides:
#
#   2025-11-25  the suite 0.1.16 against the official "everything" server
#               (@modelcontextprotocol/server-everything, TypeScript SDK 1.x: the proxy's client
#               falls back to the 2025-11-25 handshake with it)
#   2026-07-28  the suite 0.2.0-alpha.12 with `--requirements 2026-07-28` against the tests'
#               FastMCP server (tests/fixtures/fastmcp_server.py), which speaks 2026-07-28, as the
#               proxy's client then does to it
#
#   scripts/conformance-proxy.sh
#
# Installs what it needs into .tools/ on first use (scripts/proxy-fixtures.sh and the suites).
set -euo pipefail
cd "$(dirname "$0")/.."

CONFORMANCE_VERSION="0.1.16"
CONFORMANCE_2026_VERSION="0.2.0-alpha.12"
# Scenarios that pass directly and not through the proxy, on purpose.
declare -A KNOWN=(
  # The suite calls tools neither server has (test_simple_text, test_error_handling). Both
  # answer an unknown tool with an isError *result*, which these scenarios accept (a vacuous
  # pass: see scripts/conformance-baseline.yml); the proxy answers the JSON-RPC error -32602 the
  # MCP spec gives for an unknown tool, without asking the proxied server or charging a budget
  # for a name it never listed (an invented name buys nothing).
  [tools-call-simple-text]="unknown tool: the proxy's -32602, not the server's in-band isError"
  [tools-call-error]="unknown tool: the proxy's -32602, not the server's in-band isError"
)

started=$(date +%s.%N)
. scripts/lib.sh
scripts/proxy-fixtures.sh >/dev/null
ensure_npm_tool "@modelcontextprotocol/conformance@$CONFORMANCE_VERSION" conformance
# The 2026-07-28 suite is the same package at another version: a prefix of its own.
SUITE_2026=".tools/conformance-2026"
if ! grep -q "\"version\": *\"$CONFORMANCE_2026_VERSION\"" "$SUITE_2026/node_modules/@modelcontextprotocol/conformance/package.json" 2>/dev/null; then
  echo "installing @modelcontextprotocol/conformance@$CONFORMANCE_2026_VERSION into $SUITE_2026"
  npm install --prefix "$SUITE_2026" --save-exact --no-audit --no-fund --loglevel=error \
    "@modelcontextprotocol/conformance@$CONFORMANCE_2026_VERSION" >/dev/null
fi
CONFORMANCE_2026="$PWD/$SUITE_2026/node_modules/.bin/conformance"
EVERYTHING="$PWD/.tools/node/node_modules/@modelcontextprotocol/server-everything/dist/index.js"
FASTMCP=("$PWD/.tools/python/bin/python" "$PWD/tests/fixtures/fastmcp_server.py")
BIN=$(debug_bin)
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# listening PORT LOG WHAT: waits (30 s at most) until PORT accepts connections.
listening() {
  for _ in $(seq 1 600); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "$3 did not listen on $1:"; cat "$2"; return 1
}

# upstream KIND PORT LOG: a fresh proxied server (everything or fastmcp) on PORT.
upstream() {
  case $1 in
    everything) PORT=$2 node "$EVERYTHING" streamableHttp >"$3" 2>&1 & ;;
    fastmcp) "${FASTMCP[@]}" http "$2" >"$3" 2>&1 & ;;
  esac
  pids+=($!)
  listening "$2" "$3" "$1"
}

# suite SUITE-COMMAND URL NAME: runs it, leaves "scenario passed failed" lines in $work/NAME.scores.
suite() {
  local run=$1 url=$2 name=$3
  $run --url "$url" -o "$work/$name" >"$work/$name.out" 2>&1 || true
  sed -nE 's/^[^ ]+ ([a-z0-9-]+): ([0-9]+) passed, ([0-9]+) failed.*/\1 \2 \3/p' "$work/$name.out" >"$work/$name.scores"
  if [ ! -s "$work/$name.scores" ]; then
    echo "FAIL: the suite gave no scores against $url:"; cat "$work/$name.out"; exit 1
  fi
}

status=0
# compare NAME: every scenario that passed directly passed through the proxy (or is KNOWN), and
# no KNOWN one passes through it now.
compare() {
  local name=$1 passed=0
  while read -r scenario ok failed; do
    [ "$failed" = 0 ] && [ "$ok" -gt 0 ] || continue
    passed=$((passed + 1))
    through=$(awk -v s="$scenario" '$1 == s { print $2, $3 }' "$work/$name-proxy.scores")
    if [[ $through =~ ^[1-9][0-9]*\ 0$ ]]; then
      echo "  pass both ways: $scenario"
    elif [ -n "${KNOWN[$scenario]:-}" ]; then
      echo "  known: $scenario (${KNOWN[$scenario]})"
    else
      echo "FAIL: $scenario passes directly ($ok checks) but not through the proxy (${through:-not run})"
      status=1
    fi
  done <"$work/$name-direct.scores"
  for scenario in "${!KNOWN[@]}"; do
    if awk -v s="$scenario" '$1 == s && $3 == 0 && $2 > 0 { found = 1 } END { exit !found }' "$work/$name-proxy.scores"; then
      echo "FAIL: $scenario now passes through the proxy: remove it from KNOWN"
      status=1
    fi
  done
  echo "$name: $passed scenarios pass directly"
}

# pass NAME KIND SUITE-COMMAND: the suite against a fresh KIND directly, then through a fresh proxy
# in front of another fresh KIND; compared.
proxies=()
pass() {
  local name=$1 kind=$2 run=$3
  local direct behind port
  direct=$(free_port)
  upstream "$kind" "$direct" "$work/$name-upstream-direct.log"
  echo "== $name: $run against $kind directly (http://127.0.0.1:$direct/mcp)"
  suite "$run" "http://127.0.0.1:$direct/mcp" "$name-direct"
  behind=$(free_port)
  upstream "$kind" "$behind" "$work/$name-upstream-behind.log"
  port=$(free_port)
  # Its own working directory: no ./config.toml, so every limit is the default one.
  (cd "$work" && RUST_LOG=warn exec "$BIN" proxy --listen "127.0.0.1:$port" --upstream "http://127.0.0.1:$behind/mcp") \
    >"$work/$name-proxy.log" 2>&1 &
  pids+=($!)
  proxies+=("$port")
  for _ in $(seq 1 200); do
    curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 0.05
  done
  echo "   ... and through mcp-ratelimit proxy (http://127.0.0.1:$port/mcp)"
  suite "$run" "http://127.0.0.1:$port/mcp" "$name-proxy"
  compare "$name"
}

pass 2025-11-25 everything "conformance server"
pass 2026-07-28 fastmcp "$CONFORMANCE_2026 server --requirements 2026-07-28"

for port in "${proxies[@]}"; do
  rejections=$(curl -fsS "http://127.0.0.1:$port/metrics" | grep '^mcp_ratelimit_rejections_total' | awk '$NF > 0' || true)
  if [ -n "$rejections" ]; then
    echo "FAIL: the proxy on $port refused the conformance client:"; sed 's/^/  /' <<<"$rejections"; status=1
  fi
done
if [ "$status" -eq 0 ]; then
  echo "conformance through the proxy, both eras: every scenario that passes directly passes through it, but the ${#KNOWN[@]} known ones; nothing refused ($(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')s)"
else
  for log in "$work"/*-proxy.log; do echo "--- $log"; tail -n 30 "$log"; done
  echo "conformance through the proxy FAILED"
fi
exit "$status"
