#!/usr/bin/env bash
# An unmodified GPU DDP script (hard-coded "cuda", backend "nccl", DDP(device_ids=...)) on N ranks
# over two logical nodes in simulate mode: fake CUDA devices, torch's ProcessGroupNCCL talking to
# fakegpu's libnccl.so.2. Smoke and control-flow coverage of ProcessGroupNCCL, not numerical parity
# with real NCCL (the numerics runners check that).
#   verification/run_ddp_multinode.sh N      (N = 2 or 4)
# (The usage doc's ./test/run_ddp_multinode.sh.) Needs torch and the build tree (./fgpu).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$repo/verification/multinode_common.sh"
n=$(ranks_argument "${1:-}")
config=$(two_node_config "$n")
out=$(new_out_dir ddp-multinode)
py=${FAKEGPU_PYTHON:-python3}
mkdir -p "$out/ranks"
OMP_NUM_THREADS=1 "$repo/fgpu" -q --mode simulate --dist-mode simulate --cluster-config "$config" \
  --device-count "$n" --report "$out/report.json" -- \
  "$py" -m torch.distributed.run --standalone --nproc-per-node "$n" \
  "$repo/verification/fake_cuda/ddp_gpu.py" "$out/ranks" 3
for ((r = 0; r < n; r++)); do
  [[ -f "$out/ranks/rank$r.pt" ]] || { echo "ddp multinode: rank $r left no result" >&2; exit 1; }
done
"$py" "$repo/verification/check_cluster_report.py" "$out/report.json" \
  --expect-world-size "$n" --expect-node-count 2 --expect-collective AllReduce
echo "ddp multinode: $n ranks on 2 nodes through ProcessGroupNCCL: OK (report: $out/report.json)"
