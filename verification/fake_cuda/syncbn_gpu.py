"""A DDP trainer with synchronised batch norm, as written for a GPU cluster.

`nn.SyncBatchNorm.convert_sync_batchnorm`, hard-coded "cuda", NCCL, DDP(device_ids=...):
the pattern of torchvision's reference trainers with --sync-bn.  It has no CPU port (torch
refuses SyncBatchNorm on CPU tensors); its reference is BatchNorm over the whole global batch
in one process (tests/e2e/test_fake_cuda_sync_batchnorm.py computes it).

Usage: syncbn_gpu.py OUT_DIR [STEPS] [CHANNELS_LAST]; writes OUT_DIR/rank<r>.pt with the losses,
the final state dict and an eval-mode output.  Rank r trains on rows r*B..(r+1)*B-1 of each
step's global batch, drawn from a generator seeded by the step.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

LOCAL_BATCH = 4


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 3, padding=1), torch.nn.BatchNorm2d(4, momentum=None), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))


def global_batch(step: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * LOCAL_BATCH, 3, 6, 6, generator=g) * 2 + 0.5
    y = torch.randn(world * LOCAL_BATCH, 2, generator=g)
    return x, y


def main() -> None:
    out_dir = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    channels_last = len(sys.argv) > 3 and sys.argv[3] == "1"
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(make_model()).cuda()
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, world)
        rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        x, y = x[rows].cuda(non_blocking=True), y[rows].cuda(non_blocking=True)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        evaluated = model(global_batch(steps, world)[0].cuda())
    torch.save({"losses": losses, "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "eval": evaluated.cpu(), "world": world},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
