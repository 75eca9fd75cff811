#!/usr/bin/env bash
# On a lent GPU machine (no package index; PyTorch, pybind11, scikit-build-core, CMake there),
# with .gpu carried (benchmarks/device/prepare.sh): installs fabric from the carried wheels,
# builds fabric-efa against the machine's libfabric, then runs the steps named. Their logs and
# results go to $OUT/results.tgz (the device tool returns at most 8 files), remade after each
# step; OUT defaults to ./gpu-out. Each step is bounded by STEP_TIMEOUT seconds (default 300),
# so what finished comes back even when a later step hangs. FABRIC_SYMBOLS=1 builds fabric-efa
# unstripped (RelWithDebInfo), for perf-kv.
#
#   bash benchmarks/device/run.sh STEP...
#
# Steps: info, tests (tests/gpu), two-gpu-test (the test that needs two GPUs), bench
# (gpu_bench.py), apps (gpu_apps.py), per-wr (gpu_per_wr.py), two (gpu_two.py), two-apps
# (gpu_two_apps.py), two-apps-kv (its KvCache alone), two-apps-kv-ahead4 (the same with
# FABRIC_CUDA_LAUNCHES_AHEAD=4), two-apps-interleaved (its KvCache with FlashInfer's cache layout), moe (fabric bench moe --device cuda --ranks 2 against NCCL),
# moe-phases (benchmarks/moe_phases.py: that bench's decode shape with a timer around each stage),
# moe-profile (gpu_apps.py --only moe with rank 0 under cProfile), perf-kv (benchmarks/device/
# perf_kv.sh: a flat CPU profile of both KvCache processes; needs .gpu/perf, prepare.sh --perf),
# ceiling (benchmarks/efa_vs_ceiling.py on the host's many cores: fabric-efa in host memory
# against fi_ceiling.c built here, on shm and, where the provider exists, tcp;ofi_rxm; REPS
# repetitions, default 5), write-stream (benchmarks/write_stream.py on shm and tcp;ofi_rxm at 64 KiB:
# one submit_write per write against submit_scatter batches, beside that ceiling; ROUNDS
# rounds, default 3), write-stream-lf2 (the same against libfabric 2.x, built here from the
# source prepare.sh --libfabric2 carries: tools/libfabric2.sh), ceiling-lf2 (efa_vs_ceiling.py
# --paired against that libfabric 2.x; REPS pairs, default 3), hmem-lf2 (libfabric 2.x built
# here with CUDA, so that shm carries CUDA memory itself through FI_HMEM_CUDA, the efa
# provider's path: fabric info and tests/gpu against it, the FI_HMEM tests with
# FABRIC_EFA_CUDA_IPC=0 included), hmem-bench-lf2 (gpu_bench.py against that libfabric, CUDA
# memory carried by the engine's CUDA IPC domain and then by shm's FI_HMEM, one after the other).
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${OUT:-$PWD/gpu-out}
out=$dest/results
mkdir -p "$out"
# NVLink multicast stays off on shared GPU hosts (the device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FABRIC_EFA_PROVIDER=shm FI_TCP_IFACE=lo OMP_NUM_THREADS=1 CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
export PYTHONPATH=$PWD/packages/fabric-core/src:$PWD/packages/fabric-sim/src:$PWD/packages/fabric-apps/src
py=${PYTHON:-python3}
step_timeout=${STEP_TIMEOUT:-300}

setup() {
  [ -d .gpu/wheels ] || { echo "carry .gpu (bash benchmarks/device/prepare.sh)" >&2; return 1; }
  "$py" -m pip install -q --no-deps --no-index --force-reinstall .gpu/wheels/*.whl || return 1
  local lib
  lib=$(ldconfig -p | awk '/libfabric\.so\.1 /{print $NF; exit}')
  [ -n "$lib" ] || { echo "no libfabric.so.1 on this machine" >&2; return 1; }
  rm -rf /tmp/fabric-fi && mkdir -p /tmp/fabric-fi/lib /tmp/fabric-fi/include
  cp -r .gpu/fi/include/rdma /tmp/fabric-fi/include/ && ln -s "$lib" /tmp/fabric-fi/lib/libfabric.so
  local symbols=()  # FABRIC_SYMBOLS=1: keep the symbols, so perf names the engine's functions
  [ "${FABRIC_SYMBOLS:-0}" = 1 ] && symbols=(-Cinstall.strip=false -Ccmake.build-type=RelWithDebInfo)
  LIBFABRIC_HOME=/tmp/fabric-fi "$py" -m pip install -q --no-deps --no-build-isolation "${symbols[@]}" \
    ./packages/fabric-efa || return 1
  "$py" -c 'import fabric_efa, fabric_core; print("fabric-efa built against", fabric_core.__file__)'
}

run_step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout -k 10 "$step_timeout" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 25 "$out/$name.log"
  tar czf "$dest/results.tgz" -C "$out" .
}

# write_stream.py on shm, shm pinned to two CPUs and tcp;ofi_rxm, beside the ceiling (built
# here against the headers carried, linked to whichever libfabric.so.1 the loader finds)
write_stream() {
  local name=$1
  echo "cc -O2 -Wall -I/tmp/fabric-fi/include -o /tmp/fi_ceiling benchmarks/ceiling/fi_ceiling.c \
    -L/tmp/fabric-fi/lib -lfabric && mkdir -p '$out/$name' && \
    '$py' -c 'import fabric_efa._efa as e; print(\"libfabric\", e.libfabric_version())' && \
    for run in 'shm:' 'shm-pinned:--pin 0,1' 'tcp:--provider tcp;ofi_rxm'; do \
      echo \"== \${run%%:*}\"; '$py' benchmarks/write_stream.py --rounds ${ROUNDS:-3} --ceiling /tmp/fi_ceiling \
        \${run#*:} --json '$out/$name/'\${run%%:*}.json; done"
}

t0=$SECONDS
setup >"$out/setup.log" 2>&1
rc=$?
tar czf "$dest/results.tgz" -C "$out" .
[ $rc = 0 ] || { cat "$out/setup.log"; exit 1; }
echo "setup: $((SECONDS - t0)) s"
for step in "$@"; do
  case $step in
    info) run_step info bash -c "nvidia-smi; nvidia-smi topo -m; $py -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())'; $py -m fabric_core.cli info --backend efa" ;;
    tests) run_step tests "$py" -m pytest tests/gpu -v -rs -p no:cacheprovider ;;
    two-gpu-test) run_step two-gpu-test "$py" -m pytest tests/gpu -v -rs -p no:cacheprovider -k another_gpu ;;
    bench) run_step bench "$py" benchmarks/gpu_bench.py --out "$out/gpu.json" --plot "$out/gpu.png" ;;
    apps) run_step apps "$py" benchmarks/gpu_apps.py --out "$out/apps.json" ;;
    per-wr) run_step per-wr "$py" benchmarks/gpu_per_wr.py ;;
    two) run_step two "$py" benchmarks/gpu_two.py --out "$out/two.json" ;;
    two-apps) run_step two-apps "$py" benchmarks/gpu_two_apps.py --out "$out/two-apps.json" ;;
    two-apps-kv) run_step two-apps-kv "$py" benchmarks/gpu_two_apps.py --only kv --out "$out/two-apps-kv.json" ;;
    two-apps-kv-ahead4) FABRIC_CUDA_LAUNCHES_AHEAD=4 run_step two-apps-kv-ahead4 "$py" benchmarks/gpu_two_apps.py \
           --only kv --out "$out/two-apps-kv-ahead4.json" ;;
    two-apps-interleaved) GPU_TWO_APPS_KV_SPLIT=interleaved run_step two-apps-interleaved \
           "$py" benchmarks/gpu_two_apps.py --only kv --out "$out/two-apps-interleaved.json" ;;
    moe) run_step moe "$py" -m fabric_core.cli bench moe --backend efa --device cuda --ranks 2 \
           --json "$out/moe-ep2-nccl.json" --plot "$out/moe-ep2-nccl.png" ;;
    moe-phases) run_step moe-phases "$py" benchmarks/moe_phases.py --device cuda --steps 40 \
           --json "$out/moe-phases.json" ;;
    moe-profile) run_step moe-profile "$py" benchmarks/gpu_apps.py --only moe --steps 30 \
           --out "$out/moe-apps.json" --profile "$out/moe-prof" ;;
    ceiling) run_step ceiling bash -c "cc -O2 -Wall -I/tmp/fabric-fi/include -o /tmp/fi_ceiling \
           benchmarks/ceiling/fi_ceiling.c -L/tmp/fabric-fi/lib -lfabric && \
           '$py' benchmarks/efa_vs_ceiling.py /tmp/fi_ceiling '$out/ceiling' --reps ${REPS:-5} \
           --providers ${PROVIDERS:-shm,tcp}" ;;
    ceiling-lf2) run_step ceiling-lf2 bash -c "bash tools/libfabric2.sh /tmp/fabric-lf2 .gpu/libfabric2-src.tgz && \
           export LD_LIBRARY_PATH=/tmp/fabric-lf2/lib && cc -O2 -Wall -I/tmp/fabric-fi/include -o /tmp/fi_ceiling \
           benchmarks/ceiling/fi_ceiling.c -L/tmp/fabric-fi/lib -lfabric && \
           '$py' benchmarks/efa_vs_ceiling.py /tmp/fi_ceiling '$out/ceiling-lf2' --paired --reps ${REPS:-3} \
           --providers ${PROVIDERS:-shm,tcp}" ;;
    hmem-lf2) run_step hmem-lf2 bash -c "set -e; cuda=\${CUDA_HOME:-/usr/local/cuda}; \
           if command -v nvcc >/dev/null; then cuda=\$(dirname \$(dirname \$(readlink -f \$(command -v nvcc)))); fi; \
           echo CUDA toolkit: \$cuda; LIBFABRIC2_CONFIGURE=\"--with-cuda=\$cuda --enable-cuda-dlopen\" \
           bash tools/libfabric2.sh /tmp/fabric-lf2-cuda .gpu/libfabric2-src.tgz; \
           export LD_LIBRARY_PATH=/tmp/fabric-lf2-cuda/lib:\$cuda/lib64; \
           '$py' -c 'import fabric_efa._efa as e; print(\"libfabric\", e.libfabric_version())'; \
           /tmp/fabric-lf2-cuda/bin/fi_info -p shm -c FI_HMEM | head -n 8 || true; \
           FABRIC_EFA_CUDA_IPC=0 '$py' -m fabric_core.cli info --backend efa; \
           '$py' -m pytest tests/gpu -v -rs -p no:cacheprovider" ;;
    hmem-bench-lf2) run_step hmem-bench-lf2 bash -c "set -e; cuda=\${CUDA_HOME:-/usr/local/cuda}; \
           if command -v nvcc >/dev/null; then cuda=\$(dirname \$(dirname \$(readlink -f \$(command -v nvcc)))); fi; \
           LIBFABRIC2_CONFIGURE=\"--with-cuda=\$cuda --enable-cuda-dlopen\" \
           bash tools/libfabric2.sh /tmp/fabric-lf2-cuda .gpu/libfabric2-src.tgz; \
           export LD_LIBRARY_PATH=/tmp/fabric-lf2-cuda/lib:\$cuda/lib64; \
           for ipc in 1 0; do echo \"== FABRIC_EFA_CUDA_IPC=\$ipc\"; FABRIC_EFA_CUDA_IPC=\$ipc '$py' \
             benchmarks/gpu_bench.py --reps \${REPS:-5} --out '$out'/gpu-lf2-ipc\$ipc.json; done" ;;
    write-stream) run_step write-stream bash -c "$(write_stream write-stream)" ;;
    write-stream-lf2) run_step write-stream-lf2 bash -c "bash tools/libfabric2.sh /tmp/fabric-lf2 \
           .gpu/libfabric2-src.tgz && export LD_LIBRARY_PATH=/tmp/fabric-lf2/lib && $(write_stream write-stream-lf2)" ;;
    perf-kv) run_step perf-kv bash benchmarks/device/perf_kv.sh "$py" "$out" ;;
    *) echo "unknown step $step" >&2 ;;
  esac
done
rm -rf "$out"
