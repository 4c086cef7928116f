"""CUDA graphs on fake devices (fakegpu/fake_cuda/graphs.py), each against the same
computation run eagerly: a static-input graph, a whole training step (forward, backward,
optimizer) with its in-place updates, and torch.cuda.make_graphed_callables.  Prints one JSON
object of named booleans and counts."""
import torch, json
torch.manual_seed(0)
out = {}
# 1. static-input graph: y = relu(x @ w) + 1, accumulate into pre-existing buffer
w = torch.randn(4, 4, device="cuda")
acc = torch.zeros(4, device="cuda")
static_x = torch.randn(2, 4, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2):   # warm-up, as the CUDA docs do
        y = torch.relu(static_x @ w) + 1
torch.cuda.current_stream().wait_stream(s)
acc_before = acc.clone()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    static_y = torch.relu(static_x @ w) + 1
    acc.add_(static_y.sum(0))
out["capture_did_not_change_acc"] = torch.equal(acc, acc_before)
xs = [torch.randn(2, 4) for _ in range(3)]
expect_acc = acc_before.clone()
ok = True
for x in xs:
    static_x.copy_(x)
    g.replay()
    ref = torch.relu(x @ w) + 1
    expect_acc += ref.sum(0)
    ok &= torch.equal(static_y, ref)
out["replay_outputs_equal"] = bool(ok)
out["replay_accumulates"] = torch.equal(acc, expect_acc)
out["capturing_outside"] = torch.cuda.is_current_stream_capturing()
# 2. forward + backward + optimizer step in a graph (the CUDA docs' whole-network capture)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).cuda()
ref_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
ref_model.load_state_dict(model.state_dict())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
sx, sy = torch.randn(3, 4, device="cuda"), torch.randn(3, 1, device="cuda")
data = [(torch.randn(3, 4), torch.randn(3, 1)) for _ in range(5)]
def step(m, o, x, y):
    o.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    o.step()
    return loss
# warm up on both
for x, y in data[:2]:
    sx.copy_(x); sy.copy_(y)
    step(model, opt, sx, sy); step(ref_model, ref_opt, x, y)
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2):
    static_loss = step(model, opt, sx, sy)
losses, ref_losses = [], []
for x, y in data[2:]:
    sx.copy_(x); sy.copy_(y)
    g2.replay()
    losses.append(static_loss.item())
    ref_losses.append(step(ref_model, ref_opt, x, y).item())
out["train_losses_equal"] = losses == ref_losses
out["params_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
# 2b. flex attention (its logsumexp is saved for backward, not returned), plain and under
# selective activation checkpointing (which recomputes it in backward), as TorchTitan's default
# llama3 runs it: gradients of graph replays equal eager ones, step by step
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 16, 16, device="cuda")
def policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
class Attention(torch.nn.Module):
    def __init__(self, sac):
        super().__init__()
        torch.manual_seed(3)
        self.qkv, self.out, self.sac = torch.nn.Linear(8, 24), torch.nn.Linear(8, 1), sac
    def block(self, x):
        q, k, v = self.qkv(x).view(1, 16, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return self.out(flex_attention(q, k, v, block_mask=mask).transpose(1, 2).reshape(1, 16, 8))
    def forward(self, x):
        if not self.sac:
            return self.block(x)
        return checkpoint(self.block, x, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy))
flex_data = [(torch.randn(1, 16, 8), torch.randn(1, 16, 1)) for _ in range(5)]
for sac in (False, True):
    runs = []
    for graphed in (False, True):
        net = Attention(sac).cuda(); o = torch.optim.SGD(net.parameters(), lr=0.1)
        fx, fy = torch.zeros(1, 16, 8, device="cuda"), torch.zeros(1, 16, 1, device="cuda")
        fg = None; grads = []
        for i, (x, y) in enumerate(flex_data):
            fx.copy_(x); fy.copy_(y)
            o.zero_grad(set_to_none=False)
            if not graphed or i == 0:
                torch.nn.functional.mse_loss(net(fx), fy).backward()
            else:
                if fg is None:
                    fg = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(fg):
                        torch.nn.functional.mse_loss(net(fx), fy).backward()
                fg.replay()
            grads.append([p.grad.clone() for p in net.parameters()])
            o.step()
        runs.append(grads)
    out[f"flex_{'sac_' if sac else ''}grads_equal"] = all(
        torch.equal(a, b) for ga, gb in zip(*runs) for a, b in zip(ga, gb))
# 3. make_graphed_callables
lin = torch.nn.Linear(4, 4).cuda()
ref_lin = torch.nn.Linear(4, 4); ref_lin.load_state_dict(lin.state_dict())
graphed = torch.cuda.make_graphed_callables(lin, (torch.randn(2, 4, device="cuda", requires_grad=True),))
x = torch.randn(2, 4, requires_grad=True); xr = x.detach().clone().requires_grad_()
graphed(x).sum().backward(); ref_lin(xr).sum().backward()
out["graphed_callable_grads_equal"] = torch.equal(x.grad, xr.grad) and torch.equal(lin.weight.grad, ref_lin.weight.grad)
# 4. errors a GPU would give too
errors = {}
try:
    torch.cuda.CUDAGraph().replay()
except RuntimeError as exc:
    errors["replay_before_capture"] = str(exc)
out["errors"] = errors
out["recorded_steps"] = g.recorded_steps
print(json.dumps(out))
