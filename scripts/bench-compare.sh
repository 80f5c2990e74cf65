#!/usr/bin/env bash
# This build against an older one, through the whole server: both built release, each run through
# the same wrk load back to back, ROUNDS times, and HEAD's figures divided by BASE's.
#
#   scripts/bench-compare.sh BASE [HEAD]       # HEAD: a revision (default HEAD), or . for the working tree
#   make bench-compare BASE=77a9257 [HEAD=...]
#   DURATION=8 ROUNDS=4 SCENARIOS="generous tight" scripts/bench-compare.sh 77a9257
#
# Each revision is checked out with `git worktree add --detach` into a temporary directory and built
# there with `cargo build --release --locked` into one target directory shared by every revision,
# bench-compare/target under $CARGO_TARGET_DIR (else cargo's own target directory), so dependencies
# compile once. Its binary is kept as bench-compare/<sha>/mcp-ratelimit: a re-run with the same revisions
# builds nothing. `.` builds the working tree as it is (into the same target; cargo decides what
# changed). The temporary worktrees go on exit, failure or Ctrl-C alike.
#
# Scenarios (SCENARIOS, all five by default), `tools/call` of TOOL (list_articles) as a caller with a
# made-up bearer token, 16 MCP sessions over CONNECTIONS connections:
#   off       limits.enabled = false: the server without its limiter
#   generous  every limit that caller draws on, and never refusing (its key is not configured, so
#             its address's limits apply too, where the build has them)
#   tight     every POST refused with 429 by the HTTP layer: what a refusal costs there
#   refused   generous, but the caller's budget spent in the warm-up: every tools/call refused by
#             the tool guard, a refusal through the whole MCP stack
#   redis     generous, on a redis-server this script starts on a free port (on wrk's core)
# CALLERS=oauth names the callers otherwise: BASE's presents a configured key and HEAD's an OAuth
# access token (RS256, minted by tests/fixtures/oauth_provider.mjs, which this script starts on
# wrk's core after scripts/proxy-fixtures.sh), both verified callers with the same budgets, so one
# build on both sides measures what naming a caller by its token costs:
#   CALLERS=oauth SCENARIOS="generous refused" scripts/bench-compare.sh HEAD HEAD
# HEAD_ENV adds overrides (KEY=VALUE words) to HEAD's side of every scenario. TRACES=1 starts an
# OTLP/HTTP sink on wrk's core (it reads every export and answers 200) and sets HEAD's
# MCP_RL__TELEMETRY__OTLP_ENDPOINT to it: one build against itself with traces on and off is
#   TRACES=1 scripts/bench-compare.sh HEAD HEAD
# The server is pinned to CPU 0 and wrk (Debian's package) to CPU 1, and the server's own CPU time
# per request is read from /proc, as in scripts/load.sh (in the redis scenario, Redis's too, and the
# commands and round trips a call cost by the store's own counters). Within a round the two builds run one
# scenario back to back, the first one alternating between rounds, so drift hits both alike.
#
# A key one build does not know would make it refuse its whole config (it denies unknown fields,
# and MCP_RL__ variables are keys), so each override is tried on each binary with `check-config`
# first and left out where the key is unknown (printed); a scenario whose defining key is unknown
# to a build (the Redis store in an old one) is n/a for it. Loop detection stays on where a build
# has it: the load cycles through eleven pages of list_articles (cursor 0, 10, ... 100: ten
# articles each from the mock's 120), so it does its work and never fires. Over every measured
# run the server's /metrics must show no refusal and no failed upstream call (tight and refused:
# every request refused), or the run is flagged.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

usage() {
  echo "usage: scripts/bench-compare.sh BASE [HEAD]   (HEAD: a revision, default HEAD; . for the working tree)" >&2
  exit 2
}
if [ $# -lt 1 ] || [ $# -gt 2 ] || [ -z "$1" ]; then usage; fi

DURATION=${DURATION:-8}
WARMUP=${WARMUP:-2}
ROUNDS=${ROUNDS:-2}
CONNECTIONS=${CONNECTIONS:-16}
SESSIONS_PER_RUN=${SESSIONS_PER_RUN:-16}
SCENARIOS=${SCENARIOS:-off generous tight refused redis}
TOOL=${TOOL:-list_articles}
TOKEN=bench-compare-made-up-key
# Eleven pages of list_articles, ten articles each (the mock has 120, and each of these pages has
# a next one): the same work, eleven different calls to loop detection, which refuses the same
# call five times in a row (and fills in defaults first, so `{}` and `{"limit":10}` are one call).
# For another tool, set ARGUMENTS (see tools_call.lua).
if [ "$TOOL" = list_articles ]; then
  ARGUMENTS=${ARGUMENTS:-$(seq -s '|' -f '{"cursor":"%g"}' 0 10 100)}
else
  ARGUMENTS=${ARGUMENTS:-'{}'}
fi
export ARGUMENTS TOOL TOKEN

for scenario in $SCENARIOS; do
  case $scenario in off | generous | tight | refused | redis) ;; *) echo "unknown scenario '$scenario' (off generous tight refused redis)" >&2; exit 2 ;; esac
done

if [[ " $SCENARIOS " == *" redis "* ]] && ! command -v redis-server >/dev/null; then
  echo "installing redis-server and redis-tools (Debian packages)"
  apt-get install -y -qq redis-server redis-tools >/dev/null ||
    { apt-get update -qq && apt-get install -y -qq redis-server redis-tools >/dev/null; }
fi

# shellcheck source=scripts/lib.sh disable=SC1091 # followed under shellcheck -x
. scripts/lib.sh
ensure_wrk
HEAD_ENV=${HEAD_ENV:-}
SINK_PID=
CORES=$(nproc)
SERVER_CPU=0
WRK_CPU=$(( CORES > 1 ? 1 : 0 ))
TICKS=$(getconf CLK_TCK)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/bench-compare.XXXXXX")
REDIS_PID=""
cleanup() {
  stop_server
  if [ -n "$SINK_PID" ]; then
    kill "$SINK_PID" 2>/dev/null || true
    wait "$SINK_PID" 2>/dev/null || true
  fi
  if [ -n "$REDIS_PID" ]; then
    kill "$REDIS_PID" 2>/dev/null || true
    wait "$REDIS_PID" 2>/dev/null || true
  fi
  if [ -n "${PROVIDER_PID:-}" ]; then
    kill "$PROVIDER_PID" 2>/dev/null || true
    wait "$PROVIDER_PID" 2>/dev/null || true
  fi
  local wt
  for wt in "$WORK"/worktree-*; do
    [ -d "$wt" ] && { git -C "$ROOT" worktree remove --force "$wt" >/dev/null 2>&1 || true; }
  done
  rm -rf "$WORK"
  git -C "$ROOT" worktree prune
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

CACHE="$(target_dir)/bench-compare"

# build REV -> sets BUILT (the binary) and LABEL.
build() {
  local rev=$1
  if [ "$rev" = . ]; then
    LABEL="working tree ($(git rev-parse --short HEAD)$(git diff --quiet HEAD -- || echo ", modified"))"
    echo "$LABEL: building into $CACHE/target"
    CARGO_TARGET_DIR="$CACHE/target" cargo build --release --locked --quiet
    # A copy for this run: building the other side in the same target replaces that binary.
    BUILT="$WORK/working-tree/mcp-ratelimit"
    mkdir -p "$WORK/working-tree"
    cp "$CACHE/target/release/mcp-ratelimit" "$BUILT"
    return
  fi
  local sha
  sha=$(git rev-parse --verify --quiet "$rev^{commit}") || { echo "not a commit: $rev" >&2; exit 2; }
  LABEL="$(git rev-parse --short "$sha")"
  BUILT="$CACHE/$sha/mcp-ratelimit"
  local named=$LABEL
  [ "$rev" = "$LABEL" ] || named="$rev ($LABEL)"
  if [ -x "$BUILT" ]; then
    echo "$named: built before, $BUILT"
    return
  fi
  local wt="$WORK/worktree-$sha"
  echo "$named: building in a temporary worktree into $CACHE/target (minutes the first time)"
  git worktree add --detach --quiet "$wt" "$sha"
  (cd "$wt" && CARGO_TARGET_DIR="$CACHE/target" cargo build --release --locked --quiet)
  mkdir -p "$CACHE/$sha"
  cp "$CACHE/target/release/mcp-ratelimit" "$BUILT.part"
  mv "$BUILT.part" "$BUILT"
  git worktree remove --force "$wt"
}

build "$1"; BASE_BIN=$BUILT; BASE_LABEL=$LABEL
build "${2:-HEAD}"; HEAD_BIN=$BUILT; HEAD_LABEL=$LABEL
SIDES=(base head)
declare -A SIDE_BIN=([base]=$BASE_BIN [head]=$HEAD_BIN)
declare -A SIDE_LABEL=([base]="BASE $BASE_LABEL" [head]="HEAD $HEAD_LABEL")
LABEL_WIDTH=$(( ${#BASE_LABEL} > ${#HEAD_LABEL} ? ${#BASE_LABEL} + 5 : ${#HEAD_LABEL} + 5 ))

# Who calls, per side: the token each presents, and the config file each server reads.
EMPTY="$WORK/empty.toml"
: >"$EMPTY"
declare -A SIDE_TOKEN=([base]=$TOKEN [head]=$TOKEN) SIDE_CONFIG=([base]=$EMPTY [head]=$EMPTY)
CALLERS_ARE="a caller with a made-up bearer token"
PROVIDER_PID=""
if [ "${CALLERS:-}" = oauth ]; then
  scripts/proxy-fixtures.sh >/dev/null
  node=.tools/node/node_modules/.bin/node
  [ -x "$node" ] || node=node
  mkfifo "$WORK/provider.out"
  taskset -c "$WRK_CPU" "$node" tests/fixtures/oauth_provider.mjs '{}' <"$WORK/provider.out" >"$WORK/provider.json" 2>"$WORK/provider.log" &
  PROVIDER_PID=$!
  exec {PROVIDER_STDIN}>"$WORK/provider.out" # its stdin open while this script runs
  for _ in $(seq 1 200); do [ -s "$WORK/provider.json" ] && break; sleep 0.05; done
  ISSUER=$(sed -E 's/.*"issuer":"([^"]*)".*/\1/' "$WORK/provider.json")
  [ -n "$ISSUER" ] || { echo "the OAuth provider did not start:" >&2; cat "$WORK/provider.log" >&2; exit 1; }
  AUDIENCE=https://bench.example/mcp
  claims=$(printf '{"claims":{"sub":"bench-agent","aud":"%s","exp":%d}}' "$AUDIENCE" $(( $(date +%s) + 86400 )))
  SIDE_TOKEN[head]=$(curl -fsS -H 'content-type: application/json' -d "$claims" "$ISSUER/test/mint" | sed -E 's/.*"token":"([^"]*)".*/\1/')
  SIDE_CONFIG[base]="$WORK/key.toml"
  printf '[[auth.keys]]\nkey = "%s"\n' "$TOKEN" >"${SIDE_CONFIG[base]}"
  SIDE_CONFIG[head]="$WORK/oauth.toml"
  printf '[auth.oauth]\nissuer = "%s"\naudience = "%s"\n' "$ISSUER" "$AUDIENCE" >"${SIDE_CONFIG[head]}"
  CALLERS_ARE="BASE's caller with a configured key, HEAD's with an OAuth access token (RS256)"
fi

REDIS_PORT=""
if [[ " $SCENARIOS " == *" redis "* ]]; then
  REDIS_PORT=$(free_port)
  taskset -c "$WRK_CPU" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >"$WORK/redis.log" 2>&1 &
  REDIS_PID=$!
  for _ in $(seq 1 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
  redis-cli -p "$REDIS_PORT" ping >/dev/null || { echo "redis-server did not start:" >&2; cat "$WORK/redis.log" >&2; exit 1; }
fi

if [ "${TRACES:-0}" = 1 ]; then
  SINK_PORT=$(free_port)
  # shellcheck disable=SC2016 # Python, not shell
  taskset -c "$WRK_CPU" python3 -c '
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
' "$SINK_PORT" &
  SINK_PID=$!
  HEAD_ENV="$HEAD_ENV MCP_RL__TELEMETRY__OTLP_ENDPOINT=http://127.0.0.1:$SINK_PORT"
  echo "traces on for ${SIDE_LABEL[head]}: an OTLP sink on port $SINK_PORT"
fi

# What each scenario sets. Every limit the caller draws on, never refusing: its own (HTTP, method,
# tool budget) and its address's, which a made-up key is charged to where the build has them.
GENEROUS=("${GENEROUS_LIMITS[@]}")
# `refused` is `generous` with the caller's own budget cut to 60 tokens, refilled once in 1000 s
# (the later values win), which the warm-up spends: 60 is the least a build allows while a tool
# may cost 30 (generate_image_to_video's cost_max) and the guest tier halves budgets.
declare -A WANTS=(
  [off]="MCP_RL__LIMITS__ENABLED=false"
  [generous]="${GENEROUS[*]}"
  [tight]="MCP_RL__LIMITS__HTTP__BURST=1 MCP_RL__LIMITS__HTTP__REFILL_PER_SEC=0.001"
  [refused]="${GENEROUS[*]} MCP_RL__LIMITS__CALLER__BURST=60 MCP_RL__LIMITS__CALLER__REFILL_PER_SEC=0.001"
  [redis]="${GENEROUS[*]} MCP_RL__STORE__BACKEND=redis MCP_RL__STORE__REDIS_URL=redis://127.0.0.1:${REDIS_PORT:-6379}"
)
# The keys that make the scenario what it is: a build without them cannot run it.
declare -A DEFINING=(
  [off]="MCP_RL__LIMITS__ENABLED"
  [generous]=""
  [tight]="MCP_RL__LIMITS__HTTP__BURST MCP_RL__LIMITS__HTTP__REFILL_PER_SEC"
  [refused]="MCP_RL__LIMITS__CALLER__BURST MCP_RL__LIMITS__CALLER__REFILL_PER_SEC"
  [redis]="MCP_RL__STORE__BACKEND MCP_RL__STORE__REDIS_URL"
)

# Both builds run on their built-in defaults plus the overrides: an empty config file (or, with
# CALLERS=oauth, one naming the callers), never the ./config.toml of this checkout (a newer
# build's keys, which an older one refuses).
config_key() { sed 's/^MCP_RL__//; s/__/./g' <<<"$1" | tr '[:upper:]' '[:lower:]'; }
# check BIN [KEY=VALUE...]: whether BIN accepts the defaults with these overrides; its message in CHECK.
check() {
  local bin=$1; shift
  CHECK=$(env "$@" "$bin" check-config "$EMPTY" 2>&1 >/dev/null) && return 0
  CHECK=$(head -n 3 <<<"$CHECK" | tr '\n' ' ')
  return 1
}

# Per side and scenario: the overrides that build accepts (ACCEPTED), or n/a (NA) with the reason.
declare -A ACCEPTED NA DROPPED
for side in "${SIDES[@]}"; do
  bin=${SIDE_BIN[$side]}
  check "$bin" || { echo "${SIDE_LABEL[$side]} refuses its own defaults: $CHECK" >&2; exit 1; }
  for scenario in $SCENARIOS; do
    kept=()
    # shellcheck disable=SC2086 # a list of KEY=VALUE words
    for kv in ${WANTS[$scenario]}; do
      # Tried with the other overrides of its limit (a burst with its rate): a build checks that a
      # bucket refills within a year, which a huge burst at the default rate does not.
      limit_of=${kv%%=*}; limit_of=${limit_of%__*}__
      siblings=()
      for other in ${WANTS[$scenario]}; do [[ $other == "$limit_of"* ]] && siblings+=("$other"); done
      if check "$bin" "${siblings[@]}"; then
        kept+=("$kv")
      elif [[ $CHECK == *"unknown field"* ]]; then
        key=${kv%%=*}
        DROPPED[$side]="${DROPPED[$side]:-} $key"
        if [[ " ${DEFINING[$scenario]} " == *" $key "* ]] && [ -z "${NA[$scenario,$side]:-}" ]; then
          NA[$scenario,$side]="it has no $(config_key "$key")"
        fi
      else
        echo "${SIDE_LABEL[$side]} refuses $kv for a reason other than an unknown key: $CHECK" >&2
        exit 1
      fi
    done
    if [ -z "${NA[$scenario,$side]:-}" ] && ! check "$bin" "${kept[@]}"; then
      echo "${SIDE_LABEL[$side]} refuses the $scenario overrides together (${kept[*]}): $CHECK" >&2
      exit 1
    fi
    if [ "$side" = head ] && [ -n "$HEAD_ENV" ]; then
      # shellcheck disable=SC2206 # a list of KEY=VALUE words
      extra=($HEAD_ENV)
      check "$bin" "${kept[@]}" "${extra[@]}" ||
        { echo "${SIDE_LABEL[head]} refuses HEAD_ENV ($HEAD_ENV): $CHECK" >&2; exit 1; }
      kept+=("${extra[@]}")
    fi
    ACCEPTED[$scenario,$side]="${kept[*]}"
  done
done

echo
echo "mcp-ratelimit bench-compare: ${SIDE_LABEL[base]} vs ${SIDE_LABEL[head]}"
echo "$CORES cores, server on CPU $SERVER_CPU, wrk on CPU $WRK_CPU, $CONNECTIONS connections, $SESSIONS_PER_RUN sessions, ${WARMUP}s warm-up + ${DURATION}s per run, $ROUNDS rounds"
echo "tool: $TOOL through tools/call, $CALLERS_ARE; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for side in "${SIDES[@]}"; do
  dropped=$(for key in ${DROPPED[$side]:-}; do config_key "$key"; done | sort -u | tr '\n' ' ')
  echo "keys ${SIDE_LABEL[$side]} does not have (their overrides left out): ${dropped:-none}"
done
for scenario in $SCENARIOS; do
  for side in "${SIDES[@]}"; do
    [ -n "${NA[$scenario,$side]:-}" ] && echo "scenario $scenario is n/a for ${SIDE_LABEL[$side]}: ${NA[$scenario,$side]}"
  done
done
echo

metric_sum() { # METRICS-TEXT NAME [EXCLUDE-REGEX]: the sum of a counter's samples
  awk -v name="$2" -v skip="${3:-^$}" '
    index($1, name) == 1 && (length($1) == length(name) || substr($1, length(name) + 1, 1) == "{") && $0 !~ skip { s += $NF }
    END { printf "%d", s }' <<<"$1"
}

# measure SCENARIO SIDE ROUND: one run; records RPS, CPU, FLAG.
declare -A RPS CPU FLAG
measure() {
  local scenario=$1 side=$2 round=$3
  local bin=${SIDE_BIN[$side]} script=scripts/load/tools_call.lua sids="" overrides
  read -r -a overrides <<<"${ACCEPTED[$scenario,$side]}"
  [ "$scenario" = tight ] && script=scripts/load/static_ping.lua
  [ "$scenario" = redis ] && redis-cli -p "$REDIS_PORT" flushall >/dev/null
  # shellcheck disable=SC2034 # read by start_server, as PORT
  BIN=$bin
  PORT=$(free_port)
  local up=0
  RUST_LOG=error start_server "$WORK/server.log" env "${overrides[@]}" taskset -c "$SERVER_CPU" -- --config "${SIDE_CONFIG[$side]}" || up=$?
  trap cleanup EXIT # start_server set its own
  [ "$up" = 0 ] || { echo "$scenario on ${SIDE_LABEL[$side]}: the server did not start" >&2; exit 1; }
  local url="http://127.0.0.1:$PORT"
  if [ "$scenario" != tight ]; then
    local sid
    for _ in $(seq 1 "$SESSIONS_PER_RUN"); do
      sid=$(open_session "$url/mcp" "${SIDE_TOKEN[$side]}")
      [ -n "$sid" ] && sids="$sids${sids:+,}$sid"
    done
    [ -n "$sids" ] || { echo "$scenario on ${SIDE_LABEL[$side]}: no MCP session could be opened" >&2; cat "$WORK/server.log" >&2; exit 1; }
  fi
  export TOKEN=${SIDE_TOKEN[$side]}
  SESSIONS=$sids taskset -c "$WRK_CPU" wrk -t1 -c"$CONNECTIONS" -d"${WARMUP}s" -s "$script" "$url" >/dev/null 2>&1 || true
  local before after result metrics_before metrics_after
  metrics_before=$(curl -fsS "$url/metrics" 2>/dev/null || true)
  before=$(cpu_ticks "$SERVER_PID")
  local redis_before=0 redis_after=0
  [ "$scenario" = redis ] && redis_before=$(cpu_ticks "$REDIS_PID")
  result=$(SESSIONS=$sids taskset -c "$WRK_CPU" wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" -s "$script" "$url" | grep '^RESULT') ||
    { echo "$scenario on ${SIDE_LABEL[$side]}: wrk gave no result" >&2; cat "$WORK/server.log" >&2; exit 1; }
  after=$(cpu_ticks "$SERVER_PID")
  [ "$scenario" = redis ] && redis_after=$(cpu_ticks "$REDIS_PID")
  metrics_after=$(curl -fsS "$url/metrics" 2>/dev/null || true)
  stop_server

  local rps requests non_2xx errors refused upstream_failed
  rps=$(sed -E 's/.* rps=([0-9]+).*/\1/' <<<"$result")
  requests=$(sed -E 's/.* requests=([0-9]+).*/\1/' <<<"$result")
  non_2xx=$(sed -E 's/.* non_2xx=([0-9]+).*/\1/' <<<"$result")
  errors=$(sed -E 's/.* errors=([0-9]+).*/\1/' <<<"$result")
  # Over the measured run only; the server may have answered a few more than wrk counted.
  refused=$(( $(metric_sum "$metrics_after" mcp_ratelimit_rejections_total) - $(metric_sum "$metrics_before" mcp_ratelimit_rejections_total) ))
  upstream_failed=$(( $(metric_sum "$metrics_after" mcp_ratelimit_upstream_requests_total 'outcome="ok"') -
    $(metric_sum "$metrics_before" mcp_ratelimit_upstream_requests_total 'outcome="ok"') ))
  RPS[$scenario,$side,$round]=$rps
  CPU[$scenario,$side,$round]=$(awk -v t="$((after - before))" -v hz="$TICKS" -v r="$requests" 'BEGIN { printf "%.1f", (r > 0 ? t * 1e6 / hz / r : 0) }')
  local store=""
  if [ "$scenario" = redis ]; then
    local commands trips
    commands=$(( $(metric_sum "$metrics_after" mcp_ratelimit_store_commands_total) - $(metric_sum "$metrics_before" mcp_ratelimit_store_commands_total) ))
    trips=$(( $(metric_sum "$metrics_after" mcp_ratelimit_store_round_trips_total) - $(metric_sum "$metrics_before" mcp_ratelimit_store_round_trips_total) ))
    store=$(awk -v t="$((redis_after - redis_before))" -v hz="$TICKS" -v r="$requests" -v c="$commands" -v p="$trips" \
      'BEGIN { if (r > 0) printf "  Redis %.1f µs CPU/request", t * 1e6 / hz / r; if (r > 0 && p > 0) printf ", %.2f commands in %.2f round trips a call", c / r, p / r }')
  fi
  local flag=""
  case $scenario in
    tight) [ "$non_2xx" = "$requests" ] || flag="$flag $((requests - non_2xx)) not a 429;" ;;
    refused)
      [ "$non_2xx" = 0 ] || flag="$flag $non_2xx non-2xx;"
      [ "$refused" -ge "$requests" ] || flag="$flag $((requests - refused)) not refused;"
      ;;
    *)
      [ "$non_2xx" = 0 ] || flag="$flag $non_2xx non-2xx;"
      [ "$refused" = 0 ] || flag="$flag $refused refused;"
      ;;
  esac
  [ "$upstream_failed" = 0 ] || flag="$flag $upstream_failed upstream failures;"
  [ "$errors" = 0 ] || flag="$flag $errors socket errors;"
  [ -n "$metrics_after" ] || flag="$flag no /metrics;"
  FLAG[$scenario,$side,$round]=$flag
  printf "  %-9s round %d  %-${LABEL_WIDTH}s %8s calls/s  %7s µs CPU/request%s%s\n" "$scenario" "$round" "${SIDE_LABEL[$side]}" \
    "$rps" "${CPU[$scenario,$side,$round]}" "$store" "${flag:+  CHECK:$flag}"
}

for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then order=(base head); else order=(head base); fi
  for scenario in $SCENARIOS; do
    for side in "${order[@]}"; do
      [ -n "${NA[$scenario,$side]:-}" ] || measure "$scenario" "$side" "$round"
    done
  done
done

median() { # FORMAT <<<"values...": their median, empty for none
  tr ' ' '\n' | sed '/^$/d' | sort -g | awk -v f="$1" '{ v[NR] = $1 }
    END { if (NR) printf f "\n", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b == 0) print "n/a"; else printf "%.2f\n", a / b }'; }
cell() { if [ -n "$1" ]; then printf '%s' "$1"; else printf 'n/a'; fi; }

declare -A MEDIAN_RPS row
echo
# (µ is two bytes: one more for printf to pad)
printf '%-9s %-7s %14s %14s %10s %15s %15s\n' scenario round "BASE calls/s" "HEAD calls/s" HEAD/BASE "BASE µs/req" "HEAD µs/req"
for scenario in $SCENARIOS; do
  for round in $(seq 1 "$ROUNDS") median; do
    row=()
    for side in "${SIDES[@]}"; do
      if [ "$round" = median ]; then
        rates="" cpus=""
        for r in $(seq 1 "$ROUNDS"); do
          rates="$rates ${RPS[$scenario,$side,$r]:-}"
          cpus="$cpus ${CPU[$scenario,$side,$r]:-}"
        done
        row[rps,$side]=$(median %.0f <<<"$rates")
        row[cpu,$side]=$(median %.1f <<<"$cpus")
        MEDIAN_RPS[$scenario,$side]=${row[rps,$side]}
      else
        row[rps,$side]=${RPS[$scenario,$side,$round]:-}
        row[cpu,$side]=${CPU[$scenario,$side,$round]:-}
      fi
    done
    notes=""
    [ "$round" = median ] || notes="${FLAG[$scenario,base,$round]:-}${FLAG[$scenario,head,$round]:-}"
    printf '%-9s %-7s %14s %14s %10s %14s %14s%s\n' "$scenario" "$round" "$(cell "${row[rps,base]}")" "$(cell "${row[rps,head]}")" \
      "$(ratio "${row[rps,head]}" "${row[rps,base]}")" "$(cell "${row[cpu,base]}")" "$(cell "${row[cpu,head]}")" "${notes:+  CHECK:$notes}"
  done
done
echo
for side in "${SIDES[@]}"; do
  printf "redis ÷ generous (medians), %-$((LABEL_WIDTH + 1))s %s\n" "${SIDE_LABEL[$side]}:" \
    "$(ratio "${MEDIAN_RPS[redis,$side]:-}" "${MEDIAN_RPS[generous,$side]:-}")"
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) (figures from a busy machine are not for the record)"
