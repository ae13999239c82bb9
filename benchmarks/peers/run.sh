#!/bin/sh
# kvmesh and its peers on the same workloads, one after the other, in one run:
#   sh benchmarks/peers/run.sh [PEERS_DIR]      (after setup.sh; prints one JSON line each)
set -eu
peers=${1:-.peers}
here=$(dirname "$0")
data=$(mktemp -d)
.venv/bin/python -m app.bench.peers "$data" >&2
.venv/bin/kvmesh bench manager --json
"$peers/bin/python" "$here/vllm_manager.py" "$data"
"$peers/bin/python" "$here/vllm_manager.py" "$data" --events-off
.venv/bin/kvmesh bench index --json
"$peers/bin/python" "$here/dynamo_index.py" "$data"
rm -r "$data"
