"""Events for overlapping communication with computation, as in DeepEP's `deep_ep.utils`."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist


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
        self.event.record(stream if stream is not None else torch.cuda.current_stream())

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
    """Check that PCIe-attached GPUs of `group` have pairwise NVLink (DeepEP's rule: at most 2 such ranks)."""
    if not torch.cuda.is_available():
        return
    if "PCIE" not in torch.cuda.get_device_name().upper():
        return
    if group.size() > 2:
        raise RuntimeError(f"check_nvlink_connections: PCIe GPUs only have pairwise NVLink connections, "
                           f"but the group has {group.size()} ranks (expected <= 2)")
    devices = [None] * group.size()
    dist.all_gather_object(devices, torch.cuda.current_device(), group=group)
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                raise RuntimeError(f"check_nvlink_connections: GPU {a} cannot access GPU {b} as a peer")
