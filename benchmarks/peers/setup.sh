#!/bin/sh
# A separate interpreter for the peers (vLLM's KVCacheManager, Dynamo's RadixTree), kept out of
# kvmesh's own venv: `sh benchmarks/peers/setup.sh [DIR]` (default .peers).
set -eu
dir=${1:-.peers}
here=$(dirname "$0")
python3 -m venv "$dir"
"$dir/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0
"$dir/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$here/requirements.txt"
"$dir/bin/python" -c "import vllm.v1.core.kv_cache_manager, dynamo._core" && echo "peers ready in $dir"
