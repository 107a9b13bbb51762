"""Events for overlapping communication with computation, as in DeepEP's `deep_ep.utils`."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


def event_method(name: str) -> Any:
    """The C function behind torch.cuda.Event.`name`, called as (event, stream), without the host time of its
    Python wrapper. Builds without it (CPU-only builds define the class empty) get the wrapper, which takes the
    same arguments."""
    return getattr(getattr(torch._C, "_CudaEventBase", None), name, None) or getattr(torch.cuda.Event, name)


_record_event = event_method("record")


class EventHandle:
    """A point in a stream's work.

    `EventHandle()` records a CUDA event on the current stream when CUDA is available. Without CUDA there
    are no streams: every operation of this library has finished when its call returns, so a CPU handle
    marks an already-completed point and waiting on it does nothing.
    """

    def __init__(self, stream: Optional["torch.cuda.Stream"] = None, *, host: bool = False) -> None:
        self.event: Optional[torch.cuda.Event] = None
        if host or (stream is None and not torch.cuda.is_available()):
            return
        self.event = torch.cuda.Event()
        _record_event(self.event, stream if stream is not None else torch.cuda.current_stream())

    @classmethod
    def completed(cls) -> "EventHandle":
        """A host-side handle that is complete from the start (used for CPU tensors)."""
        return cls(host=True)

    @property
    def is_host(self) -> bool:
        return self.event is None

    def current_stream_wait(self) -> None:
        """Make the current stream wait for this point (GPU-side; the host never blocks)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def query(self) -> bool:
        """True when the work before this point has finished."""
        return True if self.event is None else self.event.query()


class EventOverlap:
    """An optional event plus tensors kept alive until the event has been waited on.

    Args:
        event: the `EventHandle` of an asynchronous operation, or None for a synchronous one.
        extra_tensors: tensors referenced until this object dies (a CUDA-graph-safe substitute for
            `Tensor.record_stream`).

    Use `current_stream_wait()` or `with overlap:` (the current stream waits at exit) before consuming
    the outputs of an `async_finish=True` call.
    """

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event. Raises AssertionError when there is none."""
        assert self.event is not None, "EventOverlap.current_stream_wait: this overlap has no event (the call was synchronous)"
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


def check_nvlink_connections(group: dist.ProcessGroup) -> None:
    """DeepEP's check for PCIe GPUs, for callers that run it themselves (the `Buffer` does not: its transport
    choice tests every pair of GPUs for the peer atomics its NVLink kernels need, and a group without them is
    served by the reference transport).

    Acts only when the current GPU's name contains "PCIe": the group must have at most 2 ranks, and every pair
    of its GPUs (identified by UUID, so ranks that see the GPUs under different `CUDA_VISIBLE_DEVICES` are
    compared by their physical GPU) must be connected by NVLink, tested as native peer atomics (which PCIe
    peer access lacks). Raises AssertionError naming what failed.
    """
    if not torch.cuda.is_available() or "PCIE" not in torch.cuda.get_device_name().upper():
        return
    if group.size() > 2:
        raise AssertionError(f"check_nvlink_connections: PCIe GPUs only have pairwise NVLink connections, "
                             f"but the group has {group.size()} ranks (expected <= 2)")
    uuids: List[Optional[str]] = [None] * group.size()
    dist.all_gather_object(uuids, gpu_uuid(torch.cuda.current_device()), group=group)
    visible = visible_gpus()
    for rank, uuid in enumerate(uuids):
        if uuid not in visible:
            raise AssertionError(f"check_nvlink_connections: the GPU of rank {rank} ({uuid}) is not visible to this "
                                 f"process (CUDA_VISIBLE_DEVICES), so its NVLink connection cannot be checked")
    for a in set(uuids):
        for b in set(uuids):
            if a != b and not native_peer_atomics(visible[a], visible[b]):
                raise AssertionError(f"check_nvlink_connections: GPUs {a} and {b} are not connected by NVLink "
                                     f"(no native peer atomics between them)")


def gpu_uuid(index: int) -> str:
    """The UUID of the visible CUDA device `index` (the same GPU has the same UUID in every process)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpus() -> Dict[str, int]:
    """The index in this process of every GPU it sees, by UUID."""
    return {gpu_uuid(index): index for index in range(torch.cuda.device_count())}


def native_peer_atomics_with_all(own: str, gpus: List[str]) -> bool:
    """Whether the GPU with UUID `own` and each GPU of `gpus` (UUIDs; `own` may be among them) are visible to
    this process and have native peer atomics both ways. No when two visible GPUs report one UUID (distinct
    GPUs would pass for one shared GPU)."""
    visible = visible_gpus()
    if len(visible) != torch.cuda.device_count() or own not in visible or any(gpu not in visible for gpu in gpus):
        return False
    return all(native_peer_atomics(visible[own], visible[gpu]) and native_peer_atomics(visible[gpu], visible[own])
               for gpu in set(gpus))


def native_peer_atomics(a: int, b: int) -> bool:
    """Whether kernels on visible GPU `a` may store into GPU `b`'s memory and poll counters there with
    system-scope atomics: peer access, and atomics the link carries natively (NVLink does; many PCIe set-ups
    do not). Needs the `cuda-bindings` package (False without it)."""
    if a == b:
        return True
    if not torch.cuda.can_device_access_peer(a, b):
        return False
    try:
        from cuda.bindings import runtime
    except ImportError:
        return False
    error, native = runtime.cudaDeviceGetP2PAttribute(runtime.cudaDeviceP2PAttr.cudaDevP2PAttrNativeAtomicSupported,
                                                      a, b)
    return error == runtime.cudaError_t.cudaSuccess and native == 1
