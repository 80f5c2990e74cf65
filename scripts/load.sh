#!/usr/bin/env bash
# Load test: throughput and latency of `tools/call` through the whole server (HTTP layer,
# session, guard, tool), with the limits off, with the limits on but never refusing (in memory,
# then on a Redis store), and the cost of a refusal from the HTTP layer, all in one run on one
# build.
#
# The last run, GET /health, is the floor: the cheapest request this server (hyper, axum,
# the kernel's TCP) can answer; a 429 cannot cost less than that.
#
# The server is pinned to CPU 0 and wrk (Debian's package) to CPU 1, so the load generator
# does not steal the server's core. Besides wrk's figures, the server's own CPU time per
# request is read from /proc: that is what a refusal costs the server, whatever the client.
#
#   scripts/load.sh                  # 10 s per run, 16 connections
#   DURATION=30 CONNECTIONS=64 scripts/load.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
CONNECTIONS=${CONNECTIONS:-16}
SESSIONS_PER_RUN=${SESSIONS_PER_RUN:-16}

cargo build --release --quiet
. scripts/lib.sh
ensure_wrk
BIN="$(target_dir)/release/mcp-ratelimit"
CORES=$(nproc)
SERVER_CPU=0
WRK_CPU=$(( CORES > 1 ? 1 : 0 ))
TICKS=$(getconf CLK_TCK)

# run NAME SCRIPT [KEY=VALUE env overrides for the server...]
run() {
  local name=$1 script=$2; shift 2
  local port url pid sids="" before after result
  PORT=$(free_port)
  port=$PORT
  url="http://127.0.0.1:$port/mcp"
  RUST_LOG=error start_server /dev/null env "$@" taskset -c "$SERVER_CPU" --
  pid=$SERVER_PID
  TOKEN=load-test
  for _ in $(seq 1 "$SESSIONS_PER_RUN"); do
    local sid
    sid=$(open_session "$url" "$TOKEN")
    [ -n "$sid" ] && sids="$sids${sids:+,}$sid"
  done
  # A short warm-up, then the measured run.
  SESSIONS=$sids TOKEN=$TOKEN taskset -c "$WRK_CPU" wrk -t1 -c"$CONNECTIONS" -d2s -s "$script" "http://127.0.0.1:$port" >/dev/null 2>&1 || true
  before=$(cpu_ticks "$pid")
  result=$(SESSIONS=$sids TOKEN=$TOKEN taskset -c "$WRK_CPU" wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency \
    -s "$script" "http://127.0.0.1:$port" | grep '^RESULT')
  after=$(cpu_ticks "$pid")
  stop_server
  local requests
  requests=$(sed -E 's/.*requests=([0-9]+).*/\1/' <<<"$result")
  local cpu_us=$(( (after - before) * 1000000 / TICKS ))
  printf '%-44s %s cpu_us_per_request=%.1f\n' "$name" "${result#RESULT }" "$(awk -v c="$cpu_us" -v r="$requests" 'BEGIN { print (r > 0 ? c / r : 0) }')"
}

# Every limit the load's caller draws on, never refusing: its key is not configured, so its
# address's limits (limits.address, limits.address_http) apply to it too.
GENEROUS=("${GENEROUS_LIMITS[@]}" MCP_RL__TOOLS__RATE_LIMIT_STATUS__COST=1)

echo "mcp-ratelimit load test: $(nproc) cores, server on CPU $SERVER_CPU, wrk on CPU $WRK_CPU, ${CONNECTIONS} connections, ${DURATION}s per run"
echo "tool: rate_limit_status (no upstream call), charged 1 token in the 'on' runs"
CALL=scripts/load/tools_call.lua
# Off and on alternate, so drift in the machine (another tenant, thermal, caches) hits both alike.
for round in $(seq 1 "${ROUNDS:-2}"); do
  run "limits off (enabled=false), round $round" "$CALL" MCP_RL__LIMITS__ENABLED=false MCP_RL__TOOLS__RATE_LIMIT_STATUS__COST=1
  run "limits on, generous budget, round $round" "$CALL" "${GENEROUS[@]}"
done
# The same on the Redis store: every decision a round trip to a redis-server on the wrk core.
if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
  REDIS_PORT=$(free_port)
  taskset -c "$WRK_CPU" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
  REDIS_PID=$!
  for _ in $(seq 1 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
  run "limits on, generous budget, Redis store" "$CALL" "${GENEROUS[@]}" MCP_RL__STORE__BACKEND=redis \
    "MCP_RL__STORE__REDIS_URL=redis://127.0.0.1:$REDIS_PORT"
  kill "$REDIS_PID" 2>/dev/null || true
  wait "$REDIS_PID" 2>/dev/null || true
fi
run "refusals: every POST is a 429" scripts/load/static_ping.lua MCP_RL__LIMITS__HTTP__BURST=1 MCP_RL__LIMITS__HTTP__REFILL_PER_SEC=0.001
run "HTTP floor: GET /health" scripts/load/health.lua
