"""Run by tests/e2e/test_fake_cuda_data_parallel.py in a fresh interpreter set up as fgpu sets up a
rank with 3 fake devices.  Trains a model wrapped as GPU scripts wrap it
(``nn.DataParallel(model).cuda()``) and, beside it, the computation DataParallel stands for, done
by hand: the batch in one chunk per device, replica 0 with the module's own buffers and the
others with copies, the chunks' gradients summed in device order.  Prints one JSON object."""
import copy
import json

import torch

out = {"device_count": torch.cuda.device_count()}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                            torch.nn.Dropout(0.0), torch.nn.Linear(8, 3))
reference = copy.deepcopy(model)
dp = torch.nn.DataParallel(model).cuda()
out["device_ids"] = dp.device_ids
opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
criterion = torch.nn.CrossEntropyLoss()
params = dict(reference.named_parameters())
out["outputs_equal"], out["grads_equal"], out["losses"] = [], [], []
for step in range(3):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(10, 5, generator=g).cuda(non_blocking=True)   # 10 rows: chunks of 4, 4, 2
    target = torch.randint(0, 3, (10,), generator=g).cuda(non_blocking=True)

    output = dp(x)
    loss = criterion(output, target)
    opt.zero_grad()
    loss.backward()

    chunks, targets = x.chunk(3), target.chunk(3)
    buffers = dict(reference.named_buffers())
    outputs, grads = [], None
    for j, (chunk, t) in enumerate(zip(chunks, targets)):
        own = buffers if j == 0 else {k: v.clone() for k, v in buffers.items()}
        y = torch.func.functional_call(reference, (params, own), (chunk,))
        outputs.append(y)
    ref_output = torch.cat(outputs)
    ref_loss = criterion(ref_output, target)
    # d(loss)/d(params) of each replica on its own, summed in device order (ReduceAddCoalesced)
    chunk_grads = torch.autograd.grad(ref_loss, outputs, retain_graph=True)
    total = None
    for y, gy in zip(outputs, chunk_grads):
        gp = torch.autograd.grad(y, list(params.values()), gy, retain_graph=True)
        total = [a.clone() for a in gp] if total is None else [a.add_(b) for a, b in zip(total, gp)]
    for p, gp in zip(params.values(), total):
        p.grad = gp
    out["outputs_equal"].append(torch.equal(output, ref_output))
    out["grads_equal"].append(all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                                            reference.parameters())))
    out["losses"].append([loss.item(), ref_loss.item()])
    opt.step()
    ref_opt.step()

out["params_equal"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
out["buffers_equal"] = all(torch.equal(p, q) for p, q in zip(model.buffers(), reference.buffers()))
out["running_mean_moved"] = not torch.equal(model[1].running_mean, torch.zeros(8))
out["replica_memory_charged"] = [torch.cuda.max_memory_allocated(d) > 0 for d in range(3)]

# output_device=1, keyword inputs, and eval mode (running statistics: the same on every replica)
dp1 = torch.nn.DataParallel(torch.nn.Linear(5, 2), output_device=1).cuda()
y = dp1(input=torch.randn(7, 5).cuda())
out["kwargs_output_shape"] = list(y.shape)
dp.eval()
with torch.no_grad():
    xe = torch.randn(9, 5).cuda()
    reference.eval()
    # Each chunk a copy of its own, as scatter gives each replica (a view at an offset can take
    # another SIMD path in the CPU matmul and differ in the last bit).
    out["eval_equal"] = torch.equal(dp(xe), torch.cat([reference(c.clone()) for c in xe.chunk(3)]))
print(json.dumps(out))
