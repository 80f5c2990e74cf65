#!/usr/bin/env bash
# `make test` with Valkey in Redis's place: every test that starts a Redis (the backend suite in
# crates/redis/tests/conformance.rs; tests/limits/: one server, a Cluster of three, TLS, the
# shared line, slices, contention across three instances; the doors, the proxy, the admin API,
# the binary's examples) starts `valkey-server` where it starts `redis-server`, and `valkey-cli`
# for `redis-cli`. The rest runs as in `make test`.
#
#   scripts/valkey.sh                           # valkey-server and valkey-cli on PATH
#   VALKEY_BIN=/path/to/valkey/src scripts/valkey.sh   # or the directory holding both
#   make valkey
#
# Debian 12's package sources (this project's CI machine) have no Valkey, so CI does not run
# this: docs/redis.md says which Valkey it was last run against, and how it went.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=${VALKEY_BIN:-}
if [ -z "$dir" ]; then
  server=$(command -v valkey-server || true)
  if [ -z "$server" ]; then
    echo "needs valkey-server and valkey-cli: on PATH (apt-get install valkey-server where the package" >&2
    echo "sources have it), or VALKEY_BIN set to the directory that holds them (a source tree's src/)" >&2
    exit 2
  fi
  dir=$(dirname "$server")
fi
for bin in valkey-server valkey-cli; do
  [ -x "$dir/$bin" ] || { echo "no executable $bin in $dir" >&2; exit 2; }
done

# The tests start whatever `redis-server` and `redis-cli` PATH finds first.
shims=$(mktemp -d)
trap 'rm -rf "$shims"' EXIT
ln -s "$dir/valkey-server" "$shims/redis-server"
ln -s "$dir/valkey-cli" "$shims/redis-cli"
export PATH="$shims:$PATH"
echo "every test's Redis is: $(redis-server --version)"

make test
