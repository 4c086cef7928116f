# Shared by verification/run_*_multinode.sh and run_multinode_sim.sh (sourced, not run).
ranks_argument() {
  case "$1" in
    2|4) echo "$1" ;;
    *) echo "usage: $(basename "$0") N   (N = 2 or 4 ranks, on two logical nodes)" >&2; exit 2 ;;
  esac
}
# Two nodes either way: one rank each (the TCP pair), or the usage doc's 2 x 2 minimal config.
two_node_config() {
  if [[ "$1" == 2 ]]; then echo "$repo/verification/data/cluster_tcp_2r.yaml"
  else echo "$repo/verification/data/cluster_valid.yaml"; fi
}
new_out_dir() {
  local dir
  dir=$(mktemp -d "${TMPDIR:-/tmp}/fakegpu-$1.XXXXXX")
  echo "$dir"
}
