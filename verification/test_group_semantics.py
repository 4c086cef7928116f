"""Grouped submission (ncclGroupStart/End) through the shim and a real coordinator:

- a nested group of many collectives of mixed kinds, datatypes and sizes over two
  communicators: nothing runs before the outermost GroupEnd, then every output is exact;
- a flat group of the same kind;
- an all-to-all-v built from grouped Send/Recv, self-sends and zero counts included;
- the same two calls issued one by one on some ranks and as one group on the others.

    python3 verification/test_group_semantics.py [--ranks 2,4] [--transport unix|tcp|both]
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import direct  # noqa: E402
from helpers.scenarios import uneven_counts  # noqa: E402

SCENARIOS = [("big_group", {"n_calls": 60, "nested": True, "span_split": True}),
             ("big_group", {"n_calls": 60, "nested": False, "span_split": False}),
             ("uneven_alltoall", {}),
             ("grouped_on_some_ranks", {})]


def _problems(n: int, run) -> list[str]:
    out = []
    for index, (name, params) in enumerate(SCENARIOS):
        for rank in range(n):
            status, got = run.outcomes[rank][index]
            where = f"{name} {params} rank {rank}"
            if status != "ok":
                out.append(f"{where}: {got.splitlines()[-1]}")
                continue
            if name == "big_group":
                if not got["deferred"]:
                    out.append(f"{where}: calls ran before the outermost GroupEnd")
                for call, buf in zip(direct.group_plan(params["n_calls"], n), got["outs"]):
                    want = direct.expected_collective(n, rank, **call)
                    if not direct.data.same_bits(buf, want):
                        out.append(f"{where}, call {call}: {direct.data.describe_mismatch(buf, want)}")
            elif name == "uneven_alltoall":
                for sender, block in enumerate(got["recvs"]):
                    # what `sender` made for this rank (scenarios.uneven_alltoall's inputs)
                    want = direct.data.make_input(700 + rank, sender, direct.DataType.float32,
                                                  uneven_counts(n, sender, rank))
                    if not direct.data.same_bits(np.asarray(block), want):
                        out.append(f"{where}: block from rank {sender} wrong")
            else:
                total = sum(range(1, n + 1))
                if not ((got["a"] == total).all() and (got["b"] == 10 * total).all()
                        and (got["c"] == np.arange(len(got["c"]), dtype=np.int32) * total).all()):
                    out.append(f"{where}: wrong sums")
    return out


def check(args) -> int:
    failures = 0
    for transport in direct.transports(args.transport):
        for n in direct.world_sizes(args.ranks):
            try:
                run = direct.run_scenarios(n, SCENARIOS, transport, args.timeout)
            except direct.RankRunFailed as exc:
                print(f"group semantics: {n} ranks over {transport}: FAILED\n{exc}")
                failures += 1
                continue
            problems = _problems(n, run)
            failures += bool(problems)
            print(f"group semantics: {n} ranks over {transport}: "
                  + (f"{len(problems)} problem(s), first: {problems[0]}" if problems
                     else f"{len(SCENARIOS)} grouped scenarios exact, deferred until the outermost GroupEnd"))
    print(f"group semantics: {'FAILED' if failures else 'OK'}")
    return 1 if failures else 0


main = direct.main_of(check, direct.parser(__doc__))

if __name__ == "__main__":
    sys.exit(main())
