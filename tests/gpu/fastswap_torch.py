"""A PyTorch program for the fast-swap benchmark: holds GB of tensors from
the caching allocator and a captured CUDA graph, keeps launching small
kernels, and answers a checksum request (STATUS.check -> STATUS.result).

    python3 tests/gpu/fastswap_torch.py GB STATUS
"""
import sys

import torch
from fastswap_status import digest_of, serve

gb, status = float(sys.argv[1]), sys.argv[2]
torch.cuda.init()
chunk = 256 << 20
tensors = []
left = int(gb * (1 << 30))
seed = torch.Generator(device="cuda").manual_seed(7)
while left > 0:
    n = min(chunk, left) // 4
    tensors.append(torch.rand(n, device="cuda", generator=seed))
    left -= n * 4
x = torch.rand(2048, 2048, device="cuda", generator=seed)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        y = x @ x
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = x @ x


def digest():
    graph.replay()
    torch.cuda.synchronize()
    parts = [int(torch.sum(t.view(torch.int32), dtype=torch.int64)) for t in tensors]
    parts.append(int(torch.sum(out.view(torch.int32), dtype=torch.int64)))
    return digest_of(parts)


serve(status, digest, lambda: tensors[0][:1024].sum())
