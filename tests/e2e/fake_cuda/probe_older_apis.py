"""Run by tests/e2e/test_fake_cuda_older_apis.py in a fresh interpreter set up as fgpu sets up a
rank (2 fake devices): the torch.cuda APIs older GPU scripts use around training.  Prints one
JSON object."""
import json

import torch

out = {}
# legacy tensor types: `Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor`
x = torch.cuda.FloatTensor([1.5, 2.5])
out["legacy_ctor"] = [str(x.dtype), x.tolist(), isinstance(torch.randn(2).cuda(), torch.cuda.FloatTensor)]
out["legacy_type"] = [torch.arange(3).type(torch.cuda.FloatTensor).dtype == torch.float32,
                      torch.arange(3).type("torch.cuda.HalfTensor").dtype == torch.float16,
                      torch.randn(2).cuda().type()]
out["ipc_collect"] = torch.cuda.ipc_collect() is None
out["nccl_version"] = list(torch.cuda.nccl.version())
# set_per_process_memory_fraction: the allocator refuses segments past fraction x total
total = torch.cuda.get_device_properties(1).total_memory
torch.cuda.set_per_process_memory_fraction(0.25, 1)
out["fraction"] = torch.cuda.get_per_process_memory_fraction(1)
kept = torch.empty(int(total * 0.2) // 4, dtype=torch.float32, device="cuda:1")   # fits
try:
    torch.empty(int(total * 0.1) // 4, dtype=torch.float32, device="cuda:1")      # 0.3 > 0.25
    out["fraction_oom"] = None
except torch.OutOfMemoryError as exc:
    out["fraction_oom"] = str(exc)
out["device0_unaffected"] = torch.empty(int(total * 0.3) // 4, device="cuda:0").numel() > 0
try:
    torch.cuda.set_per_process_memory_fraction(1.5)
    out["bad_fraction"] = None
except ValueError as exc:
    out["bad_fraction"] = str(exc)
print(json.dumps(out))
