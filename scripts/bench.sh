#!/usr/bin/env bash
# Runs the limiter benchmarks (benches/limiters.rs) and prints ns per decision for each of ours
# next to governor's keyed limiter, with the ratio ours/governor (below 1 = ours is faster).
#
#   scripts/bench.sh                 # everything (about 2 minutes on 2 cores, after the build)
#   scripts/bench.sh hot_key         # arguments go to criterion: a filter, --sample-size 50, ...
#
# Criterion's output is read from $CRITERION_HOME, else $CARGO_TARGET_DIR/criterion, else
# target/criterion. Only results written by this run are listed.
set -euo pipefail
cd "$(dirname "$0")/.."

started=$(date +%s)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo bench --bench limiters -- "$@" | tee "$log"

criterion_dir=${CRITERION_HOME:-${CARGO_TARGET_DIR:-target}/criterion}
python3 - "$criterion_dir" "$started" "$log" <<'PY'
import json, os, sys

root, started, log = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rows = {}
for dirpath, _, files in os.walk(root):
    if os.path.basename(dirpath) != "new" or "estimates.json" not in files or "benchmark.json" not in files:
        continue
    estimates = os.path.join(dirpath, "estimates.json")
    if os.path.getmtime(estimates) + 1 < started:
        continue  # left over from an earlier run
    with open(os.path.join(dirpath, "benchmark.json")) as f:
        meta = json.load(f)
    with open(estimates) as f:
        est = json.load(f)
    key = (meta["group_id"], meta.get("value_str") or "", meta.get("function_id") or "")
    ci = est["mean"]["confidence_interval"]
    rows[key] = (est["mean"]["point_estimate"], ci["lower_bound"], ci["upper_bound"], est["median"]["point_estimate"])

if not rows:
    print(f"no fresh criterion results under {root}")

group_order = ["hot_key", "many_keys", "contended_two_threads", "clock_read"]
alg_order = ["token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window", "leaky_bucket",
             "concurrency", "concurrency_1_held", "system_clock", "governor"]
def order(k):
    g, clock, alg = k
    return (group_order.index(g) if g in group_order else 99, g, clock,
            alg_order.index(alg) if alg in alg_order else 99, alg)

def table():
    header = (f"{'group':<22} {'clock':<11} {'limiter':<19} {'mean ns':>8} {'95% CI of mean':>16} "
              f"{'median ns':>9} {'ours/gov mean':>13} {'ours/gov median':>15} {'decisions/s':>11}")
    print()
    print("ns per decision (criterion mean and median); ours/gov < 1 means ours is faster;")
    print("decisions/s = 1e9 / median (for contended_two_threads: both threads together)")
    print(header)
    print("-" * len(header))
    last = None
    for key in sorted(rows, key=order):
        group, clock, alg = key
        if last is not None and last != (group, clock):
            print()
        last = (group, clock)
        mean, lo, hi, median = rows[key]
        gov = rows.get((group, clock, "governor"))
        paired = alg != "governor" and gov is not None
        ratio_mean = f"{mean / gov[0]:.2f}x" if paired else ""
        ratio_median = f"{median / gov[3]:.2f}x" if paired else ""
        name = "governor" if alg == "governor" else f"ours {alg}"
        print(f"{group:<22} {clock:<11} {name:<19} {mean:>8.1f} {f'[{lo:.1f}, {hi:.1f}]':>16} "
              f"{median:>9.1f} {ratio_mean:>13} {ratio_median:>15} {1e9 / median:>11.3g}")

if rows:
    table()

paired_lines = [line.rstrip()[len("paired "):] for line in open(log) if line.startswith("paired ")]
if paired_lines:
    print()
    print("\n".join(paired_lines))
PY
