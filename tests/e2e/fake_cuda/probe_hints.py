"""Outside fake devices (no FAKEGPU_FAKE_CUDA), a CPU-only torch asked for NCCL or CUDA:
print the error message each request gets (the autoload hook turns them into hints)."""
import json
import os

import torch
import torch.distributed as dist

messages = {}
try:
    torch.zeros(1).cuda()
except Exception as exc:  # noqa: BLE001 - we report whatever torch raised
    messages["cuda"] = f"{type(exc).__name__}: {exc}"
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PROBE_PORT", "29731"),
                  RANK="0", WORLD_SIZE="1")
try:
    dist.init_process_group("nccl")
except Exception as exc:  # noqa: BLE001
    messages["nccl"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(messages))
