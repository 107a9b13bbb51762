"""The Buffer's view of its process group: rank, size, node layout and bounded collectives."""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import math
import pickle
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .roll_call import AbsentError, RollCall, default_store


class CommTimeoutError(RuntimeError):
    """A collective or a GPU wait did not complete within the Buffer's timeout (or within the process group's
    own timeout, where that is shorter and ended the wait first)."""


def host_id() -> int:
    """A 63-bit id of this host's name."""
    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class Topology:
    """Where each rank lives: nodes are contiguous blocks of `ranks_per_node` ranks in group order."""
    rank: int
    num_ranks: int
    ranks_per_node: int

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def is_internode(self) -> bool:
        return self.num_nodes > 1


class Group:
    """Bounded collectives over a `torch.distributed` group (or an mpi4py communicator for object gathers).

    Every wait gives up after `timeout_s` seconds with a `CommTimeoutError` that names this rank and the
    operation; the group is then unusable (a half-finished collective leaves peers out of step).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], comm: Any, timeout_s: float,
                 device: Optional[torch.device] = None) -> None:
        if group is None and comm is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self.group, self.comm, self.timeout_s = group, comm, timeout_s
        self.device = device   # the Buffer's: CPU tensors cross an NCCL group through it (if a CUDA device)
        if group is not None:
            self.rank, self.size = group.rank(), group.size()
            backend = str(dist.get_backend(group)).lower()
            self.cuda_native = "nccl" in backend
            self.cpu_native = "gloo" in backend or "mpi" in backend or not self.cuda_native
            # gloo's works honour wait(timeout); others' may not (MPI's ignores it): those are polled instead
            self.timed_cpu_waits = "gloo" in backend
        else:
            self.rank, self.size = comm.Get_rank(), comm.Get_size()
            self.cuda_native, self.cpu_native, self.timed_cpu_waits = False, True, False
        self._broken: Optional[str] = None
        self._tag = 0   # of the last point-to-point exchange
        self.roll_call: Optional[RollCall] = None   # shrink mode (open_roll_call)

    @contextlib.contextmanager
    def awaiting_arrivals(self) -> Iterator[None]:
        """Inside, a wait lasts as long as the process group's own timeout where that is longer than the
        Buffer's: for the first exchange of a Buffer's construction, which ranks may reach minutes apart
        (one loads its weights more slowly; a framework builds its Buffers lazily), as DeepEP's construction
        waits (its exchange is bounded only by the group's timeout). Once every rank has arrived, the
        Buffer's own timeout bounds the waits again."""
        own = self._own_timeout_s()
        saved = self.timeout_s
        self.timeout_s = max(saved, own) if own is not None else saved
        try:
            yield
        finally:
            self.timeout_s = saved

    def _own_timeout_s(self) -> Optional[float]:
        """The process group's own timeout in seconds, where torch tells it (None otherwise)."""
        if self.group is None:
            return None
        try:
            return self.group._get_backend(self._collective_device()).options._timeout.total_seconds()
        except Exception:   # private API: absent in some torch versions and for some backends
            return None

    # ---- object collectives (construction time) -----------------------------------------------------
    def all_gather_object(self, obj: Any, what: str) -> List[Any]:
        """Every rank's picklable object, by rank, within the timeout (through an mpi4py communicator:
        unbounded)."""
        self._check_not_broken()
        if self.group is None:
            return list(self.comm.allgather(obj))
        data = pickle.dumps(obj)
        sizes = self.gather_ints(len(data), f"{what} (sizes)")
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device="cpu")   # not a default device the caller set
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = self.all_gather(padded, what)   # on the CPU, as `padded`
        return [pickle.loads(gathered[rank, :size].numpy().tobytes()) for rank, size in enumerate(sizes)]

    def ranks_per_node_of(self, hosts: List[int]) -> int:
        """Ranks per node from every rank's `host_id()`: one node if all share a host, else equal blocks."""
        per_node = hosts.count(hosts[0])
        blocks = [hosts[i:i + per_node] for i in range(0, self.size, per_node)]
        if self.size % per_node or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
            names = self.all_gather_object(socket.gethostname(), "host name exchange")
            raise ValueError("Buffer: cannot detect the node layout (ranks of a host must form equal contiguous "
                             f"blocks in group order; hosts are {names}); pass num_ranks_per_node explicitly")
        return per_node

    def gather_ints(self, value: int, what: str) -> List[int]:
        """Every rank's int, within the timeout (through an mpi4py communicator: unbounded)."""
        return [row[0] for row in self.gather_int_lists([value], what)]

    def gather_int_lists(self, values: Sequence[int], what: str) -> List[List[int]]:
        """Every rank's list of ints (the same length on every rank), by rank."""
        if self.group is None:
            return [[int(v) for v in row] for row in self.comm.allgather([int(v) for v in values])]
        return self.all_gather(torch.tensor(list(values), dtype=torch.int64, device="cpu"), what).tolist()

    def agree_on(self, values: Dict[str, int], what: str, extra: Sequence[int] = (),
                 shown: Callable[[str, int], Any] = lambda name, value: value) -> List[List[int]]:
        """Every rank's `values` must be the same: a difference raises ValueError on every rank, naming the
        first entry that differs and its values by rank (as `shown(name, value)` gives them). Returns every
        rank's `extra` values (gathered in the same collective), by rank."""
        everyone = self.gather_int_lists([*values.values(), *extra], what)
        for i, name in enumerate(values):
            column = [shown(name, row[i]) for row in everyone]
            if any(value != column[0] for value in column):
                raise ValueError(f"{name} must be the same on every rank of the group, got {column} (by rank)")
        return [row[len(values):] for row in everyone]

    # ---- shrink mode: roll calls through the rendezvous store (roll_call.py) -------------------------------
    def open_roll_call(self, namespace: str) -> None:
        """Let low-latency steps mask ranks that do not arrive (`namespace`: the same on every rank, unique to the
        Buffer). Without a rendezvous store (an mpi4py communicator) waits on a gone rank raise instead."""
        store = default_store() if self.group is not None else None
        if store is not None:
            self.roll_call = RollCall(store, namespace, self.rank, self.timeout_s)

    def mask_absent(self, what: str, mask: torch.Tensor) -> None:
        """Shrink mode, before the exchange of a low-latency step (`what`): wait for the ranks `mask` leaves open;
        those that do not arrive within the timeout are marked in `mask`, the same way on every rank that
        arrives, with a warning."""
        if self.roll_call is not None:
            self._roll_call(what, mask, lambda peers, flags: self.roll_call.step(peers))

    def clean_roll_call(self, mask: torch.Tensor) -> None:
        """Shrink mode, the start of `clean_low_latency_buffer`: mask_absent for the clean, which also brings
        every rank's point-to-point tag to the highest one (a rank may have sat out exchanges while masked)."""
        def attend(peers: List[int], flags: List[int]) -> List[int]:
            absent, self._tag = self.roll_call.clean(peers, [r for r, flag in enumerate(flags) if flag], self._tag)
            return absent
        self._roll_call("clean_low_latency_buffer", mask, attend)

    def _roll_call(self, what: str, mask: torch.Tensor, attend: Callable[[List[int], List[int]], List[int]]) -> None:
        """`attend(peers, mask as a list)` takes the roll call and returns the peers declared absent."""
        self._check_not_broken()
        flags = mask.tolist()
        try:
            absent = attend(_roll_call_peers(flags, self.rank), flags)
        except AbsentError as error:
            self._broken = what
            raise CommTimeoutError(f"rank {self.rank}: {what}: {error}; this Buffer cannot be used any more") from None
        except RuntimeError as error:   # the store's own errors
            self._broken = what
            raise RuntimeError(f"rank {self.rank}: {what}: the rendezvous store failed ({str(error).strip()}); if "
                               "the rank that hosts it is gone, it cannot be masked; this Buffer cannot be used any "
                               "more") from None
        for peer in absent:
            mask[peer] = 1
        for peer in absent:
            warn_caller(f"deep_ep: rank {self.rank} masked rank {peer}, which did not reach {what} within "
                        f"{self.timeout_s:g} s (enable_shrink)")

    def gather_at_destroy(self, mask: torch.Tensor) -> None:
        """Shrink mode's destroy: wait up to the timeout for the ranks `mask` leaves open to reach it too; one
        that does not is only reported (a rank the others masked may wait here for ranks that no longer call)."""
        peers = _roll_call_peers(mask.tolist(), self.rank)
        try:
            missing = self.roll_call.gather("destroy", peers)
        except RuntimeError as error:
            warn_caller(f"deep_ep: rank {self.rank} destroyed its Buffer without waiting for the other ranks: the "
                        f"rendezvous store failed ({str(error).strip()})")
            return
        if missing:
            warn_caller(f"deep_ep: rank {self.rank} destroyed its Buffer without ranks {missing}, which did not "
                        f"reach destroy within {self.timeout_s:g} s (enable_shrink)")

    # ---- tensor collectives ---------------------------------------------------------------------------
    # `ranks`: only these ranks take part, point to point, each passing the same list (low-latency calls skip the
    # ranks a shrink mask marks failed: they may no longer call at all).
    def all_gather(self, tensor: torch.Tensor, what: str, ranks: Optional[Sequence[int]] = None) -> torch.Tensor:
        """All ranks' `tensor` stacked along a new first dim (with `ranks`, zeros for the others)."""
        return self.start_all_gather(tensor, what, ranks).wait()

    def start_all_gather(self, tensor: torch.Tensor, what: str, ranks: Optional[Sequence[int]] = None) -> "Pending":
        """Start `all_gather`; `.wait()` on the result completes it (bounded) and returns what it returns."""
        self._check_usable()
        staged = self._stage(tensor).contiguous()
        if ranks is None:
            flat = staged.new_empty(self.size * staged.numel())
            with self._starting(what):
                if staged.is_cuda:
                    work = _all_gather_single(flat, staged.view(-1), group=self.group, async_op=True)
                else:   # gloo gathers in a ring of R - 1 dependent steps; an all-to-all of R copies is one round
                    work = dist.all_to_all_single(flat, staged.view(-1).repeat(self.size), group=self.group,
                                                  async_op=True)
            return Pending(self, [(work, None)], what, flat,
                           lambda: flat.view(self.size, *staged.shape).to(tensor.device))
        gathered = staged.new_zeros((self.size, *staged.shape))
        gathered[self.rank] = staged
        peers = [r for r in ranks if r != self.rank]
        works = self._point_to_point({r: staged for r in peers}, {r: gathered[r] for r in peers}, what)
        return Pending(self, works, what, gathered, lambda: gathered.to(tensor.device))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Optional[Sequence[int]],
                   input_splits: Optional[Sequence[int]], what: str,
                   ranks: Optional[Sequence[int]] = None) -> "Pending":
        """Start `all_to_all_single` of rows (dim 0; `output` contiguous); `.wait()` on the result completes it
        (bounded) and fills `output`. Rows of dtypes every backend moves natively travel as they are, others as
        bytes, so every dtype moves bit for bit, also those the backend has no type for (gloo: float8, 16- and
        64-bit unsigned, ...). With `ranks`, the splits of the other ranks must be 0."""
        self._check_usable()
        if not output.is_contiguous():
            raise ValueError("all_to_all: output must be contiguous")
        # with `ranks` the blocks of the other ranks are not received: staged with the output's contents
        output_wire = _as_wire(output)
        staged_out = self._stage(output_wire, empty=ranks is None)
        staged_in = self._stage(_as_wire(input.contiguous()))
        filled = (lambda: output) if staged_out is output_wire else (lambda: _filled(output, staged_out))
        if ranks is None:
            with self._starting(what):
                work = dist.all_to_all_single(staged_out, staged_in,
                                              list(output_splits) if output_splits is not None else None,
                                              list(input_splits) if input_splits is not None else None,
                                              group=self.group, async_op=True)
            return Pending(self, [(work, None)], what, staged_out, filled)
        sends, receives = _blocks(staged_in, input_splits, self.size), _blocks(staged_out, output_splits, self.size)
        staged_out_own = receives[self.rank]
        staged_out_own.copy_(sends[self.rank])
        peers = [r for r in ranks if r != self.rank]
        works = self._point_to_point({r: sends[r] for r in peers if sends[r].numel()},
                                     {r: receives[r] for r in peers if receives[r].numel()}, what)
        return Pending(self, works, what, staged_out, filled)

    def barrier(self, what: str, ranks: Optional[Sequence[int]] = None) -> None:
        """Wait for the ranks (`ranks`, default all; through an mpi4py communicator: all of them, unbounded). A
        barrier of the whole group also brings every rank's point-to-point tag to the highest one."""
        self._check_not_broken()
        if self.group is None:
            self.comm.Barrier()
            return
        if ranks is not None:
            self.all_gather(torch.zeros(1, dtype=torch.int32, device=self._collective_device()), what, ranks)
            return
        # a rank that skipped exchanges while others masked it, e.g. their clean, catches up here
        tags = torch.tensor([self._tag], dtype=torch.int64, device=self._collective_device())
        with self._starting(what):
            work = dist.all_reduce(tags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.wait([(work, None)], what, tags)
        self._tag = int(tags.item())

    def _point_to_point(self, sends: Dict[int, torch.Tensor], receives: Dict[int, torch.Tensor], what: str
                        ) -> List[Tuple[dist.Work, List[int]]]:
        """Start sending sends[r] to and receiving receives[r] from group rank r (staged, contiguous tensors),
        as one batch (NCCL runs it as a group: separate blocking sends and receives could wait on each other).
        Every exchange gets the next tag (all ranks make the same calls), so its messages match only each other;
        tags run in [2^30, 2^31), away from small tags a caller might use on the same group. Returns each work
        with the ranks it waits on: one per operation where the backend gives one work per operation (gloo);
        NCCL gives one work for the batch, which waits on all its peers."""
        self._tag = (self._tag + 1) % (1 << 30)
        tag, group = (1 << 30) + self._tag, self.group
        ops = [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, r), group, tag) for r, t in receives.items()]
        ops += [dist.P2POp(dist.isend, t, dist.get_global_rank(group, r), group, tag) for r, t in sends.items()]
        with self._starting(what):
            works = dist.batch_isend_irecv(ops) if ops else []
        peers = [*receives, *sends]
        if len(works) == len(ops):
            return [(work, [peer]) for work, peer in zip(works, peers)]
        return [(work, sorted(set(peers))) for work in works]

    # ---- waiting --------------------------------------------------------------------------------------
    def _starting(self, what: str) -> "_Starting":
        """Around the start of a collective: a backend that refuses to start it (e.g. gloo after a peer's
        timeout closed its connections) leaves the ranks out of step, as a failed wait does."""
        return _Starting(self, what)

    def wait(self, works: Sequence[Tuple[dist.Work, Optional[Sequence[int]]]], what: str,
             result: torch.Tensor) -> None:
        """Complete `works` (each with the ranks it waits on; None: every other rank) within one timeout for
        them all, without blocking where the backend's own wait would not return (a collective that a peer
        never joins). A timeout names the ranks of every work not finished by then."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        for index, (work, _) in enumerate(works):
            try:
                self._complete(work, result.is_cuda, deadline)
            except _Expired:
                self._fail(what, "the collective did not finish", self._unfinished(works, index, result.is_cuda),
                           start)
            except RuntimeError as error:   # the backend's (gloo: "Timed out ...", NCCL's watchdog: "... timeout")
                if any(word in str(error).lower() for word in ("timed out", "timeout")):
                    self._fail(what, str(error), self._unfinished(works, index, result.is_cuda), start)
                raise self._out_of_step_error(what, "failed", error) from error

    def _out_of_step_error(self, what: str, how: str, error: RuntimeError) -> RuntimeError:
        """Marks the group failed by `what` (the ranks may be out of step); the error to raise."""
        self._broken = what
        return RuntimeError(f"rank {self.rank}: {what} {how}: {str(error).strip()}; this Buffer cannot be used "
                            "any more")

    def _complete(self, work: dist.Work, on_gpu: bool, deadline: float) -> None:
        """Wait for `work` until `deadline` (time.monotonic); _Expired if it has not finished by then."""
        if not on_gpu and self.timed_cpu_waits:
            work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            return
        if on_gpu and torch.cuda.is_current_stream_capturing():   # nothing runs until a replay: order only
            work.wait()
            return
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise _Expired()
            time.sleep(0)
        work.wait()  # on the GPU: orders the current stream after the collective

    def _unfinished(self, works: Sequence[Tuple[dist.Work, Optional[Sequence[int]]]], expired: int,
                    on_gpu: bool) -> Optional[List[int]]:
        """The ranks awaited by works[expired] (the one that timed out) and by every later work that has not
        finished either (None: every other rank). A later work is asked through a wait with no time left: gloo's
        point-to-point works report completion only to a wait."""
        peers = set()
        for index in range(expired, len(works)):
            work, awaited = works[index]
            if index > expired:
                try:
                    self._complete(work, on_gpu, time.monotonic())
                    continue
                except (_Expired, RuntimeError):
                    pass
            if awaited is None:
                return None
            peers.update(awaited)
        return sorted(peers)

    def mark_broken(self, what: str) -> None:
        """A wait on the other ranks (`what`) failed outside this group's collectives (e.g. on the GPU): the
        ranks are out of step, as after a failed collective."""
        if self._broken is None:
            self._broken = what

    def _fail(self, what: str, detail: str, peers: Optional[Sequence[int]], start: float) -> None:
        """A wait begun at `start` (time.monotonic) ended: the message gives how long it lasted, which may fall
        short of `timeout_s` (the backend's own, shorter timeout, the process group's, can end it first)."""
        self._broken = what
        waited_s = time.monotonic() - start
        awaited = f"the other {self.size - 1} ranks of the group" if peers is None else \
            f"rank{'s' if len(peers) > 1 else ''} {', '.join(str(r) for r in peers)}"
        raise CommTimeoutError(f"rank {self.rank}: {what} did not complete in {waited_s:.1f} s (timeout "
                               f"{self.timeout_s:g} s; waiting for {awaited}: {detail.strip()}); "
                               "this Buffer cannot be used any more")

    @property
    def broken(self) -> bool:
        """An earlier collective failed (timed out): the ranks are out of step."""
        return self._broken is not None

    def _check_not_broken(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"rank {self.rank}: an earlier collective ({self._broken}) failed; destroy this "
                               "Buffer and create a new one (after a timeout, over a new process group: the "
                               "backend may have closed this one's connections)")

    def _check_usable(self) -> None:
        self._check_not_broken()
        if self.group is None:
            raise NotImplementedError("tensor collectives need a torch.distributed group; an mpi4py 'comm' "
                                      "only serves construction with a fast transport")

    def _collective_device(self) -> torch.device:
        if self.cpu_native:
            return torch.device("cpu")
        if self.device is not None and self.device.type == "cuda":
            return self.device
        return torch.device("cuda", torch.cuda.current_device())

    def _stage(self, tensor: torch.Tensor, empty: bool = False) -> torch.Tensor:
        """The tensor where the backend can move it: CUDA tensors go through host memory on a gloo group,
        CPU tensors through the GPU on an NCCL group."""
        native = self.cuda_native if tensor.is_cuda else self.cpu_native
        if native:
            return tensor
        device = self._collective_device()
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=device) if empty else tensor.to(device)


def rows_as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's rows (dim 0) as a [rows, bytes per row] uint8 view (through the flat view: a
    contiguous tensor may have any stride on a dimension of size 1)."""
    if rows.dim() == 2 and rows.stride(-1) == 1:   # (the common cases in one or two views)
        return rows if rows.dtype == torch.uint8 else rows.view(torch.uint8)
    if rows.dim() == 1 and rows.stride(0) == 1:
        return rows.view(torch.uint8).view(rows.shape[0], rows.element_size())
    flat = rows.reshape(-1)
    if flat.stride(0) != 1:   # (one element with another stride)
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).view(rows.shape[0], rows.element_size() * math.prod(rows.shape[1:]))


# `all_gather_into_tensor` was renamed `all_gather_single` in newer torch releases.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class _Expired(Exception):
    """A polled work did not finish by its deadline."""


def _roll_call_peers(mask: List[int], rank: int) -> List[int]:
    """The ranks a roll call waits for: those the mask leaves open; none if it masks this rank itself (the
    others have it masked too: it takes part in nothing, like a rank that masks every other)."""
    if mask[rank]:
        return []
    return [r for r, masked in enumerate(mask) if not masked and r != rank]


def warn_caller(message: str) -> None:
    """A RuntimeWarning attributed to the first caller outside this package."""
    package = __name__.rsplit(".", 1)[0]
    frame, level = sys._getframe(1), 2   # stacklevel 2: the function that called this one
    while frame is not None and frame.f_globals.get("__name__", "").startswith(package + "."):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)


def unmasked_ranks(mask: Optional[torch.Tensor], rank: int) -> Optional[List[int]]:
    """The ranks a low-latency step exchanges with under a shrink mask (nonzero: failed): `rank` itself and
    every unmasked rank; None (the whole group) without a mask or with none masked."""
    if mask is None:
        return None
    flags = mask.tolist()
    if not any(flags):
        return None
    return [r for r, masked in enumerate(flags) if r == rank or not masked]


def _blocks(rows: torch.Tensor, splits: Optional[Sequence[int]], size: int) -> List[torch.Tensor]:
    """The row blocks of `rows` by rank (equal blocks without splits)."""
    if splits is None:
        splits = [rows.shape[0] // size] * size
    return list(torch.split(rows, list(splits)))


def _filled(output: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    """`output` with the rows received into `staged` (staged on another device: the backend's)."""
    _as_wire(output).copy_(staged)
    return output


# dtypes that gloo and NCCL both move as they are (a byte view of rows costs gloo more than the rows: ~8% for
# 1 MB on two threads)
_NATIVE_WIRE_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                                 torch.int32, torch.int64})


def _as_wire(rows: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's rows as an exchange moves them: as they are where every backend has their dtype,
    else as bytes (`rows_as_bytes`)."""
    return rows if rows.dtype in _NATIVE_WIRE_DTYPES else rows_as_bytes(rows)


class _Starting:
    """`Group._starting`'s context (a class: a generator-based one costs several microseconds a call)."""
    __slots__ = ("group", "what")

    def __init__(self, group: Group, what: str) -> None:
        self.group, self.what = group, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is not None and issubclass(kind, RuntimeError):
            raise self.group._out_of_step_error(self.what, "failed to start", error) from error
        return False


class Pending:
    """A collective in flight; `wait()` completes it within the group's timeout and returns its result."""

    def __init__(self, group: Group, works: List[Tuple[dist.Work, Optional[List[int]]]], what: str,
                 staged: torch.Tensor, finish: Callable[[], torch.Tensor]) -> None:
        self.group, self.works, self.what, self.staged, self.finish = group, works, what, staged, finish
        self.result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        """The result, once every part of the collective has completed (one deadline for all of them; each
        work with the ranks it waits on, None: every other rank)."""
        if self.result is None:
            self.group._check_not_broken()   # after a failed wait: at once, not after another timeout
            self.group.wait(self.works, self.what, self.staged)
            self.result = self.finish()
        return self.result
