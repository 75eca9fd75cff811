#!/usr/bin/env bash
# Fills .gpu/ (git-ignored through .git/info/exclude) with what a lent GPU machine lacks and
# cannot fetch: wheels of the pure-Python fabric packages and of pydantic for its Python, and
# the libfabric headers to build fabric-efa against its libfabric runtime. Run it here (a
# machine with PyPI and libfabric-dev), then carry .gpu to the GPU machine and run
# benchmarks/device/run.sh there.
#
#   bash benchmarks/device/prepare.sh [PYTHON_VERSION]   # default 3.12, the GPU image's
set -euo pipefail
cd "$(dirname "$0")/../.."
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
du -sh .gpu
