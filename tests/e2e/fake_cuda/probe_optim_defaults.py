"""Optimizers of fake-device parameters take the foreach path, as on a GPU, and compute the
same bits as the same optimizer on CPU parameters (the per-tensor path)."""
import importlib

import torch

calls = {"adam": 0, "sgd": 0}
for module, name, key in ((importlib.import_module("torch.optim.adam"), "_multi_tensor_adam", "adam"),
                          (importlib.import_module("torch.optim.sgd"), "_multi_tensor_sgd", "sgd")):
    original = getattr(module, name)

    def counting(*args, _original=original, _key=key, **kwargs):
        calls[_key] += 1
        return _original(*args, **kwargs)

    setattr(module, name, counting)


def train(device, make_optimizer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
    optimizer = make_optimizer(model.parameters())
    for step in range(6):
        torch.manual_seed(step)
        x = torch.randn(8, 16).to(device)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


for label, make in (("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
                    ("adam-amsgrad", lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True)),
                    ("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True))):
    before = dict(calls)
    on_gpu = train("cuda", make)
    took_foreach = calls != before
    after_gpu = dict(calls)
    on_cpu = train("cpu", make)
    assert took_foreach, f"{label}: fake-device parameters did not take the foreach path"
    assert calls == after_gpu, f"{label}: CPU parameters took the foreach path"
    assert all(torch.equal(a, b) for a, b in zip(on_gpu, on_cpu)), f"{label}: results differ"
print("ok")
