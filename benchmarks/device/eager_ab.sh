#!/usr/bin/env bash
# On a lent GPU machine (host cores only), with .gpu carried (prepare.sh): eager writes on tcp;ofi_rxm
# on and off (FABRIC_EFA_EAGER_MAX 4096 / 0), alternated in three rounds of `fabric bench --sizes
# 8,4K` and three of rtt_breakdown.py --size 8, then a two-pair efa_vs_ceiling.py --paired sweep
# on tcp. Results under $OUT (docs/backends/efa.md, "On a 16-core host, tcp, with eager writes").
#   bash benchmarks/device/eager_ab.sh
set -u; export PYTHONUNBUFFERED=1
O=$OUT; OUT=/tmp/setup-e bash benchmarks/device/run.sh > /tmp/setup.log 2>&1 || { tail -20 /tmp/setup.log; exit 1; }
export PATH=$PWD/.gpu/bin:$PATH FI_TCP_IFACE=lo OMP_NUM_THREADS=1 FABRIC_EFA_PROVIDER="tcp;ofi_rxm"
export PYTHONPATH=$PWD/packages/fabric-core/src:$PWD/packages/fabric-sim/src:$PWD/packages/fabric-apps/src
nproc | tee $O/eager.txt
for r in 1 2 3; do
  order="4096 0"; [ $((r % 2)) = 0 ] && order="0 4096"
  for m in $order; do
    FABRIC_EFA_EAGER_MAX=$m timeout 100 python3 -m fabric_core.cli bench --backend efa --nics 1 --sizes 8,4K --json $O/bench-$m-$r.json > $O/bench-$m-$r.log 2>&1
    python3 -c "
import json,sys; d=json.load(open('$O/bench-$m-$r.json'))
print('$r eager_max=$m', '; '.join(f\"{x['size']}B rtt={x['latency_us_p50']:.1f} ops={x['ops_per_s']:.0f}\" for x in d['results']))" | tee -a $O/eager.txt
  done
done
for r in 1 2 3; do for m in 4096 0; do
  FABRIC_EFA_EAGER_MAX=$m timeout 60 python3 benchmarks/rtt_breakdown.py --provider "tcp;ofi_rxm" --size 8 > $O/bd-$m-$r.log 2>&1
  echo "bd $r eager_max=$m: $(grep total $O/bd-$m-$r.log)" | tee -a $O/eager.txt
done; done
cc -O2 -Wall -I/tmp/fabric-fi/include -o /tmp/fi_ceiling benchmarks/ceiling/fi_ceiling.c -L/tmp/fabric-fi/lib -lfabric
timeout 300 python3 benchmarks/efa_vs_ceiling.py /tmp/fi_ceiling $O/ceiling --reps 2 --providers tcp --paired > $O/ceiling.log 2>&1
tail -25 $O/ceiling.log
