"""Replace a public torch callable so that torch still recognises it.

torch keys several registries on the identity of its own functions: TorchScript's builtin
table (``id(fn) -> "aten::name"``), dynamo's trace rules (object -> how to trace it),
``torch.overrides`` (ignored and overridable functions), and pickling by reference (the
object found at ``module.qualname`` must be the object pickled).  A Python wrapper put in
place of ``torch.tensor`` is none of these: TorchScript then tries to compile the wrapper's
source, dynamo inlines it, pickling finds the original under the wrapper's name.

:func:`replace` is the one way fake CUDA replaces a torch callable: it puts the replacement at
every place torch exposes the original (``torch.nn.functional.scaled_dot_product_attention``
is also ``torch._C._nn.scaled_dot_product_attention``), names it by its public path, and
registers it in each registry under the original's entry, now or when the registry's module is
first imported.  :data:`REPLACED` lists every replacement (the test walks it).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from typing import Any

from fakegpu.import_hooks import after_import


@dataclasses.dataclass(frozen=True)
class Replacement:
    owner: Any            # the module or class whose attribute was replaced
    name: str
    original: Any
    replacement: Any
    public_path: str      # "torch.tensor", "torch.Tensor.to"


REPLACED: list[Replacement] = []


def replace(owner, name: str, replacement, *, public_path: str | None = None,
            wrap: bool = True):
    """Install ``replacement`` as ``owner.name`` and wherever torch's modules hold the same
    original object; return it.  ``wrap`` copies the original's metadata (``__doc__``,
    ``__wrapped__`` for ``inspect.signature``) onto a function replacement."""
    original = getattr(owner, name)
    if getattr(original, "__fakegpu_original__", None) is not None:
        raise RuntimeError(f"fakegpu: {public_path or name} is already replaced")
    public_path = public_path or f"{_owner_path(owner)}.{name}"
    if isinstance(owner, type):
        # Where the class is defined (torch._tensor.Tensor): pickling imports that module, and
        # FX writes "torch.Tensor.to" only for a function named so.
        import torch

        # torch.Tensor says its module is "torch"; FX's rule names torch._tensor.
        module_name = "torch._tensor" if owner is torch.Tensor else owner.__module__
        qualname = f"{owner.__qualname__}.{name}"
    else:
        module_name, _, qualname = _split_public_path(public_path)
    if wrap and callable(original) and not isinstance(replacement, type):
        functools.update_wrapper(replacement, original)
    if isinstance(replacement, type) and isinstance(original, type):
        # A class's signature comes from its __new__/__init__, whose annotations (``-> Self``)
        # differ with typing_extensions' version: state the original's outright.
        try:
            replacement.__signature__ = inspect.signature(original)
        except (TypeError, ValueError):
            pass   # a C class torch gives no signature (torch.Generator)
    # Pickling by reference and FX's code generation look the object up by these.
    replacement.__module__ = module_name
    replacement.__qualname__ = qualname
    replacement.__name__ = name
    try:
        replacement.__fakegpu_original__ = original
    except (AttributeError, TypeError):
        pass
    setattr(owner, name, replacement)
    for alias_owner, alias_name in _aliases(original, include_c=not isinstance(original, type)):
        try:
            setattr(alias_owner, alias_name, replacement)
        except (AttributeError, TypeError):
            pass   # a read-only C namespace (torch._C._VariableFunctions): torch's Python uses the module

    entry = Replacement(owner, name, original, replacement, public_path)
    REPLACED.append(entry)
    _register_everywhere(entry)
    return replacement


def original_of(obj):
    """The torch object ``obj`` replaced, or ``obj`` itself."""
    return getattr(obj, "__fakegpu_original__", None) or obj


def _owner_path(owner) -> str:
    if isinstance(owner, type):
        module = owner.__module__
        if module == "torch._tensor":
            module = "torch"   # torch.Tensor is exposed as torch.Tensor
        return f"{module}.{owner.__qualname__}"
    return owner.__name__


def _split_public_path(path: str) -> tuple[str, str, str]:
    """"torch.Tensor.to" -> ("torch", ".", "Tensor.to"): the longest importable module prefix."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if module in sys.modules:
            return module, ".", ".".join(parts[cut:])
    raise ValueError(f"fakegpu: no imported module in {path!r}")


def _aliases(original, include_c: bool) -> list[tuple[Any, str]]:
    """Every (module, name) among torch's imported modules that holds ``original``; a class
    stays in place in torch._C, whose C code makes its instances."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "torch" or module_name.startswith("torch.")):
            continue
        if not include_c and module_name.startswith("torch._C"):
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for attribute, value in list(namespace.items()):
            if value is original:
                found.append((module, attribute))
    # C extension namespaces that torch re-exports (torch._C._nn holds the C SDPA).
    import torch

    for namespace in (torch._C._nn,) if include_c else ():
        for attribute in dir(namespace):
            if getattr(namespace, attribute, None) is original:
                found.append((namespace, attribute))
    return found


# ---------------------------------------------------------------------------------------------
# The registries


def _register_everywhere(entry: Replacement) -> None:
    _register_torchscript(entry)
    _register_overrides(entry)
    after_import("torch._dynamo.trace_rules", lambda module: _register_dynamo(module, entry),
                 ready=lambda module: hasattr(module, "get_torch_obj_rule_map"))


def _register_torchscript(entry: Replacement) -> None:
    """TorchScript compiles a call to the replacement as the original's aten op."""
    import torch.jit._builtins as builtins

    op = builtins._find_builtin(entry.original)
    if op is None and builtins._builtin_table is not None:
        return
    if op is not None:
        builtins._register_builtin(entry.replacement, op)
    # Not built yet: it is built from the modules' attributes, which now hold the replacement;
    # the original is added back so a reference taken earlier still compiles.
    if builtins._builtin_table is None:
        builtins._get_builtin_table()
        op = builtins._find_builtin(entry.replacement)
        if op is not None:
            builtins._register_builtin(entry.original, op)


def _register_overrides(entry: Replacement) -> None:
    """``torch.overrides``: the replacement is ignored / overridable / has a testing override
    where the original has (and the other way round: a table built after the replacement was
    installed found it under the original's name)."""
    import torch.overrides as overrides

    _pair_up(overrides.get_ignored_functions(), entry)
    overridable, index = overrides._get_overridable_functions()
    _pair_up(index, entry)
    for functions in overridable.values():
        if (entry.original in functions) != (entry.replacement in functions):
            functions.append(entry.replacement if entry.original in functions else entry.original)
    if overrides.get_testing_overrides.cache_info().currsize:
        # Built already (torch's own tests build it); otherwise it is built from the modules'
        # attributes, which hold the replacement.
        _pair_up(overrides.get_testing_overrides(), entry)


def _pair_up(table, entry: Replacement) -> None:
    """Make ``table`` (a set or a dict) hold the replacement iff it holds the original."""
    a, b = entry.original, entry.replacement
    for have, missing in ((a, b), (b, a)):
        if have in table and missing not in table:
            if isinstance(table, dict):
                table[missing] = table[have]
            else:
                table.add(missing)


def _register_dynamo(trace_rules, entry: Replacement) -> None:
    """dynamo traces a call to the replacement as it would the original (most: a node in the
    graph), instead of inlining fakegpu's Python."""
    rules = trace_rules.get_torch_obj_rule_map()
    rule = rules.get(entry.original)
    if rule is not None:
        rules.setdefault(entry.replacement, rule)
    elif entry.replacement in rules:
        rules.setdefault(entry.original, rules[entry.replacement])
    elif isinstance(entry.owner, type) and callable(entry.replacement):
        # A Tensor method (the original, a C method, has no rule: dynamo calls it on the
        # tensor).  Inlined, the replacement would call the C method unbound, which dynamo
        # cannot trace; as a node of the graph it runs on the tracer's fake tensors and, in
        # the compiled program, on the real ones.
        from torch._dynamo.variables import TorchInGraphFunctionVariable

        rules.setdefault(entry.replacement, TorchInGraphFunctionVariable)


def check(entry: Replacement) -> dict[str, str]:
    """What each registry says of ``entry``: registry -> "ok" or why not (for the tests and
    ``python -m fakegpu.fake_cuda.identity``)."""
    import pickle

    import torch.jit._builtins as builtins
    import torch.overrides as overrides

    verdicts: dict[str, str] = {}
    op = builtins._find_builtin(entry.original)
    got = builtins._find_builtin(entry.replacement)
    verdicts["torchscript"] = "ok" if got == op else f"builtin {got!r}, original {op!r}"
    ignored = overrides.get_ignored_functions()
    same = (entry.original in ignored) == (entry.replacement in ignored)
    verdicts["overrides.ignored"] = "ok" if same else "differs from the original"
    index = overrides._get_overridable_functions()[1]
    same = (entry.original in index) == (entry.replacement in index)
    verdicts["overrides.overridable"] = "ok" if same else "differs from the original"
    if "torch._dynamo.trace_rules" in sys.modules:
        rules = sys.modules["torch._dynamo.trace_rules"].get_torch_obj_rule_map()
        same = rules.get(entry.original) is rules.get(entry.replacement) or (
            entry.original not in rules and entry.replacement in rules)
        verdicts["dynamo"] = "ok" if same else (f"{rules.get(entry.replacement)} for the replacement, "
                                                f"{rules.get(entry.original)} for the original")
    try:
        verdicts["pickle"] = "ok" if pickle.loads(pickle.dumps(entry.replacement)) is entry.replacement \
            else "loads another object"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        verdicts["pickle"] = f"{type(exc).__name__}: {exc}"
    return verdicts
