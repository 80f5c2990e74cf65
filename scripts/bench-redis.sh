#!/usr/bin/env bash
# What deciding through the Redis store costs, against the floor one Redis round trip sets on
# the same machine, in one run (driver: benches/redis_store.rs; results: BENCHMARKS.md, "Redis
# store"). It measures:
#
#  1. Decisions per second through one RedisStore (one multiplexed connection, as in the server)
#     with 16 and 64 concurrent tokio tasks, each deciding on its own keys, against the floor:
#     `redis-benchmark` with as many clients (-c) and no pipelining (-P 1) running an EVALSHA of
#     `return 1`, one round trip per call that runs a script and does nothing. Two more rows say
#     where the time goes: our own client (the tasks sharing one ConnectionManager) sending that
#     same EVALSHA, and redis-benchmark replaying the very EVALSHA the store sends (captured with
#     MONITOR), i.e. the script's cost in Redis without our client.
#  2. The latency of one decision (p50, p99; one task, sequential) next to a SET on the same
#     kind of connection (the redis crate's ConnectionManager, configured as the store's).
#  3. Each with one scope (the caller) and three (caller, tenant, a tool budget), so the price of
#     the extra scopes is on record.
#
# The Redis is our own (loopback, free port, no persistence) on CPU 0; every client, ours and
# redis-benchmark alike, runs on CPU 1 (taskset), so a client never takes Redis's core and both
# clients get the same one. Redis's CPU time over each measurement (from /proc) says whether
# Redis or the client was the limit. About 70 s after the build.
#
#   scripts/bench-redis.sh
#   DURATION=10 TASKS="16 64 256" LATENCY_SECONDS=10 scripts/bench-redis.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5}
TASKS=${TASKS:-16 64}
LATENCY_SECONDS=${LATENCY_SECONDS:-8}
export CLK_TCK=$(getconf CLK_TCK)

. scripts/lib.sh

if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
  echo "installing redis-server and redis-tools (Debian packages)"
  apt-get install -y -qq redis-server redis-tools >/dev/null ||
    { apt-get update -qq && apt-get install -y -qq redis-server redis-tools >/dev/null; }
fi

# The driver, built in the bench profile (release).
BIN=$(cargo bench --bench redis_store --no-run --message-format=json-render-diagnostics | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "redis_store" and m.get("executable"):
        print(m["executable"])')
[ -x "$BIN" ] || { echo "could not build benches/redis_store.rs" >&2; exit 1; }

if command -v taskset >/dev/null && [ "$(nproc)" -ge 2 ]; then
  REDIS_CPU=(taskset -c 0)
  CLIENT_CPU=(taskset -c 1)
  placement="Redis on CPU 0, clients on CPU 1"
else
  REDIS_CPU=()
  CLIENT_CPU=()
  placement="no pinning (taskset missing or one CPU): Redis and clients share"
fi

work=$(mktemp -d)
REDIS_PID=""
cleanup() {
  if [ -n "$REDIS_PID" ]; then
    kill "$REDIS_PID" 2>/dev/null || true
    wait "$REDIS_PID" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

port=$(free_port)
"${REDIS_CPU[@]}" redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
REDIS_PID=$!
export REDIS_PID
rcli() { redis-cli -h 127.0.0.1 -p "$port" "$@"; }
for _ in $(seq 1 100); do
  [ "$(rcli PING 2>/dev/null)" = PONG ] && break
  kill -0 "$REDIS_PID" 2>/dev/null || { cat "$work/redis.log" >&2; exit 1; }
  sleep 0.05
done
url="redis://127.0.0.1:$port/"
results="$work/results"
: >"$results"

redis_cpu_s() { awk -v hz="$CLK_TCK" '{ printf "%.3f", ($14 + $15) / hz }' "/proc/$REDIS_PID/stat"; }
# CHILDREN_CPU_S: CPU seconds of every child this shell has waited for (the second line of
# bash's `times`, which must run in this shell, not in a $(...) subshell).
children_cpu() {
  times >"$work/times"
  CHILDREN_CPU_S=$(awk 'NR == 2 { split($1, u, /[ms]/); split($2, s, /[ms]/); printf "%.3f", u[1] * 60 + u[2] + s[1] * 60 + s[2] }' "$work/times")
}

# The EVALSHA of `return 1`, and the exact EVALSHA the store sends for a one-scope decision
# (captured with MONITOR during a short run that is not measured).
RETURN_1=$(rcli SCRIPT LOAD 'return 1')
(rcli MONITOR | grep -m1 -i '"evalsha"' >"$work/monitor") & # sigpipe: ends MONITOR on purpose; `wait || true`
monitor=$!
sleep 0.2
"${CLIENT_CPU[@]}" "$BIN" throughput "$url" 1 1 0.1 >/dev/null
wait "$monitor" || true
mapfile -d '' DECIDE_1 < <(python3 -c '
import shlex, sys
line = open(sys.argv[1]).read()
args = shlex.split(line[line.index("]") + 1:])
sys.stdout.write("".join(a + "\0" for a in args))' "$work/monitor")
[ "${#DECIDE_1[@]}" -ge 4 ] || { echo "could not capture the store's EVALSHA" >&2; exit 1; }

# bench NAME CLIENTS COMMAND...: redis-benchmark for about DURATION s (the request count comes
# from a short warm-up run), appending a RESULT line.
bench() {
  local name=$1 clients=$2; shift 2
  local warm rps n redis0 redis1 client0 client1 t0 t1 line
  warm=$("${CLIENT_CPU[@]}" redis-benchmark -h 127.0.0.1 -p "$port" -c "$clients" -P 1 -n 20000 --csv "$@" | tail -n 1)
  rps=$(cut -d, -f2 <<<"$warm" | tr -d '"')
  n=$(awk -v r="$rps" -v d="$DURATION" 'BEGIN { printf "%d", r * d }')
  redis0=$(redis_cpu_s); children_cpu; client0=$CHILDREN_CPU_S; t0=$(date +%s.%N)
  line=$("${CLIENT_CPU[@]}" redis-benchmark -h 127.0.0.1 -p "$port" -c "$clients" -P 1 -n "$n" --csv "$@" | tail -n 1)
  t1=$(date +%s.%N); redis1=$(redis_cpu_s); children_cpu; client1=$CHILDREN_CPU_S
  # "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
  awk -F, -v name="$name" -v c="$clients" -v n="$n" -v t0="$t0" -v t1="$t1" -v r0="$redis0" -v r1="$redis1" \
    -v c0="$client0" -v c1="$client1" '{ gsub(/"/, ""); printf "RESULT benchmark kind=%s tasks=%s decisions=%s seconds=%.3f per_sec=%s p50_ms=%s p99_ms=%s client_cpu_s=%.3f redis_cpu_s=%.3f\n", name, c, n, t1 - t0, $2, $5, $7, c1 - c0, r1 - r0 }' \
    <<<"$line" | tee -a "$results"
}

# store TASKS SCOPES: decisions through RedisStore, appending its RESULT line.
store() {
  "${CLIENT_CPU[@]}" "$BIN" throughput "$url" "$1" "$2" "$DURATION" | grep '^RESULT' | tee -a "$results"
}

echo "redis-server $(redis-server --version | sed -E 's/.*v=([^ ]+).*/\1/') on 127.0.0.1:$port; $placement; $(nproc) CPUs"
for tasks in $TASKS; do
  bench evalsha_return_1 "$tasks" EVALSHA "$RETURN_1" 0
  store "$tasks" 0
  store "$tasks" 1
  store "$tasks" 3
  bench evalsha_decide_1_scope "$tasks" "${DECIDE_1[@]}"
done
"${CLIENT_CPU[@]}" "$BIN" latency "$url" "$LATENCY_SECONDS" | grep '^RESULT' | tee -a "$results"
# redis-benchmark does not look at replies: a replayed call that failed would still count.
failed=$(rcli INFO commandstats | tr -d '\r' | sed -nE 's/^cmdstat_evalsha:.*failed_calls=([0-9]+).*/\1/p')
[ "${failed:-0}" = 0 ] || { echo "Redis counted $failed failed EVALSHA calls: the figures are void" >&2; exit 1; }

python3 - "$results" "$DURATION" <<'PY'
import sys

rows = []
for line in open(sys.argv[1]):
    fields = line.split()
    row = {"mode": fields[1]}
    row.update(f.split("=", 1) for f in fields[2:])
    rows.append(row)

names = {
    "evalsha_return_1": "redis-benchmark EVALSHA `return 1` (floor)",
    "evalsha_decide_1_scope": "redis-benchmark, the store's EVALSHA, 1 scope",
}
def pct(x):
    return f"{100 * x:.0f}%"

print()
print(f"Throughput: decisions (or calls) per second, {sys.argv[2]} s each; CPU as a share of the run's wall time")
header = f"{'tasks/clients':>13}  {'what':<47} {'per s':>8} {'vs floor':>8} {'client CPU':>10} {'Redis CPU':>9} {'Redis us/op':>11}"
print(header)
print("-" * len(header))
summary = []
for tasks in dict.fromkeys(r["tasks"] for r in rows if r["mode"] in ("throughput", "benchmark")):
    group = [r for r in rows if r.get("tasks") == tasks and r["mode"] in ("throughput", "benchmark")]
    floor = next(float(r["per_sec"]) for r in group if r.get("kind") == "evalsha_return_1")
    for r in group:
        if r["mode"] == "benchmark":
            what = names[r["kind"]]
        elif r["scopes"] == "0":
            what = "ConnectionManager EVALSHA `return 1`"
        else:
            what = f"RedisStore.decide, {r['scopes']} scope{'s' if r['scopes'] != '1' else ''}"
        per_sec, seconds = float(r["per_sec"]), float(r["seconds"])
        redis = float(r["redis_cpu_s"]) if r["redis_cpu_s"] != "na" else float("nan")
        n = per_sec * seconds
        print(f"{tasks:>13}  {what:<47} {per_sec:>8.0f} {pct(per_sec / floor):>8} "
              f"{pct(float(r['client_cpu_s']) / seconds):>10} {pct(redis / seconds):>9} {1e6 * redis / n:>11.1f}")
        if r["mode"] == "throughput" and r["scopes"] != "0":
            summary.append(f"RedisStore {r['scopes']} scope(s), {tasks} tasks: {pct(per_sec / floor)} of the floor (target >= 70%)")
    print()

lat = {r["kind"]: r for r in rows if r["mode"] == "latency"}
print("Latency: one task, sequential, the four calls taking turns; microseconds")
header = f"{'what':<40} {'n':>7} {'p50':>7} {'p90':>7} {'p99':>7} {'mean':>7} {'p50 / SET':>9}"
print(header)
print("-" * len(header))
labels = {"set": "SET (ConnectionManager)", "evalsha_return_1": "EVALSHA `return 1` (same connection)",
          "decide_1_scope": "RedisStore.decide, 1 scope", "decide_3_scopes": "RedisStore.decide, 3 scopes"}
set_p50 = float(lat["set"]["p50_us"])
for kind, label in labels.items():
    r = lat[kind]
    print(f"{label:<40} {r['n']:>7} {float(r['p50_us']):>7.1f} {float(r['p90_us']):>7.1f} {float(r['p99_us']):>7.1f} "
          f"{float(r['mean_us']):>7.1f} {float(r['p50_us']) / set_p50:>8.2f}x")
print()
for line in summary:
    print(line)
print(f"decision p50 / SET p50: 1 scope {float(lat['decide_1_scope']['p50_us']) / set_p50:.2f}x, "
      f"3 scopes {float(lat['decide_3_scopes']['p50_us']) / set_p50:.2f}x (target <= 2x)")
print(f"three scopes over one: p50 +{float(lat['decide_3_scopes']['p50_us']) - float(lat['decide_1_scope']['p50_us']):.1f} us")
PY
