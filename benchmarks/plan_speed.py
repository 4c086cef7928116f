"""How long `fgpu plan` takes, and how much memory, on one configuration.

    python benchmarks/plan_speed.py [--gpus 512] [-- TORCHTITAN ARGS]

Default: TorchTitan's llama3_405b config on 512 GPUs (FSDP 8 x TP 8 x PP 8, interleaved 1F1B,
local batch 32, full AC, compile, Float8, async TP: TorchTitan's published table 5) on the Grand
Teton cluster YAML. Runs the real command line in a child process and prints its wall time and
peak resident memory (the issue-31 target: at most 5 minutes and 8 GiB on a 2-core machine).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster_configs" / "h100-96gb-500w-grand-teton-8gpu-rdma.yaml"
DEFAULT = ["--module", "llama3", "--config", "llama3_405b", "--parallelism.data_parallel_shard_degree", "8",
           "--parallelism.tensor_parallel_degree", "8", "--parallelism.pipeline_parallel_degree", "8",
           "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--training.local_batch_size", "32",
           "--training.disable_cuda_graphs"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=512)
    p.add_argument("titan", nargs="*", help="TorchTitan arguments (default: the 405B table-5 layout)")
    a = p.parse_args(argv)
    nodes = a.gpus // 8
    command = [sys.executable, "-m", "fakegpu", "plan", "--json", "--cluster-config", str(CLUSTER),
               "--output-dir", "/tmp", "--", "torchrun", "--nnodes", str(nodes), "--nproc-per-node", "8",
               "-m", "torchtitan.train", *(a.titan or DEFAULT)]
    t0 = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.monotonic() - t0
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 ** 2
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    plan = json.loads(done.stdout)
    print(f"planned {plan['layout_text']} on {a.gpus} GPUs: {plan['tokens_per_second_per_gpu']:.1f} tokens/s/GPU, "
          f"{plan['peak_memory_reserved_gib']:.1f} GiB")
    print(f"wall {wall:.1f} s, peak RSS {rss_gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
