"""Whether TorchTitan 0.3.0 and what its training entry point imports are installed (CI does
not install them; the TorchTitan tests skip without them)."""
import importlib.util


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


# torchtitan.train, not torchtitan: a folder of that name on sys.path would be a namespace package.
HAS_TORCHTITAN = all(_installed(m) for m in ("tensorboard", "tokenizers", "datasets", "torchtitan.train"))
