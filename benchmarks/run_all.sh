#!/usr/bin/env bash
# Run the sqla_outbox benchmarks with their defaults, one after the other.
#
#   benchmarks/run_all.sh                      # all of them
#   benchmarks/run_all.sh dispatch wake        # some of them (names: see BENCHES below)
#
# Creates .venv-bench (python3.11 -m venv; pip install -e '.[dev,bench]') when missing.
# Writes benchmarks/results/<name>.json and <name>.txt (BENCH_OUT=dir to change).
# BENCH_SNAPSHOT=<git ref> measures that commit's sqla_outbox (git archive into a temp
# dir put first on PYTHONPATH) instead of the working tree, e.g. BENCH_SNAPSHOT=HEAD.
# BENCH_PG_URL / BENCH_REDIS_URL override the PostgreSQL server and Redis URLs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3.11}
BENCHES=(dispatch wake wake_modes delayed relay_drain relay_sqs strict_sqs worker memory pipeline scaling wake_abuse what_if dashboard run_indexes cancel limits_overhead)

if [ ! -x .venv-bench/bin/python ]; then
    "$PYTHON" -m venv .venv-bench
    .venv-bench/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
    .venv-bench/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
fi

if [ -n "${BENCH_SNAPSHOT:-}" ]; then
    snapshot=$(mktemp -d)
    trap 'rm -rf "$snapshot"' EXIT
    git archive "$BENCH_SNAPSHOT" sqla_outbox | tar -x -C "$snapshot"
    export PYTHONPATH="$snapshot${PYTHONPATH:+:$PYTHONPATH}"
    echo "measuring sqla_outbox from $BENCH_SNAPSHOT ($(git rev-parse --short "$BENCH_SNAPSHOT"))"
fi

OUT=${BENCH_OUT:-benchmarks/results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
selected=("$@")
[ ${#selected[@]} -eq 0 ] && selected=("${BENCHES[@]}")
echo "nproc=$(nproc) $(uptime)"
for name in "${selected[@]}"; do
    script="bench_${name}.py"
    [ -f "benchmarks/$script" ] || script="${name}.py"
    [ -f "benchmarks/$script" ] || { echo "unknown benchmark: $name (one of: ${BENCHES[*]})" >&2; exit 2; }
    echo "=== $name: (cd benchmarks && ../.venv-bench/bin/python $script --json $OUT/$name.json)"
    # run from benchmarks/ so `python -m` subprocesses do not import the checkout via the cwd
    (cd "$ROOT/benchmarks" && "$ROOT/.venv-bench/bin/python" "$script" --json "$OUT/$name.json") \
        2>&1 | tee "$OUT/$name.txt"
done
