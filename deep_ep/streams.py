"""Running a transport call on the communication stream with DeepEP's event semantics."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch

from .utils import EventHandle, EventOverlap


def flatten_tensors(values: Iterable[Any]) -> List[torch.Tensor]:
    """Every tensor in (nested tuples, lists and dataclass instances of) `values`."""
    out: List[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out.extend(flatten_tensors(value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.extend(flatten_tensors(getattr(value, field.name) for field in dataclasses.fields(value)))
    return out


class CommStream:
    """The Buffer's dedicated communication stream (None on CPU, where calls complete synchronously)."""

    def __init__(self, device: torch.device) -> None:
        self.stream: Optional[torch.cuda.Stream] = None
        self.device_index = -1
        if device.type == "cuda":
            self.device_index = device.index if device.index is not None else torch.cuda.current_device()
            self.stream = torch.cuda.Stream(device=device, priority=-1)
            # fences reused call after call (a wait takes the event's latest record)
            self._caller_reached = torch.cuda.Event()
            self._call_done = torch.cuda.Event()

    def run(self, fn: Callable[[], Any], inputs: Tuple[Any, ...], previous_event: Optional[EventOverlap],
            async_finish: bool, validate: Optional[Callable[[], None]] = None) -> Tuple[Any, EventOverlap]:
        """Run `fn` on the comm stream after `previous_event` (or the current stream's work so far).

        `validate` checks input values first, on the comm stream once it has waited: inputs produced by an
        earlier asynchronous call are only complete from there.

        Outputs are allocated on the comm stream and marked as used by the calling stream. With
        `async_finish` the caller's stream does not wait and the returned overlap holds the event;
        otherwise the caller's stream waits and the overlap's event is None."""
        if self.stream is None:
            if validate is not None:
                validate()
            result = fn()
            return result, EventOverlap(EventHandle.completed() if async_finish else None)
        # (streams are named by device index: the device-less forms of these calls cost several times more
        # host time, which is most of a short call's)
        compute = torch.cuda.current_stream(self.device_index)
        if previous_event is not None and previous_event.event is not None and not previous_event.event.is_host:
            self.stream.wait_event(previous_event.event.event)
        else:
            self._caller_reached.record(compute)
            self.stream.wait_event(self._caller_reached)
        caller_device = torch.cuda.current_device()
        torch.cuda.set_stream(self.stream)   # (this also makes the Buffer's device current)
        try:
            if validate is not None:
                validate()
            result = fn()
            capturing = torch.cuda.is_current_stream_capturing()
        finally:
            torch.cuda.set_stream(compute)
            if caller_device != self.device_index:
                torch.cuda.set_device(caller_device)
        outputs = flatten_tensors(result if isinstance(result, (tuple, list)) else (result,))
        if not capturing:
            for tensor in outputs:
                if tensor.is_cuda:
                    tensor.record_stream(compute)
        if not async_finish:
            self._call_done.record(self.stream)
            compute.wait_event(self._call_done)
            return result, EventOverlap(None)
        event = EventHandle(self.stream)
        if not capturing:
            for tensor in flatten_tensors(inputs):
                if tensor.is_cuda:
                    tensor.record_stream(self.stream)
        return result, EventOverlap(event, extra_tensors=tuple(flatten_tensors(inputs)) + tuple(outputs))
