#!/usr/bin/env bash
# KvCache A/B of the engine on a lent GPU machine: this tree's fabric-efa (new) and an earlier
# commit's (base: .gpu/base-engine.tgz, made here with `git archive BASE packages/fabric-core
# packages/fabric-efa | gzip >.gpu/base-engine.tgz`, built into /tmp/base-efa and put first on
# PYTHONPATH; its headers are its own fabric-core's), both under this tree's Python packages: gpu_two_apps.py --only kv --reps REPS,
# NCCL's baseline in every run, ROUNDS rounds alternating new and base for each cache layout
# named (default: stacked). TESTS=1 first runs tests/gpu on new; FULL=1 last runs the whole
# gpu_two_apps.py (KvCache and weights) on new. MOE_ROUNDS=N then alternates `fabric bench moe
# --device cuda --ranks 2 --shapes decode --steps 40` on new and base N times, and runs the
# whole MoE bench (decode and prefill, with its plot) on new. Writes $OUT/kv.tgz
# (kv-{new,base}-LAYOUT-ROUND.{json,log}, tests.log, two-apps.{json,log},
# moe-{new,base}-ROUND.{json,log}, moe-ep2-nccl.{json,png,log}).
#   bash benchmarks/device/ab_kv.sh ROUNDS REPS [stacked|interleaved ...]
set -u
R=$PWD; rounds=$1; reps=$2; shift 2
splits=${*:-stacked}
. benchmarks/device/ab_base_engine.sh kv
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 FABRIC_EFA_PROVIDER=shm FI_TCP_IFACE=lo OMP_NUM_THREADS=1 CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
py=$R/packages/fabric-core/src:$R/packages/fabric-sim/src:$R/packages/fabric-apps/src
mkdir -p /tmp/kvab
if [ "${TESTS:-0}" = 1 ]; then
  PYTHONPATH=$py timeout 300 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider > /tmp/kvab/tests.log 2>&1
  tail -4 /tmp/kvab/tests.log
fi
for i in $(seq 1 "$rounds"); do
  for split in $splits; do
    for tag in new base; do
      path=$py; [ $tag = base ] && path=/tmp/base-efa:$py
      PYTHONPATH=$path GPU_TWO_APPS_KV_SPLIT=$split timeout 150 python3 benchmarks/gpu_two_apps.py --only kv \
        --reps "$reps" --out /tmp/kvab/kv-$tag-$split-$i.json > /tmp/kvab/kv-$tag-$split-$i.log 2>&1
      echo "$tag $split $i: $(grep -E 'fabric/NCCL|phases' /tmp/kvab/kv-$tag-$split-$i.log | tr '\n' ' ')"
    done
  done
done
if [ "${FULL:-0}" = 1 ]; then
  PYTHONPATH=$py timeout 200 python3 benchmarks/gpu_two_apps.py --out /tmp/kvab/two-apps.json > /tmp/kvab/two-apps.log 2>&1
  grep -E "fabric/NCCL" /tmp/kvab/two-apps.log
fi
for i in $(seq 1 "${MOE_ROUNDS:-0}"); do
  for tag in new base; do
    path=$py; [ $tag = base ] && path=/tmp/base-efa:$py
    PYTHONPATH=$path timeout 200 python3 -m fabric_core.cli bench moe --backend efa --device cuda --ranks 2 \
      --shapes decode --steps 40 --json /tmp/kvab/moe-$tag-$i.json > /tmp/kvab/moe-$tag-$i.log 2>&1
    echo "moe $tag $i: $(grep -E 'fabric / baseline' /tmp/kvab/moe-$tag-$i.log | tr '\n' ' ')"
    grep -E "^(decode|prefill) " /tmp/kvab/moe-$tag-$i.log | sed "s/^/   /"
  done
done
if [ "${MOE_ROUNDS:-0}" -gt 0 ]; then
  PYTHONPATH=$py timeout 200 python3 -m fabric_core.cli bench moe --backend efa --device cuda --ranks 2 \
    --json /tmp/kvab/moe-ep2-nccl.json --plot /tmp/kvab/moe-ep2-nccl.png > /tmp/kvab/moe-ep2-nccl.log 2>&1
  tail -8 /tmp/kvab/moe-ep2-nccl.log
fi
(cd /tmp/kvab && tar czf "$OUT/kv.tgz" .)
