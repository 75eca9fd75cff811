#!/usr/bin/env bash
# On a lent GPU machine (host cores only), with .gpu carried (prepare.sh): efa_vs_ceiling.py --paired
# --reps 3 on tcp;ofi_rxm, its results in one tarball, $OUT/res.tgz (the device tool returns a
# few files only). docs/backends/efa.md, "On a 16-core host, tcp, with eager writes".
#   bash benchmarks/device/tcp_sweep.sh
set -u; export PYTHONUNBUFFERED=1
O=$OUT; OUT=/tmp/setup-e bash benchmarks/device/run.sh > /tmp/setup.log 2>&1 || { tail -20 /tmp/setup.log; exit 1; }
export PATH=$PWD/.gpu/bin:$PATH FI_TCP_IFACE=lo OMP_NUM_THREADS=1
export PYTHONPATH=$PWD/packages/fabric-core/src:$PWD/packages/fabric-sim/src:$PWD/packages/fabric-apps/src
cc -O2 -Wall -I/tmp/fabric-fi/include -o /tmp/fi_ceiling benchmarks/ceiling/fi_ceiling.c -L/tmp/fabric-fi/lib -lfabric
mkdir -p /tmp/res
timeout 420 python3 benchmarks/efa_vs_ceiling.py /tmp/fi_ceiling /tmp/res/ceiling --reps 3 --providers tcp --paired > /tmp/res/ceiling.log 2>&1
nproc --all > /tmp/res/nproc.txt; lscpu > /tmp/res/lscpu.txt
(cd /tmp/res && tar czf $O/res.tgz .)
tail -8 /tmp/res/ceiling.log
