"""Per-rank memory of a model too large for this machine, without allocating it.

How it compares with TorchTitan's published peaks: docs/fake-worlds.md, "Models larger than
the machine" (``--check-published`` reruns the comparison).

The model, its FSDP2 shards, gradients, optimizer state and activations are fake tensors
(torch's ``FakeTensorMode``: shapes, dtypes and storage sizes, no data), the process group
is torch's own ``fake`` backend (collectives complete at once, on nothing), and torch's
``FSDPMemTracker`` (torch.distributed._tools.fsdp2_mem_tracker) counts every storage that
lives at each moment of one training step, by category: parameters, buffers, gradients,
optimizer state, activations, temporaries.  The allocation and free sequence is also
replayed through fakegpu's model of the CUDA caching allocator (fakegpu.fake_cuda.allocator)
so the result is the allocator's reserved peak, the number ``torch.cuda.max_memory_reserved()``
(and TorchTitan's "memory: X GiB") reports.

The model is TorchTitan's own (its model registry, its ``parallelize_fn``: FSDP2 with its
mixed-precision policy, its selective activation checkpointing), built the way its trainer
builds it (meta device, then ``to_empty``), here on fake tensors.

What it cannot compute: anything data-dependent (values, losses, NaNs, routing of MoE
tokens, variable-length batches), NCCL's own buffers and the CUDA context (a few hundred
MiB to ~1 GiB per GPU on a real run), torch.compile's fused kernels (the estimate is the
eager program's), and allocator effects of several streams (FSDP's all-gather stream keeps
its blocks apart on a GPU; the replay has one stream).

    python -m fakegpu.fake.estimate_memory --flavor 8B --dp-shard 8 --local-batch-size 2 \\
        --seq-len 8192 --ac selective
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import weakref
from typing import Optional

GiB = 1024 ** 3


class _AllocatorReplay:
    """Feeds each new storage's size to the caching-allocator model and frees it when the
    storage dies; reports the model's peak reserved and allocated bytes."""

    def __init__(self, total_bytes: int):
        from fakegpu.fake_cuda.allocator import CachingAllocatorModel

        self.allocator = CachingAllocatorModel(0, total_bytes)
        self._live: dict[int, object] = {}

    def track(self, storage) -> None:
        key = id(storage)
        if key in self._live:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        block = self.allocator.malloc(nbytes)
        self._live[key] = block

        def release(key=key):
            block = self._live.pop(key, None)
            if block is not None:
                self.allocator.free(block)

        weakref.finalize(storage, release)

    def resized(self, storage, nbytes: int) -> None:
        """FSDP2 frees and re-allocates unsharded parameters by resizing their storage."""
        key = id(storage)
        block = self._live.get(key)
        if block is None:
            if nbytes:
                self.track(storage)
            return
        self.allocator.free(block)
        if nbytes:
            self._live[key] = self.allocator.malloc(nbytes)
        else:
            self._live[key] = None


def _resize_hook(replay: "_AllocatorReplay"):
    """Context manager: storage resizes reach the replay while it is active."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def hooked():
        original = torch.UntypedStorage.resize_

        def resize_(self, size):
            result = original(self, size)
            replay.resized(self, int(size))
            return result

        torch.UntypedStorage.resize_ = resize_
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = original

    return hooked()


def _replay_mode(replay: _AllocatorReplay):
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def owned(t, out: list) -> None:
        """The tensors that own memory: a wrapper subclass (DTensor, FSDP's views) reports
        its global size, its inner tensors are what is allocated (and, run inside this
        mode's own dispatch, they are not seen by it separately)."""
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            for name in names:
                owned(getattr(t, name), out)
        elif type(t) in (FakeTensor, torch.Tensor, torch.nn.Parameter) and not t.is_meta:
            out.append(t)

    class Replay(TorchDispatchMode):
        supports_higher_order_operators = True   # FlexAttention's op passes through too

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors: list = []
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    owned(t, tensors)
            for t in tensors:
                try:
                    replay.track(t.untyped_storage())
                except Exception:
                    pass
            return out

    return Replay()


def _flex_attention_on_fake_tensors():
    """FlexAttention's own higher-order op, called directly (as a compiled program calls it).

    Its fake-tensor implementation allocates what the GPU kernel allocates: the output and
    the per-row log-sum-exp forward, the three input gradients backward, never the L x L
    scores.  Calling the op (not a stand-in) keeps TorchTitan's selective activation
    checkpointing policy, which saves the op's outputs, exact.  The public
    ``flex_attention`` cannot be used: it refuses CPU inputs that need gradients and wraps
    itself in ``torch.compile``."""
    import math

    from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
    from torch.nn.attention.flex_attention import AuxOutput, _apply_kernel_options, _identity

    def compiled_flex_attn(q, k, v, *, score_mod=None, block_mask=None, scale=None,
                           enable_gqa=False, return_aux=None, kernel_options=None):
        options = _apply_kernel_options(q, k, v, False, kernel_options, return_aux)
        scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
        out, lse, _ = flex_attention_hop(q, k, v, score_mod or _identity, block_mask.as_tuple(),
                                         scale, options)
        return out, AuxOutput(lse=lse if return_aux is not None and return_aux.lse else None)

    return compiled_flex_attn


def estimate(flavor: str, dp_shard: int, local_batch_size: int, seq_len: int, ac: str,
             steps: int = 2, device_gib: float = 95.0, chunked_loss: bool = True) -> dict:
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import config_registry as registry

    config = registry.llama3_8b() if flavor == "8B" else registry.llama3_debugmodel()
    if flavor not in ("8B", "debugmodel"):
        from torchtitan.models.llama3 import model_registry
        config.model_spec = model_registry(flavor)
    config.training.local_batch_size = local_batch_size
    config.training.seq_len = seq_len
    config.parallelism.data_parallel_shard_degree = dp_shard
    config.parallelism.spmd_backend = "partial_dtensor"
    if ac == "none":
        config.activation_checkpoint = None
    elif ac == "full":
        from torchtitan.distributed.activation_checkpoint import FullAC
        config.activation_checkpoint = FullAC.Config()
    # else: the config's own selective AC

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp_shard)
    import torchtitan.distributed.parallel_dims as titan_dims

    # Fake tensors live on the CPU here (a CPU build has no CUDA device guard for a backward on
    # cuda fake tensors); the mesh has to be a CPU mesh for FSDP2 to place shards there.
    titan_dims.device_type = "cpu"
    parallel_dims = ParallelDims.from_config(config.parallelism, dp_shard)
    parallel_dims.build_mesh()

    model_spec = config.model_spec
    model_config = model_spec.model
    model_config.update_from_config(config=config)
    t0 = time.time()
    with torch.device("meta"):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        model = model_config.build()
        torch.set_default_dtype(prev)
    model = model_spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                      parallelism=config.parallelism, compile_config=config.compile,
                                      ac_config=config.activation_checkpoint,
                                      dump_folder="/tmp")
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention.compiled_flex_attn = staticmethod(_flex_attention_on_fake_tensors())
    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, local_batch_size, None, seq_len, seq_len,
                                   device="cpu")
    replay = _AllocatorReplay(int(device_gib * GiB))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    result: dict = {"flavor": flavor, "dp_shard": dp_shard, "local_batch_size": local_batch_size,
                    "seq_len": seq_len, "ac": ac}
    with fake_mode, _resize_hook(replay):
        with _replay_mode(replay):
            # Storage only: weight initialisation is data-dependent (truncated normals) and
            # the values do not matter for memory.
            model.to_empty(device="cpu")
        model.train()
        # TorchTitan's AdamW. Its default fused implementation keeps no per-step temporaries on
        # a GPU; on CPU DTensors here the fused and foreach kernels redistribute the shards to
        # full tensors (4 full copies per weight), the per-parameter loop does not and holds
        # one parameter's temporaries at a time, which is the closest stand-in.
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                      weight_decay=0.1, foreach=False, fused=False)
        vocab = model_config.vocab_size if hasattr(model_config, "vocab_size") else 128256
        tracker = FSDPMemTracker(mod=model, optm=optimizer)
        tracker.supports_higher_order_operators = True   # its dispatch only counts outputs
        with tracker, _replay_mode(replay):
            for step in range(steps):
                tokens = torch.randint(0, vocab, (local_batch_size, seq_len))
                labels = torch.randint(0, vocab, (local_batch_size, seq_len))
                logits = model(tokens, attention_masks=block_mask)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                del logits
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")

        def local_bytes(t) -> int:
            t = getattr(t, "_local_tensor", t)
            return t.numel() * t.element_size()

        result["parameter_bytes"] = sum(local_bytes(p) for p in model.parameters())
        result["optimizer_state_bytes"] = sum(local_bytes(v) for st in optimizer.state.values()
                                              for v in st.values() if isinstance(v, torch.Tensor))
    dev = next(k for k in peak if str(k) != "cpu" or True)
    by_kind = {getattr(k, "value", str(k)): int(v) for k, v in peak[dev].items()}
    result.update({
        "tracked_peak_bytes": by_kind.get("Total", 0),
        "tracked_peak_by_category": by_kind,
        "allocator_peak_allocated_bytes": int(replay.allocator.stat("allocated_bytes", field="peak")),
        "allocator_peak_reserved_bytes": int(replay.allocator.stat("reserved_bytes", field="peak")),
        "allocator_end_allocated_bytes": int(replay.allocator.stat("allocated_bytes")),
        "seconds": round(time.time() - t0, 1),
    })
    return result


# TorchTitan's published peaks (docs/performance.md of the TorchTitan repository, Llama 3.1 8B,
# H100, local batch 2, selective activation checkpointing, sequence length 8192, eager).
PUBLISHED = (
    {"name": "Llama 3.1 8B, FSDP on 8 H100 (Table 1)", "dp_shard": 8, "gib": 82.4},
    {"name": "Llama 3.1 8B, FSDP on 128 H100 (Table 3)", "dp_shard": 128, "gib": 67.0},
)


def check_published(tolerance: float = 0.10) -> int:
    """Estimate both published configurations and compare; 0 when all are within tolerance."""
    ok = True
    print(f"{'configuration':<44} {'published':>10} {'estimate':>10} {'error':>8}")
    import subprocess
    import tempfile

    for case in PUBLISHED:
        # one process per configuration: the fake process group's size is fixed per process
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, "-m", "fakegpu.fake.estimate_memory", "--flavor", "8B",
                            "--dp-shard", str(case["dp_shard"]), "--local-batch-size", "2",
                            "--seq-len", "8192", "--ac", "selective", "--json", out.name],
                           check=True, stdout=subprocess.DEVNULL)
            r = json.loads(open(out.name, encoding="utf-8").read())
        est = r["allocator_peak_reserved_bytes"] / GiB
        err = est / case["gib"] - 1
        ok &= abs(err) <= tolerance
        print(f"{case['name']:<44} {case['gib']:>8.1f} G {est:>8.1f} G {err:>+7.1%}", flush=True)
    return 0 if ok else 1


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fakegpu.fake.estimate_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="8B")
    p.add_argument("--dp-shard", type=int, default=8)
    p.add_argument("--local-batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--ac", choices=("selective", "full", "none"), default="selective")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--check-published", action="store_true",
                   help="estimate TorchTitan's published Llama 3.1 8B configurations and compare (10 %% tolerance)")
    a = p.parse_args(argv)
    if a.check_published:
        return check_published()
    r = estimate(a.flavor, a.dp_shard, a.local_batch_size, a.seq_len, a.ac, a.steps)
    text = json.dumps(r, indent=2)
    print(text)
    print(f"peak per rank: reserved {r['allocator_peak_reserved_bytes'] / GiB:.1f} GiB, "
          f"allocated {r['allocator_peak_allocated_bytes'] / GiB:.1f} GiB "
          f"(FSDPMemTracker {r['tracked_peak_bytes'] / GiB:.1f} GiB)", file=sys.stderr)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
