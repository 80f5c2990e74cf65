#!/usr/bin/env bash
# Instructions the server spends on a served `tools/call`, counted by callgrind: the same count
# for the same binary and load whatever else the machine does, where calls/s on a shared 2-vCPU
# machine drift by a fifth between rounds. Blind to the kernel and to waiting, so read it beside
# scripts/bench-compare.sh's CPU and calls/s, not instead of them.
#
# The release binary runs under `valgrind --tool=callgrind`, loaded as bench-compare loads it (a
# caller with a made-up bearer token, GENEROUS_LIMITS, 16 MCP sessions over 16 connections, pages
# of list_articles): counters zeroed after a WARMUP, dumped after DURATION seconds, and divided by
# the calls wrk counted in between. Per scenario:
#   memory   the memory store
#   redis    a redis-server this script starts on a free port
# LOOPS=false turns loop detection off. Under valgrind the server runs about 50 times slower, so
# the store timeout is 5 s (else Redis seems down) and wrk waits 10 s for an answer.
#
#   scripts/instructions.sh                  # both scenarios, loop detection on
#   SCENARIOS=redis LOOPS=false DURATION=20 scripts/instructions.sh
#   BIN=/path/to/mcp-ratelimit scripts/instructions.sh      # another build (bench-compare keeps them)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

SCENARIOS=${SCENARIOS:-memory redis}
LOOPS=${LOOPS:-true}
DURATION=${DURATION:-15}
WARMUP=${WARMUP:-5}
case $LOOPS in true | false) ;; *) echo "LOOPS is true or false, not '$LOOPS'" >&2; exit 2 ;; esac
for scenario in $SCENARIOS; do
  case $scenario in memory | redis) ;; *) echo "unknown scenario '$scenario' (memory redis)" >&2; exit 2 ;; esac
done
for tool in valgrind callgrind_control callgrind_annotate; do
  command -v "$tool" >/dev/null || { echo "needs $tool (apt-get install valgrind)" >&2; exit 2; }
done
ensure_wrk
if [[ " $SCENARIOS " == *" redis "* ]] && ! command -v redis-server >/dev/null; then
  echo "needs redis-server (apt-get install redis-server)" >&2
  exit 2
fi
if [ -z "${BIN:-}" ]; then
  cargo build --release --quiet
  BIN="$(target_dir)/release/mcp-ratelimit"
fi
SERVER=$BIN

WORK=$(mktemp -d)
REDIS_PID=""
cleanup() {
  stop_server
  [ -n "$REDIS_PID" ] && kill "$REDIS_PID" 2>/dev/null && wait "$REDIS_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
: >"$WORK/empty.toml"
export TOOL=list_articles TOKEN=instructions-made-up-key
ARGUMENTS=$(seq -s '|' -f '{"cursor":"%g"}' 0 10 100)
export ARGUMENTS

echo "instructions a served tools/call costs $SERVER (loop detection $LOOPS, ${WARMUP}s warm-up, ${DURATION}s counted)"
for scenario in $SCENARIOS; do
  overrides=("${GENEROUS_LIMITS[@]}" "MCP_RL__LOOP_DETECTION__ENABLED=$LOOPS")
  if [ "$scenario" = redis ]; then
    redis_port=$(free_port)
    redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >"$WORK/redis.log" 2>&1 &
    REDIS_PID=$!
    for _ in $(seq 1 100); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.05; done
    overrides+=(MCP_RL__STORE__BACKEND=redis "MCP_RL__STORE__REDIS_URL=redis://127.0.0.1:$redis_port"
      MCP_RL__STORE__TIMEOUT_MS=5000)
  fi
  out="$WORK/callgrind.$scenario"
  printf '#!/bin/sh\nexec valgrind --tool=callgrind --callgrind-out-file=%s %s "$@"\n' "$out" "$SERVER" >"$WORK/under-valgrind"
  chmod +x "$WORK/under-valgrind"
  BIN="$WORK/under-valgrind"
  PORT=$(free_port)
  RUST_LOG=error start_server "$WORK/server.log" env "${overrides[@]}" -- --config "$WORK/empty.toml"
  url="http://127.0.0.1:$PORT"
  sessions=""
  for _ in $(seq 1 16); do sessions="$sessions${sessions:+,}$(open_session "$url/mcp" "$TOKEN")"; done
  SESSIONS=$sessions wrk -t1 -c16 -d"${WARMUP}s" --timeout 10s -s scripts/load/tools_call.lua "$url" >/dev/null 2>&1 || true
  callgrind_control -z "$SERVER_PID" >/dev/null 2>&1
  result=$(SESSIONS=$sessions wrk -t1 -c16 -d"${DURATION}s" --timeout 10s -s scripts/load/tools_call.lua "$url")
  callgrind_control -d "$SERVER_PID" >/dev/null 2>&1
  calls=$(sed -nE 's/^RESULT .* requests=([0-9]+).*/\1/p' <<<"$result")
  failed=$(sed -nE 's/^RESULT .* non_2xx=([0-9]+) errors=([0-9]+).*/\1 \2/p' <<<"$result")
  stop_server
  if [ -n "$REDIS_PID" ]; then kill "$REDIS_PID"; wait "$REDIS_PID" 2>/dev/null || true; REDIS_PID=""; fi
  # The dump callgrind_control asked for (the counters since the zeroing), not the one at exit.
  dump=$(find "$WORK" -name "callgrind.$scenario.*" | sort | tail -n 1)
  [ -n "$dump" ] && [ -n "$calls" ] && [ "$calls" -gt 0 ] ||
    { echo "$scenario: no dump or no calls counted"; cat "$WORK/server.log"; exit 1; } >&2
  total=$(callgrind_annotate "$dump" | sed -nE 's/^ *([0-9,]+) .*PROGRAM TOTALS.*/\1/p' | tr -d ,)
  printf '%-7s %9d instructions a call  (%d calls; non-2xx and socket errors: %s)\n' \
    "$scenario" "$((total / calls))" "$calls" "${failed:-?}"
done
