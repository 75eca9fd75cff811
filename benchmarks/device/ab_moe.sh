#!/usr/bin/env bash
# MoE A/B on a lent GPU machine: this tree's fabric-apps (new) and an earlier commit's (base:
# .gpu/base.tgz, made here with `git archive BASE packages/fabric-apps/src | gzip >.gpu/base.tgz`),
# run alternately, both over this tree's fabric-core and fabric-efa: `fabric bench moe --device
# cuda --ranks 2 --shapes SHAPES --steps 40` ROUNDS times each, NCCL's baseline in every run.
# First the MoE GPU tests of tests/gpu. FULL=1 then runs one full bench of new (decode and
# prefill, with its plot); PHASES=1 moe_phases.py on new; TAR=1 packs $OUT into $OUT/all.tgz
# (the device tool returns at most 8 files). Writes $OUT/moe-{new,base}-ROUND.{json,log}.
#   bash benchmarks/device/ab_moe.sh ROUNDS SHAPES
set -u
R=$PWD; rounds=$1; shapes=$2
mkdir -p /tmp/base && tar xzf .gpu/base.tgz -C /tmp/base
OUT=/tmp/setup-new bash benchmarks/device/run.sh >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 FABRIC_EFA_PROVIDER=shm FI_TCP_IFACE=lo OMP_NUM_THREADS=1 CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
core=$R/packages/fabric-core/src:$R/packages/fabric-sim/src
PYTHONPATH=$core:$R/packages/fabric-apps/src timeout 200 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider -k "moe" 2>&1 | tail -3
for i in $(seq 1 $rounds); do
  for tag in new base; do
    if [ $tag = new ]; then apps=$R/packages/fabric-apps/src; else apps=/tmp/base/packages/fabric-apps/src; fi
    PYTHONPATH=$core:$apps timeout 200 python3 -m fabric_core.cli bench moe --backend efa --device cuda --ranks 2 \
      --shapes $shapes --steps 40 --json $OUT/moe-$tag-$i.json > $OUT/moe-$tag-$i.log 2>&1
    echo "$tag $i: $(grep -E 'fabric / baseline' $OUT/moe-$tag-$i.log | tr '\n' ' ')"
    grep -E "^(decode|prefill) " $OUT/moe-$tag-$i.log | sed "s/^/   /"
  done
done
if [ "${FULL:-0}" = 1 ]; then
  PYTHONPATH=$core:$R/packages/fabric-apps/src timeout 200 python3 -m fabric_core.cli bench moe --backend efa --device cuda \
    --ranks 2 --json $OUT/moe-ep2-nccl.json --plot $OUT/moe-ep2-nccl.png > $OUT/moe-full.log 2>&1
  tail -8 $OUT/moe-full.log
fi
if [ "${PHASES:-0}" = 1 ]; then
  PYTHONPATH=$core:$R/packages/fabric-apps/src timeout 150 python3 benchmarks/moe_phases.py --device cuda --steps 40 --json $OUT/phases-new.json > $OUT/phases-new.log 2>&1
  grep -E "phase p50|dispatch_send|dispatch_recv|combine_send|combine_recv|combine_positions" $OUT/phases-new.log | head -12
fi
if [ "${TAR:-0}" = 1 ]; then
  (cd $OUT && tar czf /tmp/all.tgz --exclude all.tgz . && rm -rf ./* && mv /tmp/all.tgz .)
fi
