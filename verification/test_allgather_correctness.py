"""AllGather through the shim and a real coordinator, every datatype, in and out of place, small
and multi-chunk sizes, on 2 and 4 ranks; each rank must hold every rank's block, bit for bit.

    python3 verification/test_allgather_correctness.py [--ranks 2,4] [--transport unix|tcp|both]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import direct  # noqa: E402

CASES = direct.collective_cases("all_gather", list(direct.DataType), counts=(1, 777, 70000))


def check(args) -> int:
    return direct.check_collectives("allgather correctness", CASES, args)


main = direct.main_of(check, direct.parser(__doc__))

if __name__ == "__main__":
    sys.exit(main())
