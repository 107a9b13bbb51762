"""Running a transport call on the communication stream with DeepEP's event semantics.

Note [outputs on the caller's stream]: outputs allocated on the comm stream must be marked as used by the
caller's stream (`record_stream`), and the caching allocator then records an event at every free and queries it
at later allocations, a real part of a short call's host time. An output allocated on the caller's stream needs
no mark when the comm stream's work is ordered after everything queued on the caller's stream so far (it waited
for it) and the caller's stream waits for the call: a freed output's memory is then reused on the caller's
stream only, after the call's kernels. That holds for a synchronous call without `previous_event`, with
PyTorch's native caching allocator (under cudaMallocAsync an allocation is itself work ordered on its stream)
and while torch does not fill new memory (`fills_new_memory`). See also docs/DESIGN.md, "Streams".

Note [synchronous calls on the caller's stream]: a synchronous call that runs after the caller's work (no
`previous_event`), made while the Buffer's device is current and outside a CUDA-graph capture, runs on the
caller's stream itself. Nothing can tell that from DeepEP's run on the comm stream followed by the caller's stream
waiting for it, and it saves the events, stream switches and `record_stream` marks, most of a short call's
stream handling. Allocations, torch's fills of new memory and frees are then all on the stream the kernels run on.
The Buffer's calls still follow one another as on one stream: a call on another stream than the previous call's
waits for it first (for the comm stream: its queued work; for a caller's stream: an event recorded there at the
end of that call, so caller work queued after it is not waited for, as with DeepEP). Once the comm stream has
been handed out (`Buffer.get_comm_stream`), where a caller may order work after it, every call runs there.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable, Iterable, List, Optional, Tuple, TypeVar

import torch
import torch.utils.deterministic

from .utils import EventHandle, EventOverlap, event_method


def flatten_tensors(values: Iterable[Any]) -> List[torch.Tensor]:
    """Every tensor in (nested tuples, lists and dataclass instances of) `values`."""
    out: List[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out.extend(flatten_tensors(value))
        elif value is not None and not isinstance(value, (int, float, bool, str)):
            names = _field_names(value.__class__)
            if names:
                out.extend(flatten_tensors(getattr(value, name) for name in names))
    return out


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> Tuple[str, ...]:
    """The fields of a dataclass (empty for other classes)."""
    return tuple(field.name for field in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()


_record = event_method("record")
_wait = event_method("wait")


class _OutputStreams(threading.local):
    """(caller's stream ids, comm stream ids) while CommStream.run runs a call whose outputs may be allocated on
    the caller's stream (allocate_outputs), else None."""
    streams: Optional[Tuple[Tuple[int, int, int], Tuple[int, int, int]]] = None


_output_streams = _OutputStreams()
T = TypeVar("T")


def allocate_outputs(make: Callable[[], T]) -> T:
    """`make()`, which allocates a call's output tensors and queues nothing on the GPU (no fill: work queued
    there would not be ordered with the call's kernels): on the caller's stream where CommStream.run allows it
    (Note [outputs on the caller's stream]), as DeepEP allocates; else on the current stream."""
    streams = _output_streams.streams
    if streams is None:
        return make()
    torch._C._cuda_setStream(*streams[0])
    try:
        return make()
    finally:
        torch._C._cuda_setStream(*streams[1])


def fills_new_memory() -> bool:
    """Whether torch fills every new tensor (deterministic algorithms with `fill_uninitialized_memory`, its
    default there): the fill is a kernel that the allocation itself queues on the current stream."""
    return torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory


def without_autograd(fn: Callable[[], Any]) -> Any:
    """`fn()` with grad mode off, so that its outputs carry no autograd history, as DeepEP's (inputs that
    require grad, e.g. top-k weights, would otherwise give some outputs a grad_fn on the transports that
    compute with torch). Costs nothing where grad mode is off already, and less host time than a
    `torch.no_grad()` block elsewhere."""
    if not torch.is_grad_enabled():
        return fn()
    torch._C._set_grad_enabled(False)
    try:
        return fn()
    finally:
        torch._C._set_grad_enabled(True)


def capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` (a CUDA device) is capturing a CUDA graph."""
    if device.type != "cuda":
        return False
    if device.index is None or device.index == torch._C._cuda_getDevice():
        return torch._C._cuda_isCurrentStreamCapturing()
    with torch.cuda.device(device):
        return torch._C._cuda_isCurrentStreamCapturing()


def _after_caller(previous_event: Optional[EventOverlap]) -> bool:
    """Whether a call runs after the caller's stream's work so far (no `previous_event` holding a CUDA event)."""
    return previous_event is None or previous_event.event is None or previous_event.event.is_host


def stream_of(ids: Tuple[int, int, int]) -> "torch.cuda.Stream":
    """A Stream object for a stream's id triple (stream_id, device_index, device_type)."""
    return torch.cuda.Stream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])


class CommStream:
    """The Buffer's dedicated communication stream (None on CPU, where calls complete synchronously)."""

    def __init__(self, device: torch.device) -> None:
        self.stream: Optional[torch.cuda.Stream] = None
        self.device_index = -1
        if device.type == "cuda":
            self.device_index = device.index if device.index is not None else torch.cuda.current_device()
            self.stream = torch.cuda.Stream(device=device, priority=-1)
            self.stream_ids = (self.stream.stream_id, self.stream.device_index, self.stream.device_type)
            # fences reused call after call (a wait takes the event's latest record)
            self._caller_reached = torch.cuda.Event()
            self._call_done = torch.cuda.Event()
            self._caller: Tuple[Any, Optional[torch.cuda.Stream]] = (None, None)   # (stream id, Stream)
            self._native_allocator = torch.cuda.get_allocator_backend() == "native"
            # Note [synchronous calls on the caller's stream]: the caller's stream (ids) the last call ran on
            # (None: the comm stream or nothing yet), and an event recorded there at the end of each such call
            self._last_on_caller: Optional[Tuple[int, int, int]] = None
            self._caller_done = torch.cuda.Event()
            self.exposed = False   # the comm stream was handed out (get_comm_stream): calls stay on it

    def caller(self) -> Tuple[Tuple[int, int, int], torch.cuda.Stream]:
        """The caller's stream on the Buffer's device: (its id triple, a Stream object for it)."""
        ids = torch._C._cuda_getCurrentStream(self.device_index)
        known, stream = self._caller
        if ids != known:
            stream = stream_of(ids)
            self._caller = (ids, stream)
        return ids, stream

    def run(self, fn: Callable[[], Any], inputs: Tuple[Any, ...], previous_event: Optional[EventOverlap],
            async_finish: bool, validate: Optional[Callable[[], None]] = None) -> Tuple[Any, EventOverlap]:
        """Run `fn` on the comm stream after `previous_event` (or the current stream's work so far).

        Args:
            fn: the call; it runs without autograd (`without_autograd`).
            inputs: the call's tensors (nested), kept alive and marked for the comm stream by an asynchronous call.
            previous_event, async_finish: as in `Buffer.dispatch`.
            validate: checks input values first, on the comm stream once it has waited: inputs produced by an
                earlier asynchronous call are only complete from there.

        Returns `(fn's result, EventOverlap)`: with `async_finish` the caller's stream does not wait and the
        overlap holds the event; otherwise the caller's stream waits (also when `fn` raises) and its event is None.
        A synchronous call after the caller's work runs on the caller's stream, outputs and all, outside a capture
        (Note [synchronous calls on the caller's stream]). Otherwise outputs are allocated on the comm stream and
        marked as used by the calling stream (also inside a CUDA-graph capture, where the allocator then keeps a
        freed output's memory out of the rest of the capture), except those `fn` allocates through
        `allocate_outputs` (Note [outputs on the caller's stream])."""
        return without_autograd(lambda: self._run(fn, inputs, previous_event, async_finish, validate))

    def runs_on_caller(self, previous_event: Optional[EventOverlap], async_finish: bool) -> bool:
        """Whether a call with these arguments runs on the caller's stream instead of the comm stream (Note
        [synchronous calls on the caller's stream])."""
        return (self.stream is not None and not async_finish and not self.exposed and _after_caller(previous_event)
                and torch._C._cuda_getDevice() == self.device_index and not torch._C._cuda_isCurrentStreamCapturing())

    def _run(self, fn: Callable[[], Any], inputs: Tuple[Any, ...], previous_event: Optional[EventOverlap],
             async_finish: bool, validate: Optional[Callable[[], None]]) -> Tuple[Any, EventOverlap]:
        if self.stream is None:
            if validate is not None:
                validate()
            result = fn()
            return result, EventOverlap(EventHandle.completed() if async_finish else None)
        compute_id, compute = self.caller()
        if self.runs_on_caller(previous_event, async_finish):
            return self._run_on_caller(fn, compute_id, compute, validate)
        after_caller = _after_caller(previous_event)
        if after_caller:
            _record(self._caller_reached, compute)
            _wait(self._caller_reached, self.stream)
        else:
            _wait(previous_event.event.event, self.stream)
        last = self._last_on_caller
        if last is not None:
            # (a wait for the caller's stream covers it; a capture orders its own work, and an eager call before
            # it is complete: torch.cuda.graph synchronises first, and a capture cannot wait for outside work)
            if (not after_caller or last != compute_id) and not torch._C._cuda_isCurrentStreamCapturing():
                _wait(self._caller_done, self.stream)
            self._last_on_caller = None
        caller_device = torch._C._cuda_getDevice()
        torch._C._cuda_setStream(*self.stream_ids)   # this also makes the Buffer's device current
        # Note [outputs on the caller's stream]
        outputs_on_caller = after_caller and not async_finish and self._native_allocator and not fills_new_memory()
        if outputs_on_caller:
            _output_streams.streams = (compute_id, self.stream_ids)
        try:
            if validate is not None:
                validate()
            result = fn()
        except BaseException:
            # the failed call's kernels may still read its inputs and write outputs it dropped (on the caller's
            # stream, or freed to the caller's stream by their marks)
            if not async_finish:
                self._caller_waits(compute)
            raise
        finally:
            _output_streams.streams = None
            torch._C._cuda_setStream(*compute_id)
            if caller_device != self.device_index:
                torch._C._cuda_setDevice(caller_device)
        outputs = flatten_tensors(result if isinstance(result, (tuple, list)) else (result,))
        for tensor in outputs:
            if tensor.is_cuda:
                tensor.record_stream(compute)
        if not async_finish:
            self._caller_waits(compute)
            return result, EventOverlap(None)
        event = EventHandle(self.stream)
        held = flatten_tensors(inputs)
        for tensor in held:
            if tensor.is_cuda:
                tensor.record_stream(self.stream)
        held.extend(outputs)
        return result, EventOverlap(event, extra_tensors=tuple(held))

    def _run_on_caller(self, fn: Callable[[], Any], compute_id: Tuple[int, int, int], compute: torch.cuda.Stream,
                       validate: Optional[Callable[[], None]]) -> Tuple[Any, EventOverlap]:
        """A synchronous call after the caller's work, run on the caller's stream."""
        last = self._last_on_caller
        if last is None:   # the comm stream may hold earlier asynchronous calls
            _record(self._call_done, self.stream)
            _wait(self._call_done, compute)
        elif last != compute_id:
            _wait(self._caller_done, compute)
        self._last_on_caller = compute_id
        try:
            if validate is not None:
                validate()
            return fn(), EventOverlap(None)
        finally:   # the end of this call, for a later call on another stream (also after a failure)
            _record(self._caller_done, compute)

    def _caller_waits(self, compute: torch.cuda.Stream) -> None:
        """The caller's stream waits for everything queued on the comm stream so far."""
        _record(self._call_done, self.stream)
        _wait(self._call_done, compute)
