#!/usr/bin/env bash
# Drives mcp-ratelimit with the official MCP Inspector CLI: lists the tools and calls them
# over streamable HTTP and over stdio, checks that a burst ends in a refusal the agent can
# read, and calls `serve` and `proxy` (in front of server-everything) in both protocol eras
# (`--protocol-era legacy` and `modern`). Installs Node 22 and the Inspector from the npm
# registry into .tools/ on first use.
#
#   scripts/inspector.sh            # run the checks
#   scripts/inspector.sh --ui       # start the server and the Inspector web UI instead
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/lib.sh
ensure_npm_tool "@modelcontextprotocol/inspector@2.12.0" mcp-inspector

BIN=$(debug_bin)
PORT=$(free_port)
URL="http://127.0.0.1:$PORT/mcp"
LOG=$(mktemp)
# A roomy mock upstream and roomy in-flight caps, so the burst below meets the token budget
# rather than the job caps (the jobs check further down meets those on purpose).
start_server "$LOG" env MCP_RL__MOCK_UPSTREAM__MAX_CONCURRENT_PREDICTIONS=1000 \
  MCP_RL__LIMITS__IN_FLIGHT__CALLER=1000 MCP_RL__LIMITS__IN_FLIGHT__TENANT=1000 MCP_RL__LIMITS__IN_FLIGHT__ADDRESS=1000 --

if [ "${1:-}" = "--ui" ]; then
  echo "server: $URL (transport: Streamable HTTP). Opening the Inspector UI; Ctrl-C to stop."
  mcp-inspector
  exit 0
fi

inspect() { mcp-inspector --cli "$@"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

echo "== HTTP: tools/list"
tools=$(inspect "$URL" --transport http --method tools/list)
for t in list_articles save_article generate_image generate_image_to_video get_prediction cancel_prediction \
  rate_limit_status; do
  grep -q "\"$t\"" <<<"$tools" || fail "tool $t missing from tools/list over HTTP"
done
echo "seven tools listed"

echo "== HTTP: tools/call generate_image"
out=$(inspect "$URL" --transport http --header "Authorization: Bearer inspector-demo" \
  --method tools/call --tool-name generate_image --tool-args-json '{"prompt":"a lighthouse at dusk"}')
# The Inspector declares the MCP Tasks extension, so a job comes back as a task whose taskId is
# the predict_id (a client without the extension gets predict_id + next_poll_in_seconds).
grep -Eq '"(predict_id|taskId)"' <<<"$out" || fail "generate_image returned no predict_id or taskId: $out"
# The interval is what is left of the 2 s poll spacing when the task is read back (1998 ms on a busy
# machine), never more than 2000.
grep -Eq '"pollIntervalMs": ?(1[0-9]{3}|2000)([^0-9]|$)' <<<"$out" || grep -q '"next_poll_in_seconds"' <<<"$out" \
  || fail "generate_image returned no poll hint: $out"
# At most 400 bytes of it, by printf: `echo "$out" | head -c 400` exits 141 under pipefail when head
# closes the pipe before echo has written it all.
printf '%.400s\n' "$out"
# The first id in the answer, matched by the shell: no pipe a reader could close early (pipefail).
id=""
[[ $out =~ \"(predict_id|taskId)\":\ ?\"([A-Za-z0-9_-]+)\" ]] && id=${BASH_REMATCH[2]}

echo "== HTTP: cancel_prediction frees the job's slot"
out=$(inspect "$URL" --transport http --header "Authorization: Bearer inspector-demo" \
  --method tools/call --tool-name cancel_prediction --tool-args-json "{\"predict_id\":\"$id\"}")
grep -Eq '"status": ?"canceled"' <<<"$out" || fail "cancel_prediction did not cancel $id: $out"
printf '%.300s\n' "$out"

# first_refusal N TOKEN TOOL ARGS_TEMPLATE: calls TOOL up to N times (ARGS_TEMPLATE with %d for the
# attempt number) and prints the first isError result (the Inspector exits 5 for one).
first_refusal() {
  local n=$1 token=$2 tool=$3 template=$4 i out code
  for i in $(seq 1 "$n"); do
    set +e
    # shellcheck disable=SC2059 # the template is ours
    out=$(inspect "$URL" --transport http --header "Authorization: Bearer $token" \
      --method tools/call --tool-name "$tool" --tool-args-json "$(printf "$template" "$i")" 2>&1)
    code=$?
    set -e
    if [ $code -eq 5 ]; then echo "$out"; return; fi
  done
}

echo "== HTTP: a burst of image calls with one key ends in a refusal the agent can act on"
# Each CLI run takes ~1 s and a token comes back every second; the prompts differ, as a working
# agent's do, so this meets the budget and not loop detection.
refusal=$(first_refusal 30 inspector-burst generate_image '{"prompt":"variation %d"}')
[ -n "$refusal" ] || fail "no refusal after a burst"
grep -Eq '"code": ?"rate_limited"' <<<"$refusal" || fail "refusal lacks a code: $refusal"
grep -q 'retry_after_ms' <<<"$refusal" || fail "refusal lacks retry_after_ms: $refusal"
printf '%.400s\n' "$refusal"

echo "== HTTP: the same call five times in a row is stopped as a loop"
loop=$(first_refusal 5 inspector-loop list_articles '{"query":"agents"}')
grep -Eq '"code": ?"loop_detected"' <<<"$loop" || fail "no loop_detected after five identical calls: $loop"
printf '%.300s\n' "$loop"

echo "== stdio: tools/list (strict schema portability) and tools/call"
tools=$(inspect --method tools/list --strict -e RUST_LOG=warn -- "$BIN" stdio)
grep -q '"rate_limit_status"' <<<"$tools" || fail "tools/list over stdio"
out=$(inspect --method tools/call --tool-name list_articles --tool-args-json '{"limit":2}' -e RUST_LOG=warn -- "$BIN" stdio)
grep -q '"articles"' <<<"$out" || fail "list_articles over stdio: $out"
printf '%.300s\n' "$out"

echo "== HTTP, both protocol eras: serve answers a 2026-07-28 client as it answers a 2025-11-25 one"
for era in legacy modern; do
  out=$(inspect "$URL" --transport http --protocol-era "$era" --header "Authorization: Bearer inspector-$era" \
    --method tools/call --tool-name rate_limit_status --tool-args-json '{}')
  grep -q '"budgets"' <<<"$out" || fail "rate_limit_status with --protocol-era $era: $out"
  echo "$era: rate_limit_status answered"
done

echo "== the proxy in front of server-everything (stdio), both protocol eras"
scripts/proxy-fixtures.sh >/dev/null
EVERYTHING="$PWD/.tools/node/node_modules/@modelcontextprotocol/server-everything/dist/index.js"
PROXY_PORT=$(free_port)
PROXY_URL="http://127.0.0.1:$PROXY_PORT/mcp"
PROXY_LOG=$(mktemp)
RUST_LOG=warn "$BIN" proxy --listen "127.0.0.1:$PROXY_PORT" -- node "$EVERYTHING" stdio >"$PROXY_LOG" 2>&1 &
PROXY_PID=$!
trap 'kill "$PROXY_PID" 2>/dev/null || true; stop_server' EXIT
for _ in $(seq 1 200); do
  curl -fsS "http://127.0.0.1:$PROXY_PORT/health" >/dev/null 2>&1 && break
  sleep 0.05
done
for era in legacy modern; do
  out=$(inspect "$PROXY_URL" --transport http --protocol-era "$era" --method tools/call --tool-name echo \
    --tool-args-json "{\"message\":\"hello $era\"}") || fail "echo through the proxy, --protocol-era $era: $out"
  grep -q "Echo: hello $era" <<<"$out" || fail "echo through the proxy, --protocol-era $era: $out"
  out=$(inspect "$PROXY_URL" --transport http --protocol-era "$era" --method tools/call \
    --tool-name get-structured-content --tool-args-json '{"location":"Chicago"}') \
    || fail "get-structured-content through the proxy, --protocol-era $era: $out"
  grep -q '"conditions"' <<<"$out" || fail "get-structured-content through the proxy, --protocol-era $era: $out"
  echo "$era: the proxied server's answers read as they are"
done

echo "inspector checks passed"
