"""Put on PYTHONPATH by ``fgpu``: registers the ``fakegpu`` torch backend once torch imports.

It imports neither torch nor fakegpu up front (every Python process under fgpu runs this
file, most of them never use torch): a meta-path finder waits for ``import torch`` and runs
the registration when torch's module has finished executing.  Then it runs the
``sitecustomize`` it shadows, if there is one further down ``sys.path``.
Set ``FAKEGPU_TORCH_AUTOLOAD=0`` to turn it off.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _register() -> None:
    try:
        import fakegpu  # noqa: F401
    except ImportError:  # fakegpu is not importable on its own: use the tree this file is in
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))
    from fakegpu.torch.autoload import register_quietly

    register_quietly()


class _AfterTorchImport:
    """One-shot finder: hands back torch's real spec with a loader that registers afterwards."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from recursing
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            try:
                _register()
            except Exception as exc:  # never break `import torch`
                print(f"fakegpu: could not register the torch backend: {exc!r}", file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


def _chain_shadowed_sitecustomize() -> None:
    others = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _prepare_fake_world() -> None:
    """Fake-world modes: WORLD_SIZE/RANK are the logical world's before the program reads them."""
    if os.environ.get("FAKEGPU_DIST_MODE", "").strip().lower() not in ("fake", "real_pp_fake_spmd"):
        return
    try:
        try:
            import fakegpu  # noqa: F401
        except ImportError:
            sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))
        from fakegpu.fake.entry import prepare_environment

        prepare_environment()
    except Exception as exc:  # never break interpreter start
        print(f"fakegpu: could not prepare the fake world's environment: {exc!r}", file=sys.stderr)


if os.environ.get("FAKEGPU_TORCH_AUTOLOAD", "1") != "0":
    _prepare_fake_world()
    if "torch" in sys.modules:
        _register()
    else:
        sys.meta_path.insert(0, _AfterTorchImport())
_chain_shadowed_sitecustomize()
