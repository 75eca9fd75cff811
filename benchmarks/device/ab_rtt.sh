#!/usr/bin/env bash
# Host-side A/B of the engine on a lent GPU machine's many cores (no GPU used): this tree's
# fabric-efa (new) against an earlier commit's (base: .gpu/base-engine.tgz, made here with
# `git archive BASE packages/fabric-core packages/fabric-efa | gzip >.gpu/base-engine.tgz`,
# built into /tmp/base-efa and put first on PYTHONPATH), both under this tree's Python
# packages; with BASE_PYTHON=1, base runs under the base commit's fabric_core Python too (an
# A/B of a Python change: make the tarball at the commit before it). ROUNDS rounds alternate
# `fabric bench --backend efa --nics 1 --sizes SIZES` (default 8,4K) between new and base, which
# one runs first swapped every round, on each of BENCH_PROVIDERS (default shm; tcp is
# tcp;ofi_rxm on loopback): the imm round trip, GB/s and writes/s per size, paged 4 KiB
# writes. Then, with REPS > 0 (default 3), benchmarks/efa_vs_ceiling.py on new against fi_ceiling.c built here
# (PROVIDERS, default shm,tcp; CEILING_ARGS, e.g. --paired, passed on; CEILING_TIMEOUT seconds,
# default 400), and with BASE_CEILING=1 the same on base. Writes $OUT/ab.tgz
# (rtt-PROVIDER-{new,base}-ROUND.{json,log}, ab_rtt.txt, lscpu.txt, ceiling-{new,base}/).
# With CPUS (a taskset list, e.g. 0,1) the A/B rounds run on those CPUs only: a small host's
# core count on a quieter machine.
#   bash benchmarks/device/ab_rtt.sh ROUNDS
set -u
R=$PWD; rounds=${1:-6}
. benchmarks/device/ab_base_engine.sh rtt
export FI_TCP_IFACE=lo OMP_NUM_THREADS=1
[ -x .gpu/bin/fi_pingpong ] && export PATH=$R/.gpu/bin:$PATH  # (prepare.sh: the round trip's reference)
py=$R/packages/fabric-core/src:$R/packages/fabric-sim/src:$R/packages/fabric-apps/src
res=/tmp/rttab && rm -rf $res && mkdir -p $res
lscpu > $res/lscpu.txt
pin=(); [ -n "${CPUS:-}" ] && pin=(taskset -c "$CPUS")
summary() {  # per size: round-trip median (us), GB/s, writes/s; then paged pages/s
  python3 - "$1" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
rows = [f"{r['size']}B rtt_us={r['latency_us_p50']:.1f} GBps={r['bandwidth_gbytes_per_s']:.3f} "
        f"ops_s={r['ops_per_s']:.0f}" for r in doc["results"]]
print("; ".join(rows) + f"; pages_s={doc['paged']['pages_per_s']:.0f}")
EOF
}
for prov in ${BENCH_PROVIDERS:-shm}; do
  fi_prov=$prov; [ "$prov" = tcp ] && fi_prov="tcp;ofi_rxm"
  for i in $(seq 1 "$rounds"); do
    order="new base"; [ $((i % 2)) = 0 ] && order="base new"  # alternated: no build always first
    for tag in $order; do
      path=$py; [ $tag = base ] && path=/tmp/base-efa:$py
      [ $tag = base ] && [ "${BASE_PYTHON:-0}" = 1 ] && path=/tmp/base-efa:/tmp/base/packages/fabric-core/src:$py
      f=$res/rtt-$prov-$tag-$i
      FABRIC_EFA_PROVIDER=$fi_prov PYTHONPATH=$path timeout 120 "${pin[@]}" python3 -m fabric_core.cli bench --backend efa \
        --nics 1 --sizes "${SIZES:-8,4K}" --json $f.json > $f.log 2>&1
      echo "$prov $tag $i: $(summary $f.json 2>&1 | tail -1)" | tee -a $res/ab_rtt.txt
    done
  done
done
cc -O2 -Wall -I/tmp/fabric-fi/include -o /tmp/fi_ceiling benchmarks/ceiling/fi_ceiling.c -L/tmp/fabric-fi/lib -lfabric
if [ "${REPS:-3}" -gt 0 ]; then
  PYTHONPATH=$py timeout "${CEILING_TIMEOUT:-400}" python3 benchmarks/efa_vs_ceiling.py /tmp/fi_ceiling $res/ceiling-new \
    --reps "${REPS:-3}" --providers "${PROVIDERS:-shm,tcp}" ${CEILING_ARGS:-} > $res/ceiling-new.log 2>&1
  tail -30 $res/ceiling-new.log
fi
if [ "${BASE_CEILING:-0}" = 1 ]; then
  PYTHONPATH=/tmp/base-efa:$py timeout "${CEILING_TIMEOUT:-400}" python3 benchmarks/efa_vs_ceiling.py /tmp/fi_ceiling $res/ceiling-base \
    --reps "${REPS:-3}" --providers "${PROVIDERS:-shm,tcp}" ${CEILING_ARGS:-} > $res/ceiling-base.log 2>&1
  tail -30 $res/ceiling-base.log
fi
(cd $res && tar czf "$OUT/ab.tgz" .)
