"""An op with a CUDA kernel only (as a custom CUDA extension registers it), called on a fake
CUDA tensor and left uncaught: stderr must be the one line naming the op."""
import torch

lib = torch.library.Library("fgpu_probe", "DEF")
lib.define("cuda_only(Tensor x) -> Tensor")
lib.impl("cuda_only", lambda x: x * 2, "CUDA")

x = torch.ones(4, device="cuda")
torch.ops.fgpu_probe.cuda_only(x)
