"""A pool of rank processes for multi-process tests.

`pool(world_size)` (a pytest fixture factory in conftest.py) starts `world_size` processes once per
session; `pool.run(fn, *args)` calls `fn(ctx, *args)` on every rank and returns the per-rank results.
`fn` must be importable (module-level). If any rank fails, the failure is raised in the test and
the pool is restarted, so a broken group never leaks into the next test (`pool.run_then_restart` restarts it
after a run that passes too, for tests that leave the group out of step on purpose).

Also: `run_on_another_thread` (a call on a fresh thread, as serving engines make hooks) and `run_script` (a
Python script in a fresh process that imports the tests' modules and this checkout's package).

Device: CPU + gloo by default. With `DEEP_EP_TEST_DEVICE=cuda`, ranks use GPUs (rank % num_gpus):
an NCCL group when every rank has its own GPU, else a gloo group with CUDA tensors.
"""
from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional

import torch
import torch.multiprocessing as mp

from deep_ep.transport import OLDEST_TRITON

TEST_TIMEOUT_S = float(os.environ.get("DEEP_EP_TEST_TIMEOUT_S", "240"))
STOP_GRACE_S = 10.0   # how long ranks asked to stop may take to leave before they are killed
SUPPORTED_TRITON = ".".join(map(str, OLDEST_TRITON))   # the oldest Triton the NVLink kernels run with


@dataclass
class RankContext:
    rank: int
    world_size: int
    group: Any
    device: torch.device


def run_on_another_thread(fn: Callable[[], Any]) -> Any:
    """`fn()` called on a new thread (whose current CUDA device is the first: it has not set one); re-raises
    what it raised."""
    returned: List[Any] = []
    raised: List[BaseException] = []

    def target() -> None:
        try:
            returned.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            raised.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if raised:
        raise raised[0]
    return returned[0]


def outcome(call: Callable[[], Any], expected: type) -> str:
    """What `call()` came to, as a string a rank can return: "no error", or "<expected's name>: <message>" if it
    raised `expected` (any other exception propagates)."""
    try:
        call()
    except expected as error:
        return f"{expected.__name__}: {error}"
    return "no error"


def run_script(script: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Run `script` with this Python, the tests' folder and the checkout on its path and `env` added to the
    environment; its output is captured as text."""
    tests = Path(__file__).resolve().parent
    path = os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(script)], env=dict(os.environ, PYTHONPATH=path, **env),
                          capture_output=True, text=True, timeout=timeout)


def test_device_kind() -> str:
    return os.environ.get("DEEP_EP_TEST_DEVICE", "cpu")


def release(version: str) -> tuple:
    """(major, minor) of a version string such as torch's "2.13.0+cpu" or Triton's "3.6.0"."""
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


@contextlib.contextmanager
def deterministic_algorithms(fill: bool) -> Iterator[None]:
    """torch's deterministic algorithms on, with new tensors filled (NaN, the largest integer) or not; the
    previous settings after."""
    import torch.utils.deterministic as deterministic
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    deterministic.fill_uninitialized_memory = fill
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        deterministic.fill_uninitialized_memory = before[2]


def run_deterministic(ctx: RankContext, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(ctx, *args)` with torch's deterministic algorithms on and new tensors filled: an op without a
    deterministic kernel raises, and a kernel that reads memory nobody wrote gets values that show.
    (Frameworks turn this mode on for reproducible training.) Torch 2.4 cannot fill a new FP8 tensor (it
    raises, in its own casts too), so there new tensors are left as they come."""
    with deterministic_algorithms(fill=release(torch.__version__) >= (2, 5)):
        return fn(ctx, *args)


def run_under_defaults(ctx: RankContext, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(ctx, *args)` with every call into a Buffer (its methods and the receive hooks they return) made
    under a default device and dtype that the library must not depend on: `torch.device("meta")` and
    bfloat16. Clients set defaults like these (DeepEP's own test scripts set the default device to CUDA and
    the default dtype to bfloat16; model code is often built under `with torch.device(...)`): a tensor the
    library creates without naming its device or its float dtype then breaks the call or changes its result."""
    import functools
    import deep_ep

    def under_defaults(method):
        @functools.wraps(method)
        def call(*call_args, **call_kwargs):
            before = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device("meta"):
                    result = method(*call_args, **call_kwargs)
            finally:
                torch.set_default_dtype(before)
            if isinstance(result, tuple) and result and callable(result[-1]) and method.__name__.startswith("low_"):
                result = (*result[:-1], under_defaults(result[-1]))   # (the receive hook)
            return result
        return call

    def wrapped(value):
        if isinstance(value, (staticmethod, classmethod)):
            return type(value)(under_defaults(value.__func__))
        return under_defaults(value)

    methods = {name: wrapped(value) for name, value in vars(deep_ep.Buffer).items()
               if (callable(value) or isinstance(value, (staticmethod, classmethod)))
               and (not name.startswith("_") or name == "__init__")}
    patched = type("BufferUnderDefaults", (deep_ep.Buffer,), methods)
    original = deep_ep.Buffer
    deep_ep.Buffer = patched
    try:
        return fn(ctx, *args)
    finally:
        deep_ep.Buffer = original


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, inbox, outbox) -> None:
    import datetime

    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("DEEP_EP_TIMEOUT_S", "60")
    torch.set_num_threads(1)
    kind = test_device_kind()
    if kind == "cuda":
        num_gpus = torch.cuda.device_count()
        torch.cuda.set_device(rank % num_gpus)
        device = torch.device("cuda", rank % num_gpus)
        backend = "nccl" if world_size <= num_gpus else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    kwargs = dict(device_id=device) if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120), **kwargs)
    ctx = RankContext(rank, world_size, dist.group.WORLD, device)
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs_ = job
        try:
            answer = (rank, True, fn(ctx, *args, **kwargs_))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            answer = (rank, False, traceback.format_exc())
        if device.type == "cuda":
            # pools of other sizes stay alive beside this one: an idle rank must not keep what its last test cached
            torch.cuda.empty_cache()
        outbox.put(answer)
    dist.destroy_process_group()


class RankPool:
    """`world_size` persistent rank processes."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, self.world_size, port, self.inboxes[r], self.outbox),
                                  daemon=True) for r in range(self.world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> List[Any]:
        """Run `fn(ctx, *args, **kwargs)` on every rank; return the results in rank order."""
        for inbox in self.inboxes:
            inbox.put((fn, args, kwargs))
        results: List[Any] = [None] * self.world_size
        failures = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.outbox.get(timeout=timeout or TEST_TIMEOUT_S)
            except queue.Empty:
                self.restart()
                raise TimeoutError(f"{fn.__name__}: ranks did not answer within {timeout or TEST_TIMEOUT_S} s")
            if ok:
                results[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            self.restart()
            raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(failures))
        return results

    def run_then_restart(self, fn: Callable, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> List[Any]:
        """`run`, then fresh ranks whatever happened: for a test that leaves the group out of step (a timeout
        with a peer that never came, a collective left unmatched)."""
        try:
            return self.run(fn, *args, timeout=timeout, **kwargs)
        finally:
            self.restart()

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True) -> None:
        _stop([self], graceful)


_pools: dict = {}


def get_pool(world_size: int) -> RankPool:
    if world_size not in _pools:
        _pools[world_size] = RankPool(world_size)
    return _pools[world_size]


def close_pools() -> None:
    pools = list(_pools.values())
    _pools.clear()
    _stop(pools)


def _stop(pools: List[RankPool], graceful: bool = True) -> None:
    """Stop the pools' ranks: gracefully, all asked at once (their teardowns overlap) and given STOP_GRACE_S
    together; whatever is still running then is killed."""
    procs = [p for pool in pools for p in pool.procs]
    if graceful:
        for pool in pools:
            for inbox in pool.inboxes:
                inbox.put(None)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
