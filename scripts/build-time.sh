#!/usr/bin/env bash
# How long each layer takes to build from nothing: the core alone, the library a forker depends
# on (mcp-ratelimit-rmcp, with and without Redis), and the whole server, each a debug `cargo build`
# of that package into an empty target directory of its own, one after the other.
#
#   scripts/build-time.sh            # prints one line per package: seconds, and crates compiled
#   BASE=7b6df1b scripts/build-time.sh   # also an older revision's `cargo build --lib` (the one
#                                        # crate before the workspace), built the same way
#
# Run it on a quiet machine: the figures are wall-clock seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$WORK/base" 2>/dev/null || true; rm -rf "$WORK"' EXIT

measure() { # name, directory, cargo arguments…
  local name=$1 dir=$2; shift 2
  local target="$WORK/target-$name" started=$SECONDS
  (cd "$dir" && CARGO_TARGET_DIR="$target" cargo build --locked --quiet "$@")
  local seconds=$((SECONDS - started))
  local crates
  crates=$(find "$target/debug/deps" -name '*.rmeta' | wc -l)
  printf '%-28s %5d s  %4d crates\n' "$name" "$seconds" "$crates"
}

cargo fetch --locked --quiet
if [ -n "${BASE:-}" ]; then
  git worktree add --quiet --detach "$WORK/base" "$BASE"
  (cd "$WORK/base" && cargo fetch --locked --quiet)
  measure "base ($BASE) --lib" "$WORK/base" --lib
fi
# PACKAGES picks some: core rmcp rmcp+redis server (all four by default).
for package in ${PACKAGES:-core rmcp rmcp+redis server}; do
  case $package in
    core) measure "mcp-ratelimit-core" "$ROOT" -p mcp-ratelimit-core ;;
    rmcp) measure "mcp-ratelimit-rmcp" "$ROOT" -p mcp-ratelimit-rmcp ;;
    rmcp+redis) measure "mcp-ratelimit-rmcp +redis" "$ROOT" -p mcp-ratelimit-rmcp --features redis ;;
    server) measure "mcp-ratelimit --lib" "$ROOT" -p mcp-ratelimit --lib ;;
    *) echo "unknown package $package (core, rmcp, rmcp+redis, server)" >&2; exit 2 ;;
  esac
done
