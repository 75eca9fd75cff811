#!/bin/bash
# alternate base and new: burst submit (shm,tcp), rtt (shm,tcp), stream 64K shm
cd /work/main
. /tmp/v/bin/activate
export FI_TCP_IFACE=lo
BASE="PYTHONPATH=/tmp/basewt/packages/fabric-core/src:/tmp/base-efa"
NEW="PYTHONPATH="
for r in $(seq 1 ${ROUNDS:-3}); do
  for v in base new; do
    if [ $v = base ]; then P=/tmp/basewt/packages/fabric-core/src:/tmp/base-efa; else P=; fi
    echo "== round $r $v"
    PYTHONPATH=$P python /tmp/exp/burst.py shm 40 2>&1 | grep submit
    PYTHONPATH=$P python /tmp/exp/burst.py 'tcp;ofi_rxm' 40 2>&1 | grep submit
    PYTHONPATH=$P python benchmarks/rtt_breakdown.py --provider shm --iters 10000 2>&1 | grep -E "total|client_submit"
    PYTHONPATH=$P python benchmarks/rtt_breakdown.py --provider 'tcp;ofi_rxm' --iters 5000 2>&1 | grep -E "total|client_submit"
    PYTHONPATH=$P python /tmp/exp/stream.py shm 65536 128 2 2>&1 | grep writes
  done
done
