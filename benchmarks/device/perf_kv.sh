#!/usr/bin/env bash
# A flat CPU profile (perf, software clock) of both processes of gpu_two_apps.py's KvCache
# request, fabric only, on a machine without perf of its own: .gpu/perf holds a perf binary and
# the libraries it needs beyond the C and C++ runtimes (prepare.sh --perf). Writes
# perf-kv.txt (per process and thread name, the symbols with the most samples) to OUT.
#   bash benchmarks/device/perf_kv.sh PYTHON OUT
set -uo pipefail
py=$1 out=$2
perf() { LD_LIBRARY_PATH=$PWD/.gpu/perf/lib .gpu/perf/perf "$@"; }  # its libraries for it alone
GPU_TWO_APPS_FABRIC_ONLY=1 "$py" benchmarks/gpu_two_apps.py --only kv --reps 200 --out "$out/perf-kv.json" &
main=$!
kids=""
for _ in $(seq 1 600); do  # the two ranks, once both have an engine worker
  kids=$(pgrep -P "$main" -d, -f "multiprocessing" || true)
  n=0
  for k in ${kids//,/ }; do ls /proc/$k/task/*/comm >/dev/null 2>&1 && grep -qs fabric-worker /proc/$k/task/*/comm && n=$((n + 1)); done
  [ "$n" -ge 2 ] && break
  sleep 0.1
done
echo "ranks: $kids"
sleep 3  # past the set-up and the first request
perf record -e cpu-clock -F 4999 -p "$kids" -o /tmp/perf-kv.data -- sleep 4 2>&1 | tail -2
wait "$main"
echo "main exit $?"
perf report -i /tmp/perf-kv.data --stdio --sort pid,comm,dso,sym --percent-limit 0.3 2>/dev/null \
  | grep -v '^$' | head -150 > "$out/perf-kv.txt"
head -70 "$out/perf-kv.txt"
