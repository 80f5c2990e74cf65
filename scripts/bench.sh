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
cargo bench --bench limiters -- "$@"

criterion_dir=${CRITERION_HOME:-${CARGO_TARGET_DIR:-target}/criterion}
python3 - "$criterion_dir" "$started" <<'PY'
import json, os, sys

root, started = sys.argv[1], float(sys.argv[2])
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
        mean = json.load(f)["mean"]
    key = (meta["group_id"], meta.get("value_str") or "", meta.get("function_id") or "")
    ci = mean["confidence_interval"]
    rows[key] = (mean["point_estimate"], ci["lower_bound"], ci["upper_bound"])

if not rows:
    sys.exit(f"no fresh criterion results under {root}")

group_order = ["hot_key", "many_keys", "contended_two_threads", "clock_read"]
alg_order = ["token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window", "leaky_bucket",
             "concurrency", "concurrency_1_held", "system_clock", "governor"]
def order(k):
    g, clock, alg = k
    return (group_order.index(g) if g in group_order else 99, g, clock,
            alg_order.index(alg) if alg in alg_order else 99, alg)

header = f"{'group':<22} {'clock':<11} {'limiter':<19} {'ns/decision':>11} {'95% CI':>17} {'ours/governor':>13} {'decisions/s':>12}"
print()
print(header)
print("-" * len(header))
last = None
for key in sorted(rows, key=order):
    group, clock, alg = key
    if last is not None and last != (group, clock):
        print()
    last = (group, clock)
    mean, lo, hi = rows[key]
    gov = rows.get((group, clock, "governor"))
    ratio = "" if alg == "governor" or gov is None else f"{mean / gov[0]:.2f}x"
    name = "governor" if alg == "governor" else f"ours {alg}"
    print(f"{group:<22} {clock:<11} {name:<19} {mean:>11.1f} {f'[{lo:.1f}, {hi:.1f}]':>17} {ratio:>13} {1e9 / mean:>12.3g}")
PY
