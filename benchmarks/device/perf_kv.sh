#!/usr/bin/env bash
# A flat CPU profile (perf, software clock) of both processes of gpu_two_apps.py's KvCache
# request, fabric only, on a machine without perf of its own: .gpu/perf holds a perf binary and
# the libraries it needs beyond the C and C++ runtimes (prepare.sh --perf). Writes
# perf-kv.txt (per process and thread name, the symbols with the most samples) to OUT.
#   bash benchmarks/device/perf_kv.sh PYTHON OUT
set -uo pipefail
py=$1 out=$2
perf() { LD_LIBRARY_PATH=$PWD/.gpu/perf/lib .gpu/perf/perf "$@"; }  # its libraries for it alone
warm=/tmp/perf-kv-warm
rm -f "$warm"
GPU_TWO_APPS_FABRIC_ONLY=1 GPU_TWO_APPS_WARM_FILE=$warm "$py" benchmarks/gpu_two_apps.py --only kv --reps 400 \
  --out "$out/perf-kv.json" &
main=$!
for _ in $(seq 1 1200); do [ -e "$warm" ] && break; sleep 0.1; done  # two requests landed
[ -e "$warm" ] || { echo "no request landed within 120 s"; kill "$main"; exit 1; }
kids=$(pgrep -P "$main" -d, -f "multiprocessing" || true)
echo "ranks: $kids"
# PERF_KV_CALLERS=1: call graphs (DWARF unwinding, at a lower rate), and the workers' call
# trees (per thread, callees under their callers) in perf-kv-callers.txt
graph=()
[ "${PERF_KV_CALLERS:-0}" = 1 ] && graph=(--call-graph dwarf,16384 -F 999) || graph=(-F 4999)
perf record -e cpu-clock "${graph[@]}" -p "$kids" -o /tmp/perf-kv.data -- sleep 3 2>&1 | tail -2
wait "$main"
echo "main exit $?"
perf report -i /tmp/perf-kv.data --stdio --no-children --sort pid,comm,dso,sym --percent-limit 0.3 -g none 2>/dev/null \
  | grep -v '^$' | head -150 > "$out/perf-kv.txt"
perf report -i /tmp/perf-kv.data --stdio --no-children --sort pid,comm --percent-limit 0.5 -g none 2>/dev/null \
  | grep -v '^$' | grep -v '^#' > "$out/perf-kv-threads.txt"
cat "$out/perf-kv-threads.txt"
if [ "${PERF_KV_CALLERS:-0}" = 1 ]; then  # the workers' call trees (DWARF reports are slow: bounded)
  timeout 150 perf report -i /tmp/perf-kv.data --stdio --no-children --comm fabric-worker --sort pid,comm \
    --percent-limit 1 2>/dev/null | grep -v '^$' | cut -c1-220 | head -1500 >"$out/perf-kv-callers.txt"
fi
head -70 "$out/perf-kv.txt"
