"""DDP training of a small MLP over the ucxcomm torch.distributed backend (CPU).

Run with either launcher; the program is the same::

    torchrun --nproc-per-node 2 examples/torch_ddp.py
    ucxcomm run -n 2 examples/torch_ddp.py

``--backend gloo`` runs it over gloo instead, for comparison. Each rank trains on its own
shard of a synthetic regression problem; DDP averages the gradients, so every replica
holds the same parameters after every step (checked at the end).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

import ucxcomm.torch  # noqa: F401  (registers the "ucxcomm" backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--backend", default="ucxcomm", choices=["ucxcomm", "gloo"])
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    torch.manual_seed(0)  # the same initial model everywhere (DDP broadcasts it anyway)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    # The target: a fixed random linear map plus a nonlinearity; each rank its own data.
    true_w = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    data = torch.Generator().manual_seed(1000 + rank)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, 32, generator=data)
        y = torch.tanh(x @ true_w)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # gradients are averaged across ranks here
        opt.step()
        if rank == 0 and (step % 50 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - t0

    # Every replica must hold the same parameters: compare checksums.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(size)]
    dist.all_gather(sums, flat.double().sum().reshape(1))
    if rank == 0:
        agree = all(torch.equal(s, sums[0]) for s in sums)
        print(f"replicas agree: {agree}; {args.steps} steps in {elapsed:.2f} s "
              f"({1e3 * elapsed / args.steps:.2f} ms/step, {args.backend}, {size} ranks)",
              flush=True)
        if not agree:
            raise SystemExit("replicas diverged")
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
