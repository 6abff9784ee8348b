#!/usr/bin/env bash
# Tensor parallelism on two GPUs, measured with `kiln bench` on dummy-weight engines that hold no weight files
# (the weights are drawn on the GPUs at load: 70B in BF16 is 140 GB, more than the machine's disk).
#
#   bash scripts/tp_bench.sh 8b      # Llama-3.1-8B shape, BF16: batch-1 latency at TP=1 and TP=2
#   bash scripts/tp_bench.sh 70b     # Llama-3.1-70B shape, BF16, TP=2: batch-1 latency, throughput 128/128
#   KILN_TP_BENCH_LONG=1 bash scripts/tp_bench.sh 70b   # also throughput 2048/128
#
# Results (tables and JSON) land in $OUT (default /tmp/kiln-tp-bench). Needs kiln installed (scripts/gpu_check.sh
# installs it) and two visible GPUs.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-/tmp/kiln-tp-bench}"
work="${KILN_TP_BENCH_DIR:-/tmp/kiln-tp-engines}"
mkdir -p "$out" "$work"
status=0

build() {  # build MODEL TP: a weightless dummy engine of benchmarks/configs/MODEL split over TP ranks
  local engine="$work/$1-tp$2"
  [ -f "$engine/engine.json" ] || kiln build --checkpoint "$repo/benchmarks/configs/$1" --output "$engine" \
    --dummy-weights --no-weight-files --dtype bfloat16 --device cuda --max-batch-size 256 --max-num-tokens 8192 \
    --max-seq-len 4224 --tp-size "$2" >/dev/null || status=1
  echo "$engine"
}

bench() {  # bench NAME ENGINE ARGS...
  local name=$1 engine=$2; shift 2
  echo "== kiln bench $* ($name)"
  kiln bench "$@" --engine "$engine" --output "$out/$name.json" 2>&1 | grep --line-buffered -v "INFO" \
    | tee "$out/$name.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

case "${1:-8b}" in
  8b)
    for tp in 1 2; do
      engine=$(build llama-3.1-8b "$tp")
      bench "8b-tp$tp-latency-128-256" "$engine" latency --input-len 128 --output-len 256 --num-iters 3 \
        --max-batch-size 16
    done ;;
  70b)
    engine=$(build llama-3.1-70b 2)
    bench 70b-tp2-latency-128-256 "$engine" latency --input-len 128 --output-len 256 --num-iters 2 --max-batch-size 16
    bench 70b-tp2-throughput-128-128 "$engine" throughput --input-len 128 --output-len 128 --num-requests 1000
    if [ "${KILN_TP_BENCH_LONG:-0}" = 1 ]; then
      bench 70b-tp2-throughput-2048-128 "$engine" throughput --input-len 2048 --output-len 128 --num-requests 500
    fi ;;
  *) echo "usage: $0 8b|70b"; exit 2 ;;
esac
exit "$status"
