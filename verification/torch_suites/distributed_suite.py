"""PyTorch's own distributed test suites, shipped in the torch wheel, with every process
group built by gloo or by fakegpu: the generic tests (``DistributedTest._DistTestBase`` from
torch/testing/_internal/distributed/distributed_test.py, ``--suite distributed``) and DDP
under RPC and distributed autograd (ddp_under_dist_autograd_test.py over the TensorPipe
agent, ``--suite ddp_rpc``); and, with ``--suite file --test-file PATH``, the multi-process
test classes of a test file from a PyTorch source checkout (those are not in the wheel), such
as test/distributed/tensor/test_redistribute.py (DTensor redistribution on CPU).

    python verification/torch_suites/distributed_suite.py --backend fakegpu [--suite S] \\
        [--world-size 2] [-k PATTERN ...] [--tests FILE] [--json OUT] [--list]
    python verification/torch_suites/distributed_suite.py --backend fakegpu --suite file \\
        --test-file ~/pytorch/test/distributed/tensor/test_redistribute.py

The suite always runs with ``BACKEND=gloo``, so it selects and skips exactly the tests it
selects for gloo; with ``--backend fakegpu`` every rank then builds its groups with the
fakegpu backend instead (``init_process_group`` / ``new_group`` asked for gloo get fakegpu),
against the coordinator named by ``FAKEGPU_COORDINATOR_ADDR`` (``run.py`` starts one), and
``dist.monitored_barrier``, which torch refuses for any backend not named gloo, is
``fakegpu.torch.monitored_barrier``, as a fakegpu job would call it.
Where a test asks the backend's name (``get_backend``) it sees ``fakegpu``.
"""
from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import sys
import time
import unittest

os.environ["BACKEND"] = "gloo"  # read by distributed_test at import
os.environ.setdefault("WORLD_SIZE", "2")
SUBSTITUTE = os.environ.get("FAKEGPU_SUITE_BACKEND") == "fakegpu"


def _substitute_fakegpu_for_gloo() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import fakegpu.torch  # registers the backend

    def as_fakegpu(backend):
        """gloo -> fakegpu, also inside a per-device string ("cpu:gloo,cuda:nccl")."""
        if backend is None:
            return None
        text = str(backend)
        if ":" not in text:
            return "fakegpu" if text.lower() == "gloo" else backend
        pairs = [item.split(":", 1) for item in text.split(",")]
        return ",".join(f"{device}:{'fakegpu' if name.lower() == 'gloo' else name}" for device, name in pairs)

    original_init, original_new_group = c10d.init_process_group, c10d.new_group

    def init_process_group(backend=None, *args, **kwargs):
        return original_init(as_fakegpu(backend) or "fakegpu", *args, **kwargs)

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        return original_new_group(ranks, timeout, as_fakegpu(backend), *args, **kwargs)

    for module in (dist, c10d):
        module.init_process_group = init_process_group
        module.new_group = new_group
        # torch's monitored_barrier refuses any backend not named gloo; a fakegpu job calls
        # fakegpu's equivalent (docs/torch.md), which falls back to torch's on other groups
        module.monitored_barrier = fakegpu.torch.monitored_barrier


if SUBSTITUTE:
    _substitute_fakegpu_for_gloo()

from torch.testing._internal.distributed.ddp_under_dist_autograd_test import (  # noqa: E402
    DdpComparisonTest,
    DdpUnderDistAutogradTest,
)
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (  # noqa: E402
    TensorPipeRpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc_utils import generate_tests  # noqa: E402


class TestDistributedSuite(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


# DDP under RPC and distributed autograd, over the TensorPipe agent as torch's own
# test_tensorpipe_agent.py instantiates it; each test class fixes its own world size (4
# trainers, plus a remote worker and a master for DdpUnderDistAutogradTest).  The spawned
# ranks unpickle these classes from this module, so they are defined whichever suite runs.
globals().update(generate_tests("TensorPipe", TensorPipeRpcAgentTestFixture,
                                [DdpUnderDistAutogradTest, DdpComparisonTest], __name__))

SUITES = {
    "distributed": (TestDistributedSuite,),
    "ddp_rpc": (globals()["TensorPipeDdpUnderDistAutogradTest"],
                globals()["TensorPipeDdpComparisonTest"]),
}


def test_file_classes(paths: list[str]) -> tuple[type, ...]:
    """The unittest classes defined in PyTorch test files (``--suite file``). Each file is
    imported under its own name with its folder on sys.path, so the ranks a test spawns
    (multiprocessing's spawn passes sys.path on) import the same module to find the class."""
    classes = []
    for path in paths:
        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isfile(path):
            raise SystemExit(f"--test-file: no such file: {path}")
        folder, name = os.path.split(path)
        module_name = os.path.splitext(name)[0]
        if folder not in sys.path:
            sys.path.insert(0, folder)
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise SystemExit(f"--test-file {path}: importing it failed with torch "
                             f"{__import__('torch').__version__}: {type(exc).__name__}: {exc}") from exc
        classes += [obj for obj in vars(module).values()
                    if isinstance(obj, type) and issubclass(obj, unittest.TestCase)
                    and obj.__module__ == module_name and unittest.TestLoader().getTestCaseNames(obj)]
    if not classes:
        raise SystemExit(f"--test-file: no test classes in {', '.join(paths)}")
    return tuple(classes)


class _Recorder(unittest.TextTestResult):
    json_path: str | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, str] = {}
        self.json_path = _Recorder.json_path
        self._started = {}

    def startTest(self, test):
        self._started[test.id()] = time.monotonic()
        super().startTest(test)

    def _set(self, test, outcome):
        self.outcomes[test_key(type(test), test._testMethodName)] = outcome
        if self.json_path:  # after every test, so a run cut short still leaves what finished
            with open(self.json_path + ".tmp", "w") as fh:
                json.dump(self.outcomes, fh, indent=1, sort_keys=True)
            os.replace(self.json_path + ".tmp", self.json_path)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._set(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._set(test, "failed")

    def addError(self, test, err):
        super().addError(test, err)
        self._set(test, "error")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._set(test, "skipped")

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._set(test, "passed")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._set(test, "failed")


def test_key(cls: type, method: str) -> str:
    """A test's name in lists and results: the method for the wheel's suites (one class each,
    or classes without shared names), Class.method for test files (whose classes often share
    method names, e.g. a test class and its local-tensor twin)."""
    return method if cls in SUITES["distributed"] + SUITES["ddp_rpc"] else f"{cls.__name__}.{method}"


def test_names(suite: str, patterns, exact=None, classes=None) -> list[tuple[type, str]]:
    """(test class, method name) of each selected test of the suite."""
    tests = [(cls, name) for cls in (classes or SUITES[suite])
             for name in unittest.TestLoader().getTestCaseNames(cls)]
    if exact is not None:
        unknown = sorted(set(exact) - {test_key(cls, name) for cls, name in tests})
        if unknown:
            raise SystemExit(f"--tests: not a test of the {suite} suite: {', '.join(unknown)}")
        tests = [(cls, name) for cls, name in tests if test_key(cls, name) in exact]
    if patterns:
        tests = [(cls, n) for cls, n in tests
                 if any(fnmatch.fnmatchcase(test_key(cls, n), p) or p in test_key(cls, n) for p in patterns)]
    return tests


def read_test_list(path: str) -> set[str]:
    """Test names, one per line ('#' starts a comment)."""
    with open(path) as fh:
        return {line.split("#", 1)[0].strip() for line in fh} - {""}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "fakegpu"), required=True)
    parser.add_argument("--suite", choices=sorted(SUITES) + ["file"], default="distributed",
                        help="distributed: DistributedTest._DistTestBase (--world-size applies); "
                             "ddp_rpc: DDP under RPC / dist_autograd (its own world sizes); "
                             "file: the test classes of --test-file (their own world sizes)")
    parser.add_argument("--test-file", action="append", default=[], metavar="PATH",
                        help="--suite file: a test file of a PyTorch source checkout, e.g. "
                             "test/distributed/tensor/test_redistribute.py (repeatable)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="run tests whose name contains (or fnmatch-matches) PATTERN")
    parser.add_argument("--tests", metavar="FILE",
                        help="run exactly the tests named in FILE, one per line")
    parser.add_argument("--json", help="write {test: passed|failed|error|skipped} here")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    if (args.backend == "fakegpu") != SUBSTITUTE or str(args.world_size) != os.environ["WORLD_SIZE"]:
        # The spawned ranks re-import this module: the choice must be in the environment.
        env = dict(os.environ, FAKEGPU_SUITE_BACKEND=args.backend, WORLD_SIZE=str(args.world_size))
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
    if (args.suite == "file") != bool(args.test_file):
        parser.error("--suite file needs --test-file PATH, and --test-file needs --suite file")
    classes = test_file_classes(args.test_file) if args.suite == "file" else None
    tests = test_names(args.suite, args.patterns, read_test_list(args.tests) if args.tests else None,
                       classes)
    if args.list:
        print("\n".join(test_key(cls, name) for cls, name in tests))
        return 0
    suite = unittest.TestSuite(cls(name) for cls, name in tests)
    _Recorder.json_path = args.json
    # verbosity 2: one line per test as it ends, so a long run's log shows where it is
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=2, stream=sys.stderr)
    result = runner.run(suite)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result.outcomes, fh, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
