"""``ucxcomm bench``: OSU-style sweeps of ucxcomm next to the libraries users would
otherwise pick (raw ucxx, mpi4py + MPICH, torch.distributed's gloo, ``ucx_perftest``,
asyncio streams), measured in the same run on the same machine.

The driver (:mod:`ucxcomm.bench.driver`, behind ``ucxcomm bench``) starts one job per
implementation and message size, alternating implementations within each size so that
the noise of a shared machine hits every one alike; each job is a small program
(``ranks_*`` modules) started under that implementation's own launcher, which prints its
measurements as ``BENCH {json}`` lines. :mod:`ucxcomm.bench.launchers` decides binding and
builds every launcher's command line, for this driver and for the tracking scripts in
``benchmarks/`` alike. Nothing here is imported by ``import ucxcomm``.
"""
