#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer with AddressSanitizer) of every input a client or
# an upstream controls: a tool call's arguments through validation and the guard, any TOML as a
# config, the header parsers, and any body POSTed to /mcp through the whole router.
#
#   scripts/fuzz.sh                       # 300 s per target: the figures in docs/resilience.md
#   scripts/fuzz.sh --seconds 10 --quick  # CI: a debug build without a sanitizer
#   scripts/fuzz.sh --seconds 60 config   # one target
#
# --quick builds the targets in the dev profile with no sanitizer: 3.5 minutes from nothing on two
# cores instead of about 15 for an optimized AddressSanitizer build, and with overflow checks and
# debug assertions on, so arithmetic that would wrap panics (the code under test has no `unsafe`
# of its own for a sanitizer to watch). It runs fewer inputs a second; the long runs keep ASan.
#
# The seeds are in fuzz/corpus/<target> (committed); what the fuzzer finds goes to
# fuzz/corpus-work/<target> (ignored). A crash stops the run with its input in fuzz/artifacts/;
# fix it and add the input as a regression test. cargo fuzz runs on stable with RUSTC_BOOTSTRAP=1.
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER=300
BUILD=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) SECONDS_PER=$2; shift 2 ;;
    --quick) BUILD=(--dev --sanitizer none); shift ;;
    *) break ;;
  esac
done
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(config headers tool_call jsonrpc_body)

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "installing cargo-fuzz (crates.io)"
  cargo install cargo-fuzz --locked --quiet
fi
export RUSTC_BOOTSTRAP=1
# Beside the project's own build (CARGO_TARGET_DIR, or cargo's configured target dir).
. scripts/lib.sh
TARGET_DIR="$(target_dir)/fuzz"

printf '%-14s %8s %12s %10s %8s %8s\n' target seconds executions "execs/s" corpus cov
for target in "${TARGETS[@]}"; do
  mkdir -p "fuzz/corpus-work/$target"
  log=$(mktemp)
  if ! cargo fuzz run --fuzz-dir fuzz --target-dir "$TARGET_DIR" "${BUILD[@]}" "$target" \
      "fuzz/corpus-work/$target" "fuzz/corpus/$target" -- \
      -max_total_time="$SECONDS_PER" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    if grep -q "failed to build fuzz script" "$log"; then
      echo "FAIL: fuzz target $target does not build (the compiler's message is above)" >&2
    else
      echo "FAIL: fuzz target $target crashed or hung; the input is in fuzz/artifacts/$target/" >&2
    fi
    exit 1
  fi
  execs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' || echo 0)
  rate=$(grep -Eo 'stat::average_exec_per_sec: *[0-9]+' "$log" | grep -Eo '[0-9]+$' || echo 0)
  last=$(grep -E '^#[0-9]+' "$log" | tail -n 1)
  cov=$(grep -Eo 'cov: [0-9]+' <<<"$last" | grep -Eo '[0-9]+' || echo 0)
  corpus=$(grep -Eo 'corp: [0-9]+' <<<"$last" | grep -Eo '[0-9]+' || echo 0)
  printf '%-14s %8s %12s %10s %8s %8s\n' "$target" "$SECONDS_PER" "$execs" "$rate" "$corpus" "$cov"
  rm -f "$log"
done
