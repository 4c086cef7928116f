"""FSDP (FullyShardedDataParallel, FULL_SHARD) numerics under fakegpu: reduce-scattered gradient
averaging, optimizer steps on the shards, the full-parameter state dict against a single-process
reference, and that state dict restored into a freshly initialised model.

    python3 verification/run_hybrid_fsdp_numerics.py [--world-size 2] [--cpu]

On a CUDA host: hybrid mode. Without one: the CPU form, said so (verification/hybrid_numerics.py).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hybrid_numerics  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hybrid_numerics.add_common_options(p)
    return hybrid_numerics.run("hybrid FSDP numerics", ["fsdp1"], p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
