"""What fast swap costs a running PyTorch program: the speed of an
allocation-heavy training step and of a launch-bound inference loop.

    python3 fastswap_overhead.py KIND SECONDS

KIND: train (an MLP's forward, backward and optimizer step on batches of
varying size, so that the caching allocator keeps asking the driver for
memory; with PYTORCH_NO_CUDA_MEMORY_CACHING=1 every tensor is a driver
allocation) or infer (batch-1 forwards of a 24-layer MLP: one small kernel
after another). Prints one line: KIND iterations seconds it/s.
"""
import sys
import time

import torch

kind, secs = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
dev = "cuda"
if kind == "train":
    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(2048, 2048), torch.nn.GELU())]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sizes = [64, 96, 128, 160, 192, 256, 320, 384]

    def step(i):
        x = torch.randn(sizes[i % len(sizes)], 2048, device=dev)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
else:
    model = torch.nn.Sequential(*[m for _ in range(24) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())]).to(dev).eval()
    x = torch.randn(1, 1024, device=dev)

    def step(i):
        with torch.no_grad():
            model(x)

for i in range(20):
    step(i)
torch.cuda.synchronize()
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < secs:
    for _ in range(10):
        step(n)
        n += 1
    torch.cuda.synchronize()
dt = time.perf_counter() - t0
print(f"{kind} {n} {dt:.3f} {n / dt:.1f}", flush=True)
