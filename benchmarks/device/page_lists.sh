#!/usr/bin/env bash
# On a lent GPU machine (host cores only), with .gpu carried (prepare.sh): benchmarks/page_lists.py on
# tcp;ofi_rxm (paged writes a page a write against four pages a write, beside the ceiling's 4 KiB
# writes; ROUNDS rounds, default 6). Results under $OUT (docs/backends/efa.md, "Pages several a
# write on tcp").
#   bash benchmarks/device/page_lists.sh
set -u; export PYTHONUNBUFFERED=1
O=$OUT; OUT=/tmp/setup-e bash benchmarks/device/run.sh > /tmp/setup.log 2>&1 || { tail -20 /tmp/setup.log; exit 1; }
export PATH=$PWD/.gpu/bin:$PATH FI_TCP_IFACE=lo OMP_NUM_THREADS=1
export PYTHONPATH=$PWD/packages/fabric-core/src:$PWD/packages/fabric-sim/src:$PWD/packages/fabric-apps/src
cc -O2 -Wall -I/tmp/fabric-fi/include -o /tmp/fi_ceiling benchmarks/ceiling/fi_ceiling.c -L/tmp/fabric-fi/lib -lfabric
nproc --all > $O/nproc.txt  # (--all: OMP_NUM_THREADS=1 makes plain nproc say 1)
timeout 420 python3 benchmarks/page_lists.py /tmp/fi_ceiling $O --rounds "${ROUNDS:-6}" 2>&1 | tee $O/page-lists.log | tail -20
