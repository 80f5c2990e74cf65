#!/usr/bin/env bash
# What `mcp-ratelimit proxy` costs per call: a fast upstream MCP server alone, and the same
# upstream behind the proxy, back to back in one run on one build, through the same wrk load.
#
# The upstream is `mcp-ratelimit serve` with its limits off, answering `rate_limit_status` (no
# upstream call of its own): about the fastest MCP tool call an rmcp server answers. The proxy
# runs the default limits, made generous so nothing is refused (the whole guard decides every
# call) and with loop detection off (the load repeats one call; a real agent that did would be
# refused). Every server process is pinned to CPU 0 and wrk to CPU 1: both runs get the same one
# core for everything server-side, so the ratio of their throughputs is the ratio of the time
# a call costs — the upstream's own, then the upstream's plus the proxy's.
#
# UPSTREAM=fastmcp (the tests' FastMCP server over streamable HTTP, tool `add`) or
# UPSTREAM=everything (@modelcontextprotocol/server-everything, tool `echo`) measure the same in
# front of a Python or a TypeScript server instead (installed by scripts/proxy-fixtures.sh).
#
#   scripts/bench-proxy.sh                  # 10 s per run, 16 connections, 2 rounds
#   DURATION=30 CONNECTIONS=64 ROUNDS=3 UPSTREAM=fastmcp scripts/bench-proxy.sh
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
WRK_CPU=$(( CORES > 1 ? 1 : 0 ))
work=$(mktemp -d)
pids=()
stop_all() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT

GENEROUS=("${GENEROUS_LIMITS[@]}" MCP_RL__LOOP_DETECTION__ENABLED=false MCP_RL__PROXY__MAX_IN_FLIGHT=1024)

up() {
  for _ in $(seq 1 600); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing answers on $1"; exit 1
}

KIND=${UPSTREAM:-serve}
case "$KIND" in
  serve) export TOOL=rate_limit_status ARGUMENTS='{}' ;;
  fastmcp) scripts/proxy-fixtures.sh >/dev/null; export TOOL=add ARGUMENTS='{"a":1,"b":2}' ;;
  everything) scripts/proxy-fixtures.sh >/dev/null; export TOOL=echo ARGUMENTS='{"message":"hi"}' ;;
  *) echo "UPSTREAM is serve, fastmcp or everything"; exit 2 ;;
esac

TICKS=$(getconf CLK_TCK)

# load PORT NAME PID…: opens sessions on PORT, warms up, then the measured wrk run; prints each
# PID's CPU time per call (the upstream's, then the proxy's).
load() {
  local port=$1 name=$2 url="http://127.0.0.1:$1/mcp" sids="" sid result requests pid cpu=""
  shift 2
  for _ in $(seq 1 "$SESSIONS_PER_RUN"); do
    sid=$(open_session "$url" load-test)
    [ -n "$sid" ] && sids="$sids${sids:+,}$sid"
  done
  SESSIONS=$sids taskset -c "$WRK_CPU" wrk -t1 -c"$CONNECTIONS" -d2s -s scripts/load/tools_call.lua "http://127.0.0.1:$port" >/dev/null 2>&1 || true
  local before=()
  for pid in "$@"; do before+=("$(cpu_ticks "$pid")"); done
  result=$(SESSIONS=$sids taskset -c "$WRK_CPU" wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency \
    -s scripts/load/tools_call.lua "http://127.0.0.1:$port" | grep '^RESULT')
  requests=$(sed -E 's/.*requests=([0-9]+).*/\1/' <<<"$result")
  local i=0 label
  for pid in "$@"; do
    label=$([ "$i" = 0 ] && echo upstream || echo proxy)
    cpu="$cpu $(awk -v a="${before[$i]}" -v b="$(cpu_ticks "$pid")" -v r="$requests" -v t="$TICKS" -v l="$label" \
      'BEGIN { printf "%s_cpu_us=%.0f", l, (r > 0 ? (b - a) * 1e6 / t / r : 0) }')"
    i=$((i + 1))
  done
  printf '%-34s %s%s\n' "$name" "${result#RESULT }" "$cpu"
  echo "$name $result$cpu" >>"$work/results"
}

# The upstream on its own port (ours in its own directory: no ./config.toml, the defaults).
start_upstream() {
  UPSTREAM=$(free_port)
  case "$KIND" in
    serve) cd "$work" && RUST_LOG=error MCP_RL__LIMITS__ENABLED=false exec taskset -c 0 "$BIN" serve --listen "127.0.0.1:$UPSTREAM" ;;
    fastmcp) exec taskset -c 0 .tools/python/bin/python tests/fixtures/fastmcp_server.py http "$UPSTREAM" ;;
    everything) PORT=$UPSTREAM exec taskset -c 0 .tools/node/node_modules/.bin/node \
      .tools/node/node_modules/@modelcontextprotocol/server-everything/dist/index.js streamableHttp ;;
  esac >/dev/null 2>&1 &
  pids+=($!)
  up "$UPSTREAM"
}

echo "mcp-ratelimit proxy overhead: $CORES cores, every server on CPU 0, wrk on CPU $WRK_CPU, $CONNECTIONS connections, ${DURATION}s per run"
echo "upstream: $KIND, tool $TOOL $ARGUMENTS"
for round in $(seq 1 "${ROUNDS:-2}"); do
  start_upstream
  load "$UPSTREAM" "upstream alone, round $round" "${pids[0]}"
  stop_all
  start_upstream
  PROXY=$(free_port)
  (cd "$work" && RUST_LOG=error exec env "${GENEROUS[@]}" taskset -c 0 "$BIN" proxy --listen "127.0.0.1:$PROXY" \
    --upstream "http://127.0.0.1:$UPSTREAM/mcp") >/dev/null 2>&1 &
  pids+=($!)
  up "$PROXY"
  load "$PROXY" "through the proxy, round $round" "${pids[0]}" "${pids[1]}"
  stop_all
done
awk '
  { for (i = 1; i <= NF; i++) if ($i ~ /^rps=/) { split($i, kv, "="); rps = kv[2] } }
  /^upstream alone/ { alone += rps; na++ }
  /^through the proxy/ { proxied += rps; np++ }
  END {
    if (na && np && proxied > 0) printf "time per call through the proxy / the upstream alone: %.2f (mean of %d rounds each)\n", (alone / na) / (proxied / np), na
  }' "$work/results"
awk '
  { for (i = 1; i <= NF; i++) if ($i ~ /^proxy_cpu_us=/) { split($i, kv, "="); cpu += kv[2]; n++ } }
  END { if (n) printf "the proxy'"'"'s own CPU time per call: %.0f us (mean of %d rounds)\n", cpu / n, n }' "$work/results"
