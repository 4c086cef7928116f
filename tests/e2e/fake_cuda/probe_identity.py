"""Every torch object fake CUDA replaces, against each identity-keyed registry of torch
(tests/e2e/test_fake_cuda_identity.py).  Prints one JSON object:

  {"replaced": {public path: {registry: "ok" | why not}}, "programs": {name: "ok" | error}}

"replaced" is fakegpu.fake_cuda.identity.check for each entry of identity.REPLACED plus
inspect; "programs" are small programs of each kind (TorchScript, torch.compile fullgraph, FX,
__torch_function__, pickling) whose results are compared with the same computation written
without the replaced objects.
"""
import inspect
import json
import pickle
import sys
import traceback

import torch
import torch.nn.functional as F

from fakegpu.fake_cuda import identity


def signature_or_error(obj):
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError) as exc:
        return type(exc).__name__


def registry_verdicts() -> dict:
    out = {}
    for entry in identity.REPLACED:
        verdicts = identity.check(entry)
        original = signature_or_error(entry.original)
        # A class torch gives no signature (torch.Generator's C constructor) may gain one.
        same = signature_or_error(entry.replacement) == original or (
            isinstance(entry.original, type) and original == "ValueError")
        verdicts["inspect.signature"] = "ok" if same else (
            f"{signature_or_error(entry.replacement)} vs {signature_or_error(entry.original)}")
        verdicts["identity"] = "ok" if identity.original_of(entry.replacement) is entry.original \
            and entry.replacement is not entry.original else "not recorded"
        out[entry.public_path] = verdicts
    return out


# --- programs ------------------------------------------------------------------------------

def scripted_function():
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + torch.tensor(2.0) + torch.as_tensor([1.0, 2.0])

    x = torch.arange(2.0)
    assert torch.equal(torch.jit.script(f)(x), x + 2.0 + torch.tensor([1.0, 2.0]))


def scripted_sdpa_and_to():
    def g(q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q).to(torch.float64)

    q = torch.randn(1, 2, 4, 8)
    assert torch.allclose(torch.jit.script(g)(q), g(q))


class Counter:
    def __init__(self):
        self.steps = torch.tensor(0.0)

    def step(self) -> torch.Tensor:
        self.steps = self.steps + torch.tensor(1.0)
        return self.steps


def scripted_class():
    counter = torch.jit.script(Counter)()
    counter.step()
    assert float(counter.step()) == 2.0


def distributed_optim_import():
    import torch.distributed.optim  # noqa: F401 - scripts functional optimizers at import


def compiled_fullgraph():
    def h(x):
        shift = torch.tensor([1.0, 2.0], device="cuda")
        moved = x.to("cuda") + torch.as_tensor([3.0, 4.0], device="cuda")
        q = moved.reshape(1, 1, 1, 2)
        return F.scaled_dot_product_attention(q, q, q).flatten() + shift + x.cuda()

    x = torch.arange(2.0)
    torch._dynamo.reset()
    got = torch.compile(h, fullgraph=True, backend="eager")(x)
    assert torch.allclose(got, h(x)), (got, h(x))
    got = torch.compile(h, fullgraph=True, backend="aot_eager")(x)
    assert torch.allclose(got, h(x)), (got, h(x))


def fx_traced():
    class M(torch.nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q).to(torch.float64) + torch.tensor(1.0)

    traced = torch.fx.symbolic_trace(M())
    q = torch.randn(1, 2, 4, 8)
    assert torch.allclose(traced(q), M()(q))
    assert "scaled_dot_product_attention" in traced.code


class Seen(torch.Tensor):
    funcs: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.funcs.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def torch_function_identity():
    q = torch.randn(1, 1, 2, 4).as_subclass(Seen)
    Seen.funcs.clear()
    q.to(torch.float64)
    F.scaled_dot_product_attention(q, q, q)
    assert any(f is torch.Tensor.to for f in Seen.funcs), Seen.funcs
    assert any(f is F.scaled_dot_product_attention for f in Seen.funcs), Seen.funcs
    ignored = torch.overrides.get_ignored_functions()
    assert torch.tensor in ignored and torch.as_tensor in ignored
    assert F.scaled_dot_product_attention in torch.overrides.get_testing_overrides()


def pickled_references():
    objects = [torch.tensor, torch.as_tensor, F.scaled_dot_product_attention, torch.Tensor.to,
               torch.Tensor.cuda, torch.load, torch.Generator]
    assert all(a is b for a, b in zip(pickle.loads(pickle.dumps(objects)), objects))
    assert isinstance(torch.default_generator, torch.Generator)
    assert isinstance(torch.Generator(device="cuda"), torch._C.Generator)


PROGRAMS = [scripted_function, scripted_sdpa_and_to, scripted_class, distributed_optim_import,
            compiled_fullgraph, fx_traced, torch_function_identity, pickled_references]


def main():
    programs = {}
    for program in PROGRAMS:
        try:
            program()
            programs[program.__name__] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported per program
            programs[program.__name__] = f"{type(exc).__name__}: {exc}"[:500]
            traceback.print_exc(file=sys.stderr)
    print(json.dumps({"replaced": registry_verdicts(), "programs": programs}))


if __name__ == "__main__":
    main()
