"""Put on PYTHONPATH by ``fgpu``: registers the ``fakegpu`` torch backend once torch imports.

It then runs the ``sitecustomize`` it shadows, if there is one further down ``sys.path``.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _install() -> None:
    try:
        from fakegpu.torch.autoload import install_import_hook
    except ImportError:  # fakegpu itself is not importable: use the tree this file is in
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))
        from fakegpu.torch.autoload import install_import_hook
    install_import_hook()


def _chain_shadowed_sitecustomize() -> None:
    others = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


try:
    _install()
except Exception as exc:  # a broken hook must not stop the interpreter
    print(f"fakegpu: torch backend autoload disabled: {exc!r}", file=sys.stderr)
_chain_shadowed_sitecustomize()
