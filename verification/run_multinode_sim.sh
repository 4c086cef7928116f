#!/usr/bin/env bash
# N simulated ranks on two logical nodes (simulate + simulate): ./fgpu starts a coordinator,
# torchrun starts the ranks, verification/check_collectives.py checks every collective, dtype and
# reduction against values computed in the rank, and the cluster report is validated.
#   verification/run_multinode_sim.sh N      (N = 2: cluster_tcp_2r.yaml, N = 4: cluster_valid.yaml)
# (The usage doc's ./test/run_multinode_sim.sh.) Needs torch and the build tree (./fgpu).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$repo/verification/multinode_common.sh"
n=$(ranks_argument "${1:-}")
config=$(two_node_config "$n")
out=$(new_out_dir multinode-sim)
py=${FAKEGPU_PYTHON:-python3}
OMP_NUM_THREADS=1 "$repo/fgpu" -q --mode simulate --dist-mode simulate --cluster-config "$config" \
  --report "$out/report.json" -- \
  "$py" -m torch.distributed.run --standalone --nproc-per-node "$n" \
  "$repo/verification/check_collectives.py" --backend fakegpu
"$py" "$repo/verification/check_cluster_report.py" "$out/report.json" \
  --expect-world-size "$n" --expect-node-count 2 --expect-collective AllReduce
echo "multinode sim: $n ranks on 2 nodes: OK (report: $out/report.json)"
