"""Target of the ``torch.backends`` entry point.

It lives outside ``fakegpu.torch`` on purpose: importing anything under that package runs its
``__init__``, which registers the backend, so the ``FAKEGPU_TORCH_AUTOLOAD=0`` check must
happen before that import.
"""
from __future__ import annotations

import os


def entry_point() -> None:
    if os.environ.get("FAKEGPU_TORCH_AUTOLOAD", "1") == "0":
        return
    from fakegpu.torch.autoload import register_quietly

    register_quietly()
