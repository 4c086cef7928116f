"""Where things are, for every test folder (unit/, integration/, e2e/ sit at different depths,
so no test computes the repository root from its own __file__).

Files that are also run as scripts (a rank worker, ``--write``) cannot import this before their
sys.path is set, and compute their paths themselves."""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS.parent
# The bytes, sizes and token-file contents that the Python and C++ readers must agree on.
VECTORS = TESTS / "vectors"
