#!/usr/bin/env bash
# The stacked KvCache request against NCCL (gpu_two_apps.py --only kv), ROUNDS runs of REPS
# repetitions on a lent GPU machine, each run between two timings of a fixed single-thread
# Python loop (the host CPU's speed just before and after it). Writes $OUT/kvc.tgz.
#   bash benchmarks/device/kv_cpu_probe.sh ROUNDS REPS
set -u
rounds=$1; reps=$2
OUT_SAVE=$OUT
OUT=/tmp/setup-kv bash benchmarks/device/run.sh >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
OUT=$OUT_SAVE
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 FABRIC_EFA_PROVIDER=shm FI_TCP_IFACE=lo OMP_NUM_THREADS=1 CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
export PYTHONPATH=$PWD/packages/fabric-core/src:$PWD/packages/fabric-sim/src:$PWD/packages/fabric-apps/src
probe() { python3 -c '
import time
best = 1e9
for _ in range(5):
    t = time.perf_counter(); s = 0
    for i in range(2_000_000): s += i
    best = min(best, time.perf_counter() - t)
print(f"{best * 1e3:.1f}")'; }
mkdir -p /tmp/kvc
grep -m1 "model name" /proc/cpuinfo
for i in $(seq 1 $rounds); do
  a=$(probe)
  timeout 150 python3 benchmarks/gpu_two_apps.py --only kv --reps $reps --out /tmp/kvc/kv-$i.json > /tmp/kvc/kv-$i.log 2>&1
  b=$(probe)
  echo "run $i: cpu loop ${a} / ${b} ms; $(grep -E 'fabric/NCCL' /tmp/kvc/kv-$i.log | tr '\n' ' ')"
  grep -E 'phases' /tmp/kvc/kv-$i.log | sed 's/^/   /'
done
(cd /tmp/kvc && tar czf $OUT/kvc.tgz .)
