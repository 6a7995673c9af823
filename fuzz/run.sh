#!/usr/bin/env bash
# The bounded fuzz pass: builds the fuzz targets (stable toolchain, no sanitizer: coverage
# instrumentation only) and runs each for SECONDS (default 30), starting from its committed
# seeds in fuzz/corpus/<target> and what earlier runs found in fuzz/work/<target> (kept between
# runs, never committed). Fails on the first crash, timeout or over-allocation, leaving the
# input in fuzz/artifacts/<target>/ and the replay command in the log.
#
#   fuzz/run.sh 30              # every target, 30 s each
#   fuzz/run.sh 600 session     # one target
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-30}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(frame session resp config trace)
fi

cargo fuzz build --sanitizer none
for t in "${targets[@]}"; do
  mkdir -p "work/$t" "artifacts/$t"
  echo "== fuzz $t (${seconds}s)"
  # -timeout: one input taking longer than 10 s is a hang; -rss_limit_mb bounds the process
  # (the targets' own counting allocator bounds what one input may make the code allocate).
  log="work/$t.log"
  if ! cargo fuzz run --sanitizer none "$t" "work/$t" "corpus/$t" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "fuzz target $t failed; the input is in fuzz/artifacts/$t/" >&2
    exit 1
  fi
  grep -E '^stat::number_of_executed_units|^stat::new_units_added|cov: ' "$log" | tail -n 3
done
