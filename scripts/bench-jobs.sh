#!/usr/bin/env bash
# When a job's account slot comes back, on a real clock (issue 45's targets; results:
# docs/upstream.md, "When a job's slot comes back", and BENCHMARKS.md). Real processes: the
# release binary as server instances, `mcp-ratelimit mock-upstream` as the paid API (an account
# of 4 predictions at once, images of exactly 1 s), a redis-server of its own. Agents call
# generate_image over MCP (2025-11-25 sessions, curl). What the mock logged says how the account
# was used: each accepted submission runs 1 s from its arrival.
#
#  1. webhooks: three instances on one Redis, every webhook delivered to the first, three tenants
#     (one per instance) submitting 10 images each at once. Target: >= 22 of the account's 24
#     slot-seconds busy in the first 6 s; never more than 4 running.
#  2. polls, learnt: one instance, no webhooks, one tenant submitting 40 images at once. Target:
#     >= 20 of 24 slot-seconds busy between 4 s and 10 s; at most 4 polls of the paid API per job.
#  3. with OLD=<commit>: scenarios 1 and 2 again on that commit's binary (built in a worktree), for
#     the figures before (a poll every image_poll_seconds = 2 s, no webhooks: its config has none).
#
#   scripts/bench-jobs.sh            # about 50 s after the build
#   OLD=405e871 scripts/bench-jobs.sh  # also runs the polls scenario on an older commit (a worktree)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

SECRET="whsec_YmVuY2gtam9icy1zZWNyZXQtb25seQ=="
OLD=${OLD:-}
command -v redis-server >/dev/null || apt-get install -y -qq redis-server >/dev/null

cargo build --release --quiet
BIN="$(target_dir)/release/mcp-ratelimit"
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

wait_for() {
  for _ in $(seq 1 200); do
    curl -fsS "$1" >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "nothing answers at $1" >&2
  return 1
}

# config FILE MOCK_PORT REDIS_PORT WEBHOOK_URL: one instance's config (REDIS_PORT "-": memory;
# WEBHOOK_URL "": no webhook keys at all, which an older build does not know).
config() {
  local file=$1 mock=$2 redis=$3 webhook=$4 store="" hook="" sign=""
  [ "$redis" != "-" ] && store="backend = \"redis\"
redis_url = \"redis://127.0.0.1:$redis/\""
  [ -n "$webhook" ] && hook="webhook_url = \"$webhook\"
webhook_secret = \"$SECRET\"" && sign="webhook_secret = \"$SECRET\""
  cat >"$file" <<EOF
[store]
$store
[upstream]
url = "http://127.0.0.1:$mock"
max_in_flight = 4
queue_max = 100
$hook
[mock_upstream]
image_job_ms = 1000
max_concurrent_predictions = 4
$sign
[limits.in_flight]
caller = 100
tenant = 100
address = 100
[loop_detection]
enabled = false
[[auth.keys]]
key = "bench-tenant-a"
tenant = "a"
[[auth.keys]]
key = "bench-tenant-b"
tenant = "b"
[[auth.keys]]
key = "bench-tenant-c"
tenant = "c"
EOF
}

# submit PORT KEY N: N generate_image calls at once from one session.
submit() {
  local url="http://127.0.0.1:$1/mcp" sid
  sid=$(open_session "$url" "$2")
  for i in $(seq 1 "$3"); do
    curl -sS -o /dev/null "$url" -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \
      -H "Authorization: Bearer $2" -H "Mcp-Session-Id: $sid" -H 'MCP-Protocol-Version: 2025-11-25' \
      -d "{\"jsonrpc\":\"2.0\",\"id\":$i,\"method\":\"tools/call\",\"params\":{\"name\":\"generate_image\",\"arguments\":{\"prompt\":\"$2 image $i\"}}}" &
  done
}

# report NAME MOCK_PORT FROM TO: the account's use from the mock's log.
report() {
  curl -fsS "http://127.0.0.1:$2/v1/submissions" >"$work/submissions.json"
  curl -fsS "http://127.0.0.1:$2/v1/usage" >"$work/usage.json"
  python3 - "$1" "$3" "$4" "$work/submissions.json" "$work/usage.json" <<'EOF'
import json, sys
name, lo, hi = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
log = json.load(open(sys.argv[4]))["submissions"]
usage = json.load(open(sys.argv[5]))
starts = sorted(s["at_ns"] / 1e9 for s in log if s["status"] == 201)
t0 = min(s["at_ns"] / 1e9 for s in log)
runs = [(t - t0, t - t0 + 1.0) for t in starts]
busy = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in runs)
edges = sorted([(a, 1) for a, _ in runs] + [(b, -1) for _, b in runs], key=lambda e: (e[0], e[1]))
most = now = 0
for _, step in edges:
    now += step
    most = max(most, now)
jobs = usage["predictions_created"]
print(f"| {name} | {busy:.1f} of {4 * (hi - lo):.0f} slot-seconds busy in {lo:.0f}-{hi:.0f} s | "
      f"{jobs} jobs, last ended at {runs[-1][1]:.1f} s | {usage['polls'] / max(jobs, 1):.2f} polls per job | "
      f"most running at once: {most} | 429s: {usage['refused_429']} |")
EOF
}

# scenario NAME INSTANCES WEBHOOKS JOBS_PER_TENANT FROM TO [BIN]
scenario() {
  local name=$1 instances=$2 webhooks=$3 jobs=$4 from=$5 to=$6 bin=${7:-$BIN}
  local mock redis="-" first port hook=""
  mock=$(free_port)
  [ "$webhooks" = yes ] && hook="http://127.0.0.1:0/webhooks/upstream"
  config "$work/mock.toml" "$mock" - "$hook"
  "$bin" mock-upstream --config "$work/mock.toml" --listen "127.0.0.1:$mock" >"$work/mock.log" 2>&1 &
  pids+=($!)
  wait_for "http://127.0.0.1:$mock/health"
  if [ "$instances" -gt 1 ]; then
    redis=$(free_port)
    redis-server --port "$redis" --bind 127.0.0.1 --save '' --appendonly no >/dev/null &
    pids+=($!)
    for _ in $(seq 1 100); do redis-cli -p "$redis" ping >/dev/null 2>&1 && break; sleep 0.05; done
  fi
  local ports=()
  for i in $(seq 1 "$instances"); do ports+=("$(free_port)"); done
  first=${ports[0]}
  for port in "${ports[@]}"; do
    local hook=""
    [ "$webhooks" = yes ] && hook="http://127.0.0.1:$first/webhooks/upstream"
    config "$work/server-$port.toml" "$mock" "$redis" "$hook"
    env "${GENEROUS_LIMITS[@]}" RUST_LOG=warn "$bin" serve --config "$work/server-$port.toml" \
      --listen "127.0.0.1:$port" >"$work/server-$port.log" 2>&1 &
    pids+=($!)
    wait_for "http://127.0.0.1:$port/health"
  done
  local tenants=(a b c)
  for i in "${!ports[@]}"; do submit "${ports[$i]}" "bench-tenant-${tenants[$i]}" "$jobs"; done
  wait_jobs=$(( (instances * jobs + 3) / 4 * 3 + 6 ))
  sleep "$wait_jobs"
  report "$name" "$mock" "$from" "$to"
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  pids=()
  sleep 0.5
}

echo "| scenario | account use | jobs | polls | concurrency | refused |"
echo "| --- | --- | --- | --- | --- | --- |"
scenario "webhooks, 3 instances, 3 x 10 images" 3 yes 10 0 6
scenario "polls learnt, 1 instance, 40 images" 1 no 40 4 10
if [ -n "$OLD" ]; then
  old_tree="$work/old"
  git worktree add -q --detach "$old_tree" "$OLD"
  (cd "$old_tree" && CARGO_TARGET_DIR="$(target_dir)/bench-jobs-old" cargo build --release --quiet)
  old_bin="$(target_dir)/bench-jobs-old/release/mcp-ratelimit"
  scenario "$OLD: 3 instances, 3 x 10 images (polls at 2 s)" 3 no 10 0 6 "$old_bin"
  scenario "$OLD: 1 instance, 40 images (polls at 2 s)" 1 no 40 4 10 "$old_bin"
  git worktree remove --force "$old_tree"
fi
