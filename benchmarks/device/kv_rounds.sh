#!/usr/bin/env bash
# The KvCache request against NCCL on a lent GPU machine, stacked then interleaved caches
# (gpu_two_apps.py --only kv), ROUNDS rounds of REPS repetitions each. Writes $OUT/kv.tgz.
#   bash benchmarks/device/kv_rounds.sh ROUNDS REPS
set -u
rounds=$1; reps=$2
OUT_SAVE=$OUT
OUT=/tmp/setup-kv bash benchmarks/device/run.sh >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
OUT=$OUT_SAVE
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 FABRIC_EFA_PROVIDER=shm FI_TCP_IFACE=lo OMP_NUM_THREADS=1 CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
export PYTHONPATH=$PWD/packages/fabric-core/src:$PWD/packages/fabric-sim/src:$PWD/packages/fabric-apps/src
mkdir -p /tmp/kvr
for i in $(seq 1 $rounds); do
  for split in stacked interleaved; do
    if [ $split = interleaved ]; then export GPU_TWO_APPS_KV_SPLIT=interleaved; else unset GPU_TWO_APPS_KV_SPLIT; fi
    timeout 150 python3 benchmarks/gpu_two_apps.py --only kv --reps $reps --out /tmp/kvr/kv-$split-$i.json > /tmp/kvr/kv-$split-$i.log 2>&1
    echo "$split $i: $(grep -E 'fabric/NCCL|phases' /tmp/kvr/kv-$split-$i.log | tr '\n' ' ')"
  done
done
(cd /tmp/kvr && tar czf $OUT/kv.tgz .)
