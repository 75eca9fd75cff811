# Sourced by the engine A/B scripts (ab_kv.sh, ab_rtt.sh) on a lent GPU machine: builds this
# tree's fabric-efa (run.sh's setup, its log in /tmp/setup-NAME) and the base engine of
# .gpu/base-engine.tgz (`git archive BASE packages/fabric-core packages/fabric-efa | gzip
# >.gpu/base-engine.tgz`, made here) into /tmp/base-efa, against its own fabric-core headers.
# Exits the sourcing script on failure.
#   . benchmarks/device/ab_base_engine.sh NAME
ab_name=$1
OUT=/tmp/setup-$ab_name bash benchmarks/device/run.sh >/dev/null 2>&1 ||
  { echo "setup failed"; cat "/tmp/setup-$ab_name/results/setup.log"; exit 1; }
rm -rf /tmp/base /tmp/base-efa && mkdir -p /tmp/base && tar xzf .gpu/base-engine.tgz -C /tmp/base
PYTHONPATH=/tmp/base/packages/fabric-core/src LIBFABRIC_HOME=/tmp/fabric-fi python3 -m pip install -q --no-deps \
  --no-build-isolation --target /tmp/base-efa /tmp/base/packages/fabric-efa > /tmp/base-build.log 2>&1 ||
  { echo "base build failed"; tail -20 /tmp/base-build.log; exit 1; }
