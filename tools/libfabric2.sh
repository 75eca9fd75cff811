#!/usr/bin/env bash
# Builds libfabric 2.x (the shm, tcp and rxm providers only) into PREFIX, beside the system's
# libfabric, so that fabric-efa can be run against it with LD_LIBRARY_PATH=PREFIX/lib. fabric
# links the system libfabric (Debian 12: 1.17); AWS's EFA installer ships 2.x, and this is how
# the tests (nox -s efa-libfabric2, part of check) and the benchmarks meet that version here.
#
#   tools/libfabric2.sh PREFIX [TARBALL]
#   tools/libfabric2.sh --source OUT.tgz
#
# Without TARBALL it fetches the source Debian 13 builds from, and checks its SHA-256. A
# TARBALL given (a machine with no network: benchmarks/device/run.sh) is used as it is; one
# whose tree has no configure script yet needs autoconf, automake and libtool. Does nothing
# where PREFIX/lib/libfabric.so.1 exists. --source writes that source, with its configure
# script made, to OUT.tgz for such a machine (benchmarks/device/prepare.sh --libfabric2).
# LIBFABRIC2_CONFIGURE: more configure options, split at spaces (benchmarks/device/run.sh's
# hmem-lf2 step: --with-cuda=/usr/local/cuda, for shm's FI_HMEM_CUDA).
set -euo pipefail
VERSION=2.1.0
URL=https://deb.debian.org/debian/pool/main/libf/libfabric/libfabric_${VERSION}.orig.tar.xz
SHA256=1a66369772d5bb151737214af1c478993e969cf298e8f9ed369e7a2ab8d8c6df
# every provider but shm, tcp and rxm (and the utility layers they need): a short build
OFF="sockets udp verbs efa psm2 psm3 usnic opx lpp ucx rxd mrail hook_debug perf trace profile monitor lnx sm2"

source_out=
if [ "${1:-}" = --source ]; then
  source_out=${2:?usage: tools/libfabric2.sh --source OUT.tgz}
  source_out=$(cd "$(dirname "$source_out")" && pwd)/$(basename "$source_out")
  tarball=
else
  prefix=${1:?usage: tools/libfabric2.sh PREFIX [TARBALL]}
  tarball=${2:-}
  prefix=$(mkdir -p "$prefix" && cd "$prefix" && pwd)
  if [ -e "$prefix/lib/libfabric.so.1" ]; then
    echo "libfabric $VERSION: $prefix/lib (built before)"
    exit 0
  fi
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$tarball" ]; then
  tarball=$work/libfabric_${VERSION}.orig.tar.xz
  for attempt in 1 2 3; do
    python3 - "$URL" "$tarball" <<'PY' && break
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=60) as r, open(sys.argv[2], "wb") as f:
    f.write(r.read())
PY
    [ "$attempt" = 3 ] && { echo "cannot fetch $URL" >&2; exit 1; }
    sleep 5
  done
  got=$(sha256sum "$tarball" | cut -d' ' -f1)
  [ "$got" = "$SHA256" ] || { echo "$URL: sha256 $got, expected $SHA256" >&2; exit 1; }
fi
mkdir "$work/libfabric-$VERSION"
tar -xf "$tarball" -C "$work/libfabric-$VERSION" --strip-components=1
cd "$work/libfabric-$VERSION"
[ -x configure ] || ./autogen.sh >"$work/autogen.log" 2>&1 || { tail -n 30 "$work/autogen.log" >&2; exit 1; }
if [ -n "$source_out" ]; then
  rm -rf autom4te.cache fabtests
  tar czf "$source_out" -C "$work" "libfabric-$VERSION"
  echo "libfabric $VERSION source, configure made: $source_out"
  exit 0
fi
flags=()
for p in $OFF; do flags+=("--enable-$p=no"); done
read -r -a extra <<<"${LIBFABRIC2_CONFIGURE:-}"
flags+=("${extra[@]}")
./configure --prefix="$prefix" --disable-debug "${flags[@]}" >"$work/configure.log" 2>&1 ||
  { tail -n 30 "$work/configure.log" >&2; exit 1; }
make -j"$(nproc)" >"$work/make.log" 2>&1 || { tail -n 30 "$work/make.log" >&2; exit 1; }
make install >/dev/null
echo "libfabric $VERSION: $prefix/lib"
