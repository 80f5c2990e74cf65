#!/usr/bin/env bash
# Fires a burst of 150 JSON-RPC POSTs at an MCP server over streamable HTTP and shows how the
# coarse per-caller HTTP limit answers: one `initialize` (its Mcp-Session-Id is kept), one
# `notifications/initialized`, then `ping`s on that session until 150 POSTs were sent. Prints a
# histogram of HTTP status codes, what the 200s carried (results or JSON-RPC errors, e.g. the
# per-method limit on ping), and the rate-limit headers of the first 429.
#
#   scripts/burst.sh                              # against http://127.0.0.1:3000/mcp (make run)
#   scripts/burst.sh http://127.0.0.1:3000/mcp    # against another URL
#   TOKEN=secret scripts/burst.sh URL             # as the caller of that key (Authorization: Bearer)
#   scripts/burst.sh --start                      # builds and starts its own server on a free
#                                                 # port with the default limits, then stops it
#
# With the default limits (HTTP burst 120, 2/s refill) expect 120 answered POSTs and 30 x 429.
# The pings go out from one curl process, eight at a time, so the burst takes well under the
# 0.5 s in which a token is refilled. Each POST asks for `Connection: close`, so the timing does
# not hang on the server's socket options: without TCP_NODELAY every SSE answer on a reused
# keep-alive connection ends ~40 ms late (Nagle meets delayed ACK), and the burst takes ~6 s.
# Needs curl (and python3 and cargo for --start).
set -euo pipefail
cd "$(dirname "$0")/.."

TOTAL=150
PROTOCOL=2025-11-25

. scripts/lib.sh
work=$(mktemp -d)
trap 'stop_server; rm -rf "$work"' EXIT

if [ "${1:-}" = "--start" ]; then
  shift
  BIN=$(debug_bin)
  PORT=$(free_port)
  start_server "$work/server.log" --
  trap 'stop_server; rm -rf "$work"' EXIT
  URL="http://127.0.0.1:$PORT/mcp"
  echo "started $BIN on 127.0.0.1:$PORT (default limits)"
else
  URL=${1:-http://127.0.0.1:3000/mcp}
fi

# One curl config entry per POST: the headers, the body, where the answer goes, and the status.
# $1 = index, $2 = JSON body, $3 = session id (may be empty).
entry() {
  local i=$1 body=$2 session=$3
  body=${body//\\/\\\\}
  body=${body//\"/\\\"}
  echo "url = \"$URL\""
  echo 'header = "Content-Type: application/json"'
  echo 'header = "Accept: application/json, text/event-stream"'
  echo 'header = "Connection: close"'
  echo "header = \"MCP-Protocol-Version: $PROTOCOL\""
  [ -n "$session" ] && echo "header = \"Mcp-Session-Id: $session\""
  [ -n "${TOKEN:-}" ] && echo "header = \"Authorization: Bearer $TOKEN\""
  echo "data = \"$body\""
  echo "output = \"$work/body.$i\""
  echo "dump-header = \"$work/head.$i\""
  echo "write-out = \"$i %{http_code}\\n\""
  echo 'max-time = 10'
}

started=$(date +%s.%N)
entry 1 "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"initialize\",\"params\":{\"protocolVersion\":\"$PROTOCOL\",\"capabilities\":{},\"clientInfo\":{\"name\":\"burst.sh\",\"version\":\"1\"}}}" "" >"$work/init.cfg"
curl -sS -K "$work/init.cfg" >"$work/done"
# The first Mcp-Session-Id, read by one awk to the end of the file: no pipe whose reader stops
# early (head -n 1), which can kill the writer with SIGPIPE and pipefail the script.
session=$(awk 'tolower($0) ~ /^mcp-session-id:/ && !found { sub(/\r$/, ""); sub(/^[^:]*: */, ""); print; found = 1 }' "$work/head.1")
if [ -z "$session" ]; then
  echo "initialize returned no Mcp-Session-Id (HTTP $(cut -d' ' -f2 "$work/done")):" >&2
  cat "$work/head.1" "$work/body.1" >&2
  exit 1
fi

entry 2 '{"jsonrpc":"2.0","method":"notifications/initialized"}' "$session" >"$work/notify.cfg"
curl -sS -K "$work/notify.cfg" >>"$work/done" || true  # a failed transfer shows up as status 000
for i in $(seq 3 "$TOTAL"); do
  [ "$i" -gt 3 ] && echo next
  entry "$i" "{\"jsonrpc\":\"2.0\",\"id\":$i,\"method\":\"ping\"}" "$session"
done >"$work/pings.cfg"
# Eight at a time, so that the burst stays short on a slow machine too. Lines of "$work/done"
# ("POST-number status") are in completion order: "first" below means first answered.
curl --no-progress-meter --parallel --parallel-max 8 -K "$work/pings.cfg" >>"$work/done" || true
elapsed=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')

sent=$(wc -l <"$work/done")
refused=$(awk '$2 == 429' "$work/done" | wc -l)
echo "$sent POSTs to $URL in ${elapsed}s (session $session)"
echo "HTTP status histogram:"
awk '{print $2}' "$work/done" | sort | uniq -c | awk '{printf "  %s: %d\n", $2, $1}'
echo "  not 429: $((sent - refused)), 429: $refused"

# What the answered pings carried: a result, or a JSON-RPC error (e.g. the per-method limit).
ok=0; errors=0; first_error=""
while read -r i code; do
  [ "$i" -ge 3 ] && [ "$code" = 200 ] || continue
  if grep -q '"error"' "$work/body.$i"; then
    errors=$((errors + 1)); first_error=${first_error:-$i}
  else
    ok=$((ok + 1))
  fi
done <"$work/done"
echo "pings answered with HTTP 200: $ok results, $errors JSON-RPC errors"
if [ -n "$first_error" ]; then
  echo "first JSON-RPC error (POST #$first_error):"
  grep -m1 -o '{"jsonrpc".*' "$work/body.$first_error" | cut -c1-400 | sed 's/^/  /'
fi

first=$(awk '$2 == 429 { print $1; exit }' "$work/done")
if [ -n "$first" ]; then
  echo "first 429 (POST #$first):"
  tr -d '\r' <"$work/head.$first" | grep -iE '^(retry-after|ratelimit-policy|ratelimit|ratelimit-remaining):' | sed 's/^/  /'
  printf '  body: %.300s\n' "$(cat "$work/body.$first")"
else
  echo "no 429 in $sent POSTs"
fi
