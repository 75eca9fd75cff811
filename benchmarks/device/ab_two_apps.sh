#!/usr/bin/env bash
# A/B on a lent GPU machine: this tree (new, installed by run.sh's setup) and an earlier commit
# (base: .gpu/base.tgz, made here with `git archive BASE packages benchmarks | gzip >.gpu/base.tgz`,
# built once into /tmp/efa-base), run alternately: gpu_two_apps.py ROUNDS times each, with its
# NCCL baseline in every run. Writes $OUT/ab-{new,base}-ROUND.json.
#   bash benchmarks/device/ab_two_apps.sh ROUNDS REPS [gpu_two_apps.py options, e.g. --only kv]
set -u
R=$PWD; rounds=$1; reps=$2; shift 2
mkdir -p /tmp/base && tar xzf .gpu/base.tgz -C /tmp/base
OUT=/tmp/setup-new bash benchmarks/device/run.sh >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
PYTHONPATH=/tmp/base/packages/fabric-core/src LIBFABRIC_HOME=/tmp/fabric-fi python3 -m pip install -q --no-deps \
  --no-build-isolation --target /tmp/efa-base /tmp/base/packages/fabric-efa >/tmp/base-build.log 2>&1 || { tail /tmp/base-build.log; exit 1; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 FABRIC_EFA_PROVIDER=shm FI_TCP_IFACE=lo OMP_NUM_THREADS=1 CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
for i in $(seq 1 $rounds); do
  for tag in new base; do
    if [ $tag = new ]; then t=$R; pre=""; else t=/tmp/base; pre=/tmp/efa-base:; fi
    (cd $t && PYTHONPATH=$pre$t/packages/fabric-core/src:$t/packages/fabric-sim/src:$t/packages/fabric-apps/src \
       python3 -c 'import fabric_efa,sys; print(fabric_efa.__file__, file=sys.stderr)' 2>&1 | sed "s/^/$tag: /" | head -1
     cd $t && PYTHONPATH=$pre$t/packages/fabric-core/src:$t/packages/fabric-sim/src:$t/packages/fabric-apps/src \
       python3 benchmarks/gpu_two_apps.py --reps $reps --out $OUT/ab-$tag-$i.json "$@" 2>&1 | grep -E "fabric/NCCL|phases" | sed "s/^/$tag $i: /")
  done
done
