"""The outputs of an inductor-compiled graph are charged to the fake device (inductor's CPU
code allocates them below the dispatcher, where the C++ tracker does not see them)."""
import json

import torch

from fakegpu.fake_cuda import runtime

model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
x = torch.randn(64, 256, device="cuda")
compiled = torch.compile(model, backend="inductor")
out = {"native": runtime.state().memory.native is not None}
with torch.no_grad():
    base = torch.cuda.memory_allocated()
    y = compiled(x)
    out["compiled_output"] = torch.cuda.memory_allocated() - base
    z = y * 2
    out["op_on_compiled_output"] = torch.cuda.memory_allocated() - base
    out["equal_to_eager"] = bool(torch.allclose(y, model(x), rtol=1e-5, atol=1e-6))
from torch._dynamo.utils import counters  # noqa: E402

out["graphs"] = counters["stats"]["unique_graphs"]
print(json.dumps(out))
