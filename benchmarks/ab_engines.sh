#!/bin/bash
# Two engine builds side by side on this machine, alternated: fabric-efa of BASE (a commit)
# and of this tree, each built against its own fabric-core (headers and Python) into its own
# folder, then ROUNDS rounds of the round trip split (benchmarks/rtt_breakdown.py) and of
# `fabric bench --sizes 8,64K,1M,16M`, on tcp;ofi_rxm and on shm, the two builds' order
# swapped every round. One JSON per run into OUT (NAME-PROVIDER-ROUND.json, NAME base or
# new); benchmarks/plot_ab_engines.py OUT summarizes them (medians, pairs) and plots them.
# Needs the environment that builds fabric-efa (./dev efa); nothing else should run meanwhile.
#   bash benchmarks/ab_engines.sh BASE OUT [ROUNDS]
set -euo pipefail
base=$1
out=$(realpath -m "$2")
rounds=${3:-4}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/ab-engines.XXXXXX)
mkdir -p "$out"
export FI_TCP_IFACE=lo

build() {  # build NAME SRC: fabric-efa of SRC into $work/NAME (its fabric-core beside it)
    local name=$1 src=$2
    mkdir -p "$work/$name"
    cp -r "$src/packages/fabric-core/src/fabric_core" "$work/$name/"
    PYTHONPATH="$work/$name" python3 -m pip install -q --no-deps --no-build-isolation \
        --target "$work/$name" -Cbuild-dir="$work/build-$name" \
        -Ccmake.define.FabricCore_DIR="$src/packages/fabric-core/src/fabric_core/cmake" "$src/packages/fabric-efa" \
        >"$work/build-$name.log" 2>&1 || { tail -20 "$work/build-$name.log"; exit 1; }
}
mkdir -p "$work/base-src"
git -C "$root" archive "$base" packages/fabric-core packages/fabric-efa | tar x -C "$work/base-src"
build base "$work/base-src"
build new "$root"
{
    echo "base $(git -C "$root" rev-parse "$base")"
    echo "new $(git -C "$root" rev-parse HEAD)$(git -C "$root" diff --quiet HEAD -- packages || echo ' + uncommitted changes')"
    echo "host $(hostname), $(nproc) CPUs, $(date -u +%FT%TZ)"
} >"$out/about.txt"

for r in $(seq 1 "$rounds"); do
    if ((r % 2)); then order="base new"; else order="new base"; fi
    for prov in "tcp;ofi_rxm" shm; do
        p=${prov%%;*}
        for v in $order; do
            PYTHONPATH="$work/$v" python3 "$root/benchmarks/rtt_breakdown.py" --provider "$prov" \
                --iters 6000 --warmup 1000 --json "$out/rtt-$v-$p-$r.json" >/dev/null
            PYTHONPATH="$work/$v" FABRIC_EFA_PROVIDER="$prov" fabric bench --backend efa --nics 1 \
                --sizes 8,64K,1M,16M --json "$out/bench-$v-$p-$r.json" >/dev/null
        done
    done
    echo "round $r of $rounds done"
done
rm -rf "$work"
