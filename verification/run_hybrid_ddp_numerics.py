"""DDP numerics under fakegpu: basic gradient averaging, accumulation through no_sync,
rank-dependent unused parameters, static graphs and gradient bucket views, each rank's final
parameters against a single-process reference on the global batch.

    python3 verification/run_hybrid_ddp_numerics.py --variant all [--world-size 2] [--cpu]

On a CUDA host: hybrid mode (real CUDA compute, simulated communication). Without one: the CPU
form, said so on the first line (verification/hybrid_numerics.py).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hybrid_numerics  # noqa: E402

VARIANTS = ("plain", "no_sync", "find_unused", "static_graph", "bucket_view")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=(*VARIANTS, "all"), default="all",
                   help="one DDP configuration, or all of them in one job (default all)")
    hybrid_numerics.add_common_options(p)
    args = p.parse_args(argv)
    case = "ddp_all" if args.variant == "all" else f"ddp_{args.variant}"
    return hybrid_numerics.run("hybrid DDP numerics", [case], args)


if __name__ == "__main__":
    sys.exit(main())
