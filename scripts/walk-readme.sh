#!/usr/bin/env bash
# Walks the README's "Quick start" and "Try it" as a newcomer would, from a fresh clone of HEAD
# with an empty target directory, timing each step, and prints one line per step. What it runs:
#
#   make run (until it logs where to look)     the dashboard and its data
#   make burst, and scripts/burst.sh at make run's server
#   make inspector, then the README's three mcp-inspector commands, and a poll of the task
#   the README's walk-through of the guard's refusals (a loop, then a spent budget)
#   ./target/release/mcp-ratelimit simulate and check-config
#   make install (into a scratch CARGO_INSTALL_ROOT, not ~/.cargo/bin) and the binary on PATH
#
#   scripts/walk-readme.sh            # needs port 3000 free (make run's), git, curl, python3
#
# Takes about seven minutes on 2 cores (the release and debug builds are most of it). make test is
# not walked here: .ci/run is that walk.
set -uo pipefail
cd "$(dirname "$0")/.."

if (exec 3<>/dev/tcp/127.0.0.1/3000) 2>/dev/null; then
  echo "port 3000 is taken: make run needs it" >&2
  exit 2
fi
unset CARGO_TARGET_DIR
work=$(mktemp -d)
clone="$work/mcp-ratelimit"
run_pid=""
cleanup() {
  [ -n "$run_pid" ] && kill "$run_pid" 2>/dev/null && wait "$run_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

failed=0
# Where step NAME's output goes.
out() { echo "$work/$(printf '%s' "$1" | tr -c 'A-Za-z0-9' '_').out"; }
# step NAME COMMAND...: runs it in the clone, its output to $(out NAME), and prints its time.
step() {
  local name=$1
  shift
  local start end rc
  start=$(date +%s.%N)
  (cd "$clone" && "$@") >"$(out "$name")" 2>&1
  rc=$?
  end=$(date +%s.%N)
  printf '%-34s %8.1f s   %s\n' "$name" "$(echo "$end - $start" | bc)" "$([ $rc = 0 ] && echo ok || echo "FAILED (rc $rc)")"
  [ $rc = 0 ] || { failed=1; tail -5 "$(out "$name")" | sed 's/^/    /'; }
  return $rc
}

start=$(date +%s.%N)
git clone -q "$PWD" "$clone"
printf '%-34s %8.1f s   ok\n' "git clone" "$(echo "$(date +%s.%N) - $start" | bc)"

start=$(date +%s.%N)
(cd "$clone" && exec make run) >"$work/run.log" 2>&1 &
run_pid=$!
until grep -q 'serving' "$work/run.log"; do
  kill -0 "$run_pid" 2>/dev/null || { echo "make run exited:"; tail -5 "$work/run.log"; exit 1; }
  sleep 1
done
printf '%-34s %8.1f s   %s\n' "make run, until it logs 'serving'" "$(echo "$(date +%s.%N) - $start" | bc)" \
  "$(grep -o 'dashboard=[^ ]*' "$work/run.log")"

step dashboard curl -sf -o /dev/null http://127.0.0.1:3000/dashboard
step dashboard-data curl -sf -o /dev/null http://127.0.0.1:3000/dashboard/data
step "make burst" make burst
step "burst.sh at make run's server" scripts/burst.sh http://127.0.0.1:3000/mcp
step "make inspector" make inspector
export PATH="$clone/.tools/node/node_modules/.bin:$PATH"
step "inspector: tools/list" mcp-inspector --cli http://127.0.0.1:3000/mcp --transport http --method tools/list
step "inspector: generate_image" mcp-inspector --cli http://127.0.0.1:3000/mcp --transport http \
  --header "Authorization: Bearer my-key" --method tools/call --tool-name generate_image \
  --tool-args-json '{"prompt":"a lighthouse"}'
task=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("taskId",""))' \
  "$(out "inspector: generate_image")" 2>/dev/null)
sleep 7 # the mock's image takes 6 s on make run's real clock
step "inspector: get_prediction (task)" mcp-inspector --cli http://127.0.0.1:3000/mcp --transport http \
  --header "Authorization: Bearer my-key" --method tools/call --tool-name get_prediction \
  --tool-args-json "{\"predict_id\":\"$task\"}"
grep -q '"succeeded"' "$(out "inspector: get_prediction (task)")" || { echo "    the task did not succeed"; failed=1; }
step "inspector: tools/list over stdio" mcp-inspector --cli --method tools/list -- ./target/release/mcp-ratelimit stdio
[ "$(head -c 1 "$(out "inspector: tools/list over stdio")")" = "{" ] || { echo "    stdio output is not clean JSON"; failed=1; }
# The README's walk-through of the guard's refusals, as written, at make run's server (on its real
# clock: the 61 calls go out well within the second a token takes to come back).
awk '/<!-- walked: tests\/repo\/readme.rs -->/ { on = 1; next } on && /^```sh$/ { next } on && /^```$/ { exit } on' \
  "$clone/README.md" >"$work/refusals.sh"
step "the guard's refusals" bash "$work/refusals.sh"
refusals=$(out "the guard's refusals")
grep -qx 'search 5: refused loop_detected' "$refusals" && grep -qx 'page 61: refused rate_limited' "$refusals" \
  && [ "$(grep -c ': refused' "$refusals")" = 2 ] || { echo "    not the refusals the README promises"; failed=1; }
step simulate ./target/release/mcp-ratelimit simulate --shape runaway_loop
step check-config ./target/release/mcp-ratelimit check-config
export CARGO_INSTALL_ROOT="$work/install"
step "make install" make install
export PATH="$work/install/bin:$PATH"
step "mcp-ratelimit on PATH" mcp-ratelimit --version
exit $failed
