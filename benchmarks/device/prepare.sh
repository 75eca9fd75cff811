#!/usr/bin/env bash
# Fills .gpu/ (git-ignored through .git/info/exclude) with what a lent GPU machine lacks and
# cannot fetch: wheels of the pure-Python fabric packages and of pydantic for its Python, and
# the libfabric headers to build fabric-efa against its libfabric runtime. Run it here (a
# machine with PyPI and libfabric-dev), then carry .gpu to the GPU machine and run
# benchmarks/device/run.sh there.
#
#   bash benchmarks/device/prepare.sh [--perf] [--libfabric2] [PYTHON_VERSION]   # default 3.12, the GPU image's
#
# --perf also copies this machine's perf and the libraries it needs beyond the C and C++
# runtimes into .gpu/perf (the GPU image has no perf; run.sh's perf-kv step uses it).
# --libfabric2 also puts libfabric 2.x's source there, configure made (tools/libfabric2.sh
# --source), for run.sh's write-stream-lf2 step.
set -euo pipefail
cd "$(dirname "$0")/../.."
perf=0 lf2=0
if [ "${1:-}" = --perf ]; then perf=1; shift; fi
if [ "${1:-}" = --libfabric2 ]; then lf2=1; shift; fi
pyver=${1:-3.12}
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/fi/include/rdma
[ -f /usr/include/rdma/fabric.h ] || { echo "needs libfabric-dev here (apt-get install libfabric-dev)" >&2; exit 1; }
cp /usr/include/rdma/fabric.h /usr/include/rdma/fi_*.h .gpu/fi/include/rdma/
python3 -m pip download -q -d .gpu/wheels --python-version "$pyver" --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  'pydantic>=2.10,<3' 'pydantic-settings>=2.6,<3'
# Installed for their entry points (fabric.backends, the CLI); run.sh puts the tree's sources
# first on PYTHONPATH, so a change here needs no new wheel.
python3 -m pip wheel -q --no-deps -w .gpu/wheels ./packages/fabric-core ./packages/fabric-sim ./packages/fabric-apps
# libfabric-bin's fi_pingpong (it links only libfabric and libc): efa_vs_ceiling.py's round-trip
# reference there
if command -v fi_pingpong >/dev/null; then mkdir -p .gpu/bin && cp "$(command -v fi_pingpong)" .gpu/bin/; fi
if [ $perf = 1 ]; then
  bin=$(readlink -f "$(command -v perf)") || { echo "no perf here (apt-get install linux-perf)" >&2; exit 1; }
  mkdir -p .gpu/perf/lib && cp "$bin" .gpu/perf/perf
  for lib in $(ldd "$bin" | awk '/=>/{print $3}'); do
    case $(basename "$lib") in libc.so* | libm.so* | libstdc++* | libgcc_s* | libz.so* | ld-linux*) ;; *) cp -L "$lib" .gpu/perf/lib/ ;; esac
  done
fi
if [ $lf2 = 1 ]; then
  bash tools/libfabric2.sh --source .gpu/libfabric2-src.tgz
fi
du -sh .gpu
