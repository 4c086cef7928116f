#!/usr/bin/env bash
# Hybrid compute + simulated communication on N ranks over two logical nodes: on a CUDA host
# every rank computes on the GPU (fgpu --mode hybrid, backend nccl) and each rank's DDP result is
# compared with a single-process reference; without a GPU the same job runs in its CPU form
# (CPU tensors, backend fakegpu, simulate mode), and the script says so.
#   verification/run_hybrid_multinode.sh N   (N = 2 or 4)
# (The usage doc's ./test/run_hybrid_multinode.sh.) Needs torch and the build tree (./fgpu).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$repo/verification/multinode_common.sh"
n=$(ranks_argument "${1:-}")
config=$(two_node_config "$n")
out=$(new_out_dir hybrid-multinode)
py=${FAKEGPU_PYTHON:-python3}
if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  mode=(--mode hybrid); worker=(--device cuda --backend nccl)
  echo "hybrid multinode: CUDA device found: $n ranks compute on it, communication simulated"
else
  mode=(--mode simulate); worker=(--device cpu --backend fakegpu)
  export FAKEGPU_FAKE_CUDA=0
  echo "hybrid multinode: no CUDA device visible to torch: running the CPU form" \
       "(CPU tensors, backend fakegpu, simulate mode)"
fi
OMP_NUM_THREADS=1 "$repo/fgpu" -q "${mode[@]}" --dist-mode simulate --cluster-config "$config" \
  --report "$out/report.json" -- \
  "$py" -m torch.distributed.run --standalone --nproc-per-node "$n" \
  "$repo/verification/gpu/workloads.py" ddp_plain --out "$out/ranks" "${worker[@]}"
"$py" - "$out/ranks" "$n" <<'PY'
import json, sys
from pathlib import Path
out, n = Path(sys.argv[1]), int(sys.argv[2])
results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
bad = [r["rank"] for r in results if not r["ok"]]
print(f"hybrid multinode: max |param - reference| {max(r['max_abs_err'] for r in results):.3g}")
sys.exit(f"hybrid multinode: ranks {bad} differ from the reference" if bad else 0)
PY
"$py" "$repo/verification/check_cluster_report.py" "$out/report.json" \
  --expect-world-size "$n" --expect-node-count 2
echo "hybrid multinode: $n ranks on 2 nodes: OK (report: $out/report.json)"
