"""The torch suite of ``ucxcomm bench`` (and of benchmarks/torch_backend.py):
torch.distributed's ``all_reduce`` (float32, in place) and one DDP training step of an
MLP, over the ``ucxcomm`` backend (``ucxcomm.torch``) or ``gloo``. Started with torchrun's
variables (``ucxcomm run`` exports them) as ``python -m ucxcomm.bench.ranks_torch torch
--ops all_reduce,ddp_step --size N --backend ucxcomm|gloo [--gpu]``. Times are the slowest
rank's, exchanged over a separate gloo group so that neither backend times itself. With
``--gpu`` the tensors and the model live on GPU ``LOCAL_RANK % device count`` and each
timed pass ends with ``torch.cuda.synchronize()``."""

from __future__ import annotations

import sys
import time

from .spec import emit, job_options


def main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import ucxcomm.torch  # noqa: F401  (registers the backend)

    backend = "gloo"
    if "--backend" in argv:
        i = argv.index("--backend")
        backend = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    args = job_options(argv[1:])
    plan, size = args.plan, args.size
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    timing = dist.new_group(backend="gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    impl = ("ucxcomm" if backend == "ucxcomm" else backend) + ("-gpu" if args.gpu else "")
    device = torch.device("cpu")
    if args.gpu:
        device = torch.device("cuda", dist.get_node_local_rank(0) % torch.cuda.device_count())
        torch.cuda.set_device(device)

    def sync() -> None:
        if args.gpu:
            torch.cuda.synchronize()

    def slowest(seconds: list[float]) -> list[float]:
        t = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=timing)
        return [s * 1e6 for s in t.tolist()]

    def timed(body, n: int) -> list[float]:
        out = []
        for rep in range(plan.samples + 1):
            dist.barrier(group=timing)
            t0 = time.perf_counter()
            for _ in range(n):
                body()
            sync()
            if rep:
                out.append((time.perf_counter() - t0) / n)
        return slowest(out)

    if "all_reduce" in args.ops:
        t = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        samples = timed(lambda: dist.all_reduce(t), plan.iters(size))
        if rank == 0:
            emit(impl, "all_reduce", size, p, samples)
    if "ddp_step" in args.ops:
        # forward, backward (gradients all-reduced in buckets, overlapped with the
        # backward pass), optimizer step
        width = 256 if plan.quick else 1024
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                              nn.ReLU(), nn.Linear(width, 10)).to(device)
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if args.gpu else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        x, y = torch.randn(32, width, device=device), torch.randint(0, 10, (32,), device=device)
        nbytes = sum(q.numel() * q.element_size() for q in model.parameters())

        def step() -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()

        samples = timed(step, 3 if plan.quick else 20)
        if rank == 0:
            emit(impl, "ddp_step", nbytes, p, samples)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
