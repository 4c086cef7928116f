"""AllReduce through the shim and a real coordinator, every datatype and reduction, in and out of
place, on 2 and 4 ranks; each rank's result must be bit-identical to the independently computed one.

    python3 verification/test_allreduce_correctness.py [--ranks 2,4] [--transport unix|tcp|both]

(The usage doc's test/test_allreduce_correctness.py; docs/usage.md maps its test/ paths.)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import direct  # noqa: E402

CASES = direct.collective_cases("all_reduce", list(direct.DataType), counts=(1, 1000),
                                reductions=(*direct.REDUCTIONS, "premul_host"))


def check(args) -> int:
    return direct.check_collectives("allreduce correctness", CASES, args)


main = direct.main_of(check, direct.parser(__doc__))

if __name__ == "__main__":
    sys.exit(main())
