"""The pipeline suite of ``ucxcomm bench`` (and of benchmarks/pipeline.py): one producer
process streams batches to one consumer process, on ucxcomm streams
(``ep.stream_writer``/``stream_reader``), raw ucxx (``ucxx.create_listener``/
``create_endpoint``, ``await ep.send``/``recv`` into a reused buffer, in a chosen progress
mode) and asyncio TCP streams (``writer.write`` + ``drain``, ``reader.readexactly``).

    python -m ucxcomm.bench.ranks_pipeline consumer IMPL SCHEDULE [WINDOW]  # prints PORT n
    python -m ucxcomm.bench.ranks_pipeline producer IMPL SCHEDULE PORT      # BENCH lines

IMPL is ``ucxcomm``, ``ucxx-polling``, ``ucxx-blocking``, ``ucxx-thread`` or ``asyncio``;
SCHEDULE is ``size:count:reps,...``. After each rep's ``count`` batches the consumer
answers one byte; the producer times first send to answer (GB/s). Consumers receive into
reused memory (ucxcomm: its stream's buffer pool; ucxx: one preallocated array; asyncio:
``readexactly``, which allocates). ucxcomm sends a small header per batch (dtype, shape)
and credits back; the raw baselines send the data only, one message in flight at a time
(``await ep.send`` per message, as a ucxx user writes it). Like ``ranks_ucxx``, this
program imports ucxx itself: it is the baseline.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np

from .spec import emit as _emit


def parse(schedule: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in item.split(":")) for item in schedule.split(",")]  # type: ignore[misc]


def schedule_for(sizes: list[int], volume: int, reps: int) -> str:
    """``size:count:reps,...``: ``count`` batches of each size make about ``volume``
    bytes per sample (at least 2, at most 4096 batches)."""
    return ",".join(f"{s}:{max(2, min(4096, volume // s))}:{reps}" for s in sizes)


def emit(impl: str, size: int, samples: list[float]) -> None:
    _emit(impl, "stream", size, 2, samples)


# ------------------------------------------------------------------------ ucxx
async def ucxx_consumer(mode: str, schedule: list[tuple[int, int, int]]) -> None:
    import ucxx

    ucxx.init(progress_mode=mode)
    done = asyncio.get_running_loop().create_future()

    async def handler(ep) -> None:
        ack = np.ones(1, np.uint8)
        for size, count, reps in schedule:
            buf = np.empty(size, np.uint8)
            for _ in range(reps):
                for _ in range(count):
                    await ep.recv(buf)
                await ep.send(ack)
        await ep.recv(ack)  # the producer's goodbye: our last answer arrived
        done.set_result(None)

    lf = ucxx.create_listener(handler)
    print("PORT", lf.port, flush=True)
    await done
    for _ in range(3):  # let the handler return and ucxx retire it (else it warns)
        await asyncio.sleep(0)
    lf.close()


async def ucxx_producer(mode: str, schedule: list[tuple[int, int, int]], port: int) -> None:
    import ucxx

    ucxx.init(progress_mode=mode)
    ep = await ucxx.create_endpoint("127.0.0.1", port)
    ack = np.empty(1, np.uint8)
    for size, count, reps in schedule:
        buf = np.ones(size, np.uint8)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(count):
                await ep.send(buf)
            await ep.recv(ack)
            samples.append(size * count / (time.perf_counter() - t0) / 1e9)
        emit(f"ucxx-{mode}", size, samples)
    await ep.send(ack)
    await ep.close()


# --------------------------------------------------------------------- asyncio
async def asyncio_consumer(schedule: list[tuple[int, int, int]]) -> None:
    done = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for size, count, reps in schedule:
            for _ in range(reps):
                for _ in range(count):
                    await reader.readexactly(size)
                writer.write(b"k")
                await writer.drain()
        writer.close()
        done.set_result(None)

    server = await asyncio.start_server(handler, "127.0.0.1", 0, limit=1 << 26)
    print("PORT", server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await done


async def asyncio_producer(schedule: list[tuple[int, int, int]], port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for size, count, reps in schedule:
        data = bytes(size)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(count):
                writer.write(data)
                await writer.drain()
            await reader.readexactly(1)
            samples.append(size * count / (time.perf_counter() - t0) / 1e9)
        emit("asyncio", size, samples)
    writer.close()


# ------------------------------------------------------------------------ ucxcomm
async def ucxcomm_consumer(schedule: list[tuple[int, int, int]], window: int) -> None:
    import ucxcomm

    done = asyncio.get_running_loop().create_future()

    async def handler(ep: ucxcomm.pipes.Connection) -> None:
        async with ep.stream_reader(window=window) as rx:
            for _size, count, reps in schedule:
                for _ in range(reps):
                    for _ in range(count):
                        (await anext(rx)).release()
                    await ep.send(b"k", tag=1)
        await ep.recv(bytearray(1), tag=2)  # the producer's goodbye
        await ep.close()
        done.set_result(None)

    async with await ucxcomm.pipes.listen(handler) as lst:
        print("PORT", lst.port, flush=True)
        await done


async def ucxcomm_producer(schedule: list[tuple[int, int, int]], port: int) -> None:
    import ucxcomm

    ep = await ucxcomm.pipes.connect("127.0.0.1", port, timeout=60)
    print(f"# ucxcomm lanes: {ep.transport_info()}", file=sys.stderr, flush=True)
    ack = bytearray(1)
    tx = ep.stream_writer()
    for size, count, reps in schedule:
        buf = np.ones(size, np.uint8)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(count):
                await tx.send(buf)
            await ep.recv(ack, tag=1)
            samples.append(size * count / (time.perf_counter() - t0) / 1e9)
        emit("ucxcomm", size, samples)
    await tx.close()
    await ep.send(b"k", tag=2)
    await ep.close()


# ------------------------------------------------------------------------ both sides
def run_pair(impl: str, schedule: str, env: dict, timeout: float, window: int = 8
             ) -> tuple[list[dict], str | None]:
    """Start ``impl``'s consumer, then its producer; the producer's records and an error
    note (None when both finished)."""
    from .launchers import parse_records

    base = [sys.executable, "-m", "ucxcomm.bench.ranks_pipeline"]
    consumer = subprocess.Popen([*base, "consumer", impl, schedule, str(window)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
    try:
        assert consumer.stdout is not None
        line = "-"
        while line and not line.startswith("PORT "):  # (UCX may log to stdout first)
            line = consumer.stdout.readline()
        if not line:
            return [], "the consumer did not start: " + (consumer.stderr.read()
                                                         if consumer.stderr else "")[-300:]
        try:
            prod = subprocess.run([*base, "producer", impl, schedule, line.split()[1]],
                                  env=env, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return [], f"the producer timed out after {timeout:.0f} s"
        recs = parse_records(prod.stdout)
        if prod.returncode != 0:
            return recs, f"producer exit {prod.returncode}: {prod.stderr.strip()[-300:]}"
        consumer.wait(timeout=60)
        return recs, None
    except subprocess.TimeoutExpired:
        return [], "the consumer did not finish"
    finally:
        if consumer.poll() is None:
            consumer.kill()
        consumer.wait()


def main() -> None:
    role, impl, schedule = sys.argv[1], sys.argv[2], parse(sys.argv[3])
    if impl == "ucxcomm":
        window = int(sys.argv[4]) if len(sys.argv) > 4 else 8
        coro = ucxcomm_consumer(schedule, window) if role == "consumer" else \
            ucxcomm_producer(schedule, int(sys.argv[4]))
    elif impl == "asyncio":
        coro = asyncio_consumer(schedule) if role == "consumer" else \
            asyncio_producer(schedule, int(sys.argv[4]))
    elif impl.startswith("ucxx-"):
        mode = impl[5:]
        coro = ucxx_consumer(mode, schedule) if role == "consumer" else \
            ucxx_producer(mode, schedule, int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown implementation {impl}")
    asyncio.run(coro)


if __name__ == "__main__":
    main()
