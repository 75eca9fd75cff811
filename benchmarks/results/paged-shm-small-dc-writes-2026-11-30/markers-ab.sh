#!/bin/bash
# paged_rate.py (shm, 1,024 pages of 4 KiB, 3 s) and both ceilings at 4 KiB, alternating the
# build before delivery markers (6324a75) and the one with them, on libfabric 1.17 and 2.1.
cd /work/main
SO=/tmp/gv/lib/python3.11/site-packages/fabric_efa/_efa.cpython-311-x86_64-linux-gnu.so
for r in 1 2 3; do for lib in 1.17 2.1; do
  if [ $lib = 2.1 ]; then export LD_LIBRARY_PATH=/tmp/lf21inst/lib; else unset LD_LIBRARY_PATH; fi
  cp /tmp/efa_final.so $SO; a=$(/tmp/gv/bin/python benchmarks/paged_rate.py --provider shm --seconds 3 | grep -o "[0-9.]*k pages/s" | grep -o "^[0-9.]*")
  cp /tmp/efa_mark.so $SO; b=$(/tmp/gv/bin/python benchmarks/paged_rate.py --provider shm --seconds 3 | grep -o "[0-9.]*k pages/s" | grep -o "^[0-9.]*")
  c=$(/tmp/fi_ceiling -p shm -s 4096 -w 64 -r 3 -l 1 2>&1 | grep bandwidth | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['mwrites_per_s'])")
  d=$(/tmp/fi_ceiling -p shm -s 4096 -w 64 -r 3 -l 1 -d 2>&1 | grep bandwidth | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['mwrites_per_s'])")
  echo "{\"round\": $r, \"libfabric\": \"$lib\", \"before_kpages_per_s\": $a, \"markers_kpages_per_s\": $b, \"ceiling_mwrites_per_s\": $c, \"ceiling_dc_mwrites_per_s\": $d}"
done; done
