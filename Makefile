# The two commands a new user needs: `make run` and `make test`.
CARGO ?= cargo

.PHONY: run test proxy-fixtures docs fuzz check fmt inspector build install bench bench-redis bench-compare load conformance burst cluster soak valkey idle-abuse simulate chromium dashboard-screenshot

## Serve MCP on http://127.0.0.1:3000/mcp with the defaults (in-memory limits, embedded mock upstream).
run:
	$(CARGO) run --release -- serve

## Every test: unit, property, integration (HTTP and stdio), CLI, the examples, the dashboard in
## headless Chromium, then the doc examples (which --all-targets leaves out).
test: chromium proxy-fixtures
	$(CARGO) test --workspace --all-targets --no-fail-fast
	$(CARGO) test --workspace --doc

## The library's docs with every warning an error, and what `cargo package` would publish.
docs:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps
	$(CARGO) package --list --allow-dirty >/dev/null

## The MCP servers tests/doors/proxy.rs proxies (server-everything from npm, FastMCP from PyPI), installed once into .tools/.
proxy-fixtures:
	scripts/proxy-fixtures.sh

## Debian's chromium for tests/server/dashboard.rs, installed when missing (as root with apt-get; else the test says how).
chromium:
	@command -v chromium >/dev/null 2>&1 || [ -n "$$CHROMIUM" ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "chromium missing: installing Debian's package for tests/server/dashboard.rs"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	      || echo "could not install chromium: tests/server/dashboard.rs will fail saying how to get it"; \
	  else \
	    echo "chromium missing: tests/server/dashboard.rs will fail; apt-get install chromium, or set CHROMIUM"; \
	  fi; }

build:
	$(CARGO) build

## Put `mcp-ratelimit` on PATH (~/.cargo/bin), so the README's `mcp-ratelimit …` commands work as written.
install:
	$(CARGO) install --locked --path .

## Formatting and lints.
check:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

## Drive the server with the official MCP Inspector CLI over HTTP and stdio (installs it into .tools/).
inspector:
	scripts/inspector.sh

## Criterion benchmarks of every algorithm against governor (results in docs/performance.md and BENCHMARKS.md).
bench:
	scripts/bench.sh

## The Redis store against one Redis round trip: decisions/s, latency, one vs three scopes (starts its own Redis).
bench-redis:
	scripts/bench-redis.sh

## wrk load test: limits off vs on, and the cost of a 429.
load:
	scripts/load.sh

## This build against an older one through the same wrk load, back to back: limits off, generous,
## tight and Redis, HEAD/BASE per scenario. BASE=<rev> [HEAD=<rev>, or . for the working tree].
bench-compare:
	@test -n "$(BASE)" || { echo "usage: make bench-compare BASE=<rev> [HEAD=<rev>, or . for the working tree]"; exit 2; }
	scripts/bench-compare.sh $(BASE) $(HEAD)

## The official MCP conformance suite against a fresh server.
conformance:
	scripts/conformance.sh

## 150 POSTs with curl against a fresh server: the status-code histogram.
burst:
	scripts/burst.sh --start

## Redis, one mock upstream and three instances: one caller gets one budget, not three.
cluster:
	scripts/cluster.sh

## `make test` with Valkey in Redis's place (valkey-server on PATH, or VALKEY_BIN=<dir>): not in CI, whose Debian has none.
valkey:
	scripts/valkey.sh

## 10 minutes of three instances, a Redis killed every 2 minutes, a chaos upstream, 50 callers at twice their budget: the report.
soak:
	scripts/soak.sh

## 10,000 idle MCP sessions and byte-at-a-time clients against one instance: memory, reaping, cut-offs, a caller's p99.
idle-abuse:
	scripts/idle-abuse.sh

## Agent traffic shapes against the configured budgets (every algorithm), a capacity drop and identical asks: tables, and charts in simulate-out/.
simulate:
	$(CARGO) run --release -- simulate

## docs/dashboard.png: the browser test's screenshot of /dashboard with refusals on it.
dashboard-screenshot: chromium
	scripts/dashboard-screenshot.sh

## Coverage-guided fuzzing of every input a client controls (cargo fuzz), 300 s per target.
fuzz:
	scripts/fuzz.sh
