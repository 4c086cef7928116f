"""FSDP2 (fully_shard, DTensor) numerics under fakegpu: sharded training, optimizer steps and
full-tensor reconstruction against a single-process reference, with parameters in fp32, fp16 or
bf16 and gradients reduced in fp32 (default) or in the parameter dtype.

    python3 verification/run_hybrid_fsdp2_numerics.py --world-size 4 --precision bf16 \\
        [--reduce-precision fp32|parameter] [--cpu]

On a CUDA host: hybrid mode. Without one: the CPU form, said so (verification/hybrid_numerics.py).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hybrid_numerics  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32",
                   help="parameter dtype during forward/backward (default fp32)")
    p.add_argument("--reduce-precision", choices=("fp32", "parameter"), default="fp32",
                   help="gradient reduction dtype: fp32 (default) or the parameter dtype")
    hybrid_numerics.add_common_options(p)
    args = p.parse_args(argv)
    if args.precision == "fp32" and args.reduce_precision == "parameter":
        args.reduce_precision = "fp32"   # the same thing: fp32 parameters reduce in fp32
    case = f"fsdp2_{args.precision}" + ("_param" if args.reduce_precision == "parameter" else "")
    return hybrid_numerics.run(f"hybrid FSDP2 numerics ({args.precision} parameters, "
                               f"{args.reduce_precision} reduction)", [case], args)


if __name__ == "__main__":
    sys.exit(main())
