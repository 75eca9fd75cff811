#!/usr/bin/env bash
# The KvCache request against NCCL on a lent GPU machine (gpu_two_apps.py --only kv): ROUNDS
# rounds, each one run of REPS repetitions per cache layout named (default: stacked then
# interleaved). CPU_PROBE=1 times a fixed single-thread Python loop just before and after each
# run (the host CPU's speed then). Writes $OUT/kv.tgz (kv-LAYOUT-ROUND.{json,log}).
#   bash benchmarks/device/kv_rounds.sh ROUNDS REPS [stacked|interleaved ...]
set -u
rounds=$1; reps=$2; shift 2
splits=${*:-stacked interleaved}
OUT_SAVE=$OUT
OUT=/tmp/setup-kv bash benchmarks/device/run.sh >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
OUT=$OUT_SAVE
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 FABRIC_EFA_PROVIDER=shm FI_TCP_IFACE=lo OMP_NUM_THREADS=1 CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
export PYTHONPATH=$PWD/packages/fabric-core/src:$PWD/packages/fabric-sim/src:$PWD/packages/fabric-apps/src
probe() {
  [ "${CPU_PROBE:-0}" = 1 ] || return 0
  python3 -c '
import time
best = 1e9
for _ in range(5):
    t = time.perf_counter(); s = 0
    for i in range(2_000_000): s += i
    best = min(best, time.perf_counter() - t)
print(f"cpu loop {best * 1e3:.1f} ms")'
}
mkdir -p /tmp/kvr
[ "${CPU_PROBE:-0}" = 1 ] && grep -m1 "model name" /proc/cpuinfo
for i in $(seq 1 "$rounds"); do
  for split in $splits; do
    before=$(probe)
    GPU_TWO_APPS_KV_SPLIT=$split timeout 150 python3 benchmarks/gpu_two_apps.py --only kv --reps "$reps" \
      --out /tmp/kvr/kv-$split-$i.json > /tmp/kvr/kv-$split-$i.log 2>&1
    after=$(probe)
    echo "$split $i: ${before:+$before / $after; }$(grep -E 'fabric/NCCL|phases' /tmp/kvr/kv-$split-$i.log | tr '\n' ' ')"
  done
done
(cd /tmp/kvr && tar czf "$OUT/kv.tgz" .)
