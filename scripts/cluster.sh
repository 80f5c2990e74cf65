#!/usr/bin/env bash
# Three instances, one budget: starts a Redis, one mock upstream and three `serve` instances
# on loopback, all sharing the Redis; drives one caller round-robin across the three and prints
# what it got — one budget of 60 tokens and one in-flight cap of 5 jobs, not three of each.
# Stops everything it started.
#
#   scripts/cluster.sh
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/lib.sh
command -v redis-server >/dev/null || { echo "needs redis-server (apt-get install redis-server)" >&2; exit 1; }
BIN=$(debug_bin)
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
pids+=($!)

mock_port=$(free_port)
# Long image jobs, so the in-flight cap is what the caller meets.
MCP_RL__MOCK_UPSTREAM__IMAGE_JOB_MS=600000 RUST_LOG=warn \
  "$BIN" mock-upstream --listen "127.0.0.1:$mock_port" >"$work/mock.log" 2>&1 &
pids+=($!)

ports=()
for i in 1 2 3; do
  port=$(free_port)
  ports+=("$port")
  MCP_RL__STORE__BACKEND=redis MCP_RL__STORE__REDIS_URL="redis://127.0.0.1:$redis_port" \
    MCP_RL__STORE__EXPECTED_INSTANCES=3 MCP_RL__UPSTREAM__URL="http://127.0.0.1:$mock_port" \
    MCP_RL__LIMITS__CALLER__REFILL_PER_SEC=0.01 RUST_LOG=warn \
    "$BIN" serve --listen "127.0.0.1:$port" >"$work/serve-$i.log" 2>&1 &
  pids+=($!)
done
for port in "${ports[@]}"; do
  for _ in $(seq 1 200); do
    curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 0.05
  done
  curl -fsS "http://127.0.0.1:$port/health" >/dev/null || { cat "$work"/serve-*.log >&2; exit 1; }
done

echo "redis 127.0.0.1:$redis_port, mock upstream 127.0.0.1:$mock_port, instances on ports ${ports[*]}"
python3 - "${ports[@]}" <<'PY'
import json, sys, urllib.request

ports = sys.argv[1:]
TOKEN = "cluster-demo"

def post(port, body, session=None):
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
               "authorization": f"Bearer {TOKEN}"}
    if session:
        headers.update({"mcp-session-id": session, "mcp-protocol-version": "2025-11-25"})
    request = urllib.request.Request(f"http://127.0.0.1:{port}/mcp", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
        session = response.headers.get("mcp-session-id", session)
    data = [l[5:].strip() for l in text.splitlines() if l.startswith("data:") and l[5:].strip().startswith("{")]
    return (json.loads(data[0]) if data else None), session

def open_session(port):
    _, session = post(port, {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "cluster", "version": "1"}}})
    post(port, {"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
    return session

sessions = {port: open_session(port) for port in ports}
counter = 0

def call(port, tool, args):
    global counter
    counter += 1
    reply, _ = post(port, {"jsonrpc": "2.0", "id": counter, "method": "tools/call",
                           "params": {"name": tool, "arguments": args}}, sessions[port])
    return reply["result"]

# 90 calls: the coarse HTTP budget (120 POSTs, shared across the instances too) stays clear.
admitted, per_instance, refusal = 0, {p: 0 for p in ports}, None
for i in range(90):
    port = ports[i % 3]
    result = call(port, "list_articles", {"query": f"q{i}"})
    if result.get("isError"):
        refusal = refusal or result["structuredContent"]["error"]
    else:
        admitted += 1
        per_instance[port] += 1
print(f"list_articles, one caller round-robin over 3 instances: {admitted} admitted of 90 "
      f"({', '.join(str(n) for n in per_instance.values())} per instance)")
print(f"  then refused: {refusal['code']} on {refusal['scope'].split(':')[0]}, "
      f"retry_after_ms {refusal['retry_after_ms']}")

# A second caller for jobs: its own 60 tokens, so only the in-flight cap can refuse.
TOKEN = "cluster-jobs"
sessions = {port: open_session(port) for port in ports}
accepted, busy = 0, None
for i in range(9):
    result = call(ports[i % 3], "generate_image", {"prompt": f"frame {i}"})
    if result.get("isError"):
        busy = busy or result["structuredContent"]["error"]
    else:
        accepted += 1
print(f"generate_image, round-robin over 3 instances: {accepted} accepted of 9, then "
      f"{busy['code']} ({busy['scope'].split(':')[0]}:{busy['scope'].split(':')[1]}, limit {busy['limit']})")
ok = admitted <= 61 and accepted == 5
print("one budget and one in-flight cap across the instances" if ok else "MORE THAN ONE BUDGET")
sys.exit(0 if ok else 1)
PY
