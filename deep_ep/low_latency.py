"""Bookkeeping of low-latency calls: the two buffer halves and their pending receive hooks."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, List, Optional

import torch


class ReceiveHook:
    """Completes a low-latency call when invoked; may run on any thread, exactly once. It runs in the inference
    mode of the call that made it (a call under `torch.inference_mode()` allocated inference tensors, which the
    receive then fills in place, also from a thread or a later point outside that mode)."""

    def __init__(self, receive: Callable[[], None], name: str, check: Optional[Callable[[], None]] = None) -> None:
        self._receive: Optional[Callable[[], None]] = receive
        self._check = check   # may refuse a call (kept callable)
        self._name = name
        self.output: Optional[object] = None   # what the receive fills in (a dispatch's src_info), if set
        self._lock = threading.Lock()
        self._started = False
        self._done = False
        self._stale: Optional[str] = None   # what discarded it
        self._inference_mode = torch.is_inference_mode_enabled()

    @property
    def pending(self) -> bool:
        """True until the receive has finished (a hook still running holds its buffer half)."""
        return not self._done and self._stale is None

    @property
    def running(self) -> bool:
        """Called and not yet returned (on another thread)."""
        return self._started and not self._done

    @staticmethod
    def discard_all(hooks: List["ReceiveHook"], by: str) -> None:
        """The buffer was cleaned or destroyed (`by`): calling these hooks afterwards is an error. Refused,
        discarding none, while one of them runs (none can start while they are looked at)."""
        with contextlib.ExitStack() as locked:
            for hook in hooks:
                locked.enter_context(hook._lock)
            running = [hook for hook in hooks if hook.running]
            if running:
                raise RuntimeError(f"{by}: {running[0].describe()} first")
            for hook in hooks:
                hook._stale = by
                hook._release()

    def describe(self) -> str:
        state = "is still running (on another thread); wait for it to return" if self.running else \
            "has not been called; call it"
        return f"the receive hook of {self._name} {state}"

    def __call__(self) -> None:
        check = self._check   # read once: another thread may release it
        if check is not None:
            check()
        with self._lock:
            if self._stale is not None:
                raise RuntimeError(f"the receive hook of {self._name} was discarded by {self._stale}")
            if self._started:
                raise RuntimeError(f"the receive hook of {self._name} was already called; call each hook once")
            self._started = True
        try:
            if torch.is_inference_mode_enabled() == self._inference_mode:
                self._receive()
            else:   # the receive itself turns grad mode off, which leaving inference mode turns on
                with torch.inference_mode(self._inference_mode):
                    self._receive()
        finally:
            self._done = True
            self._release()

    def _release(self) -> None:
        """Drop the closures once they cannot run any more: the Buffer holds this hook until its buffer half is
        reused, and the closures hold the call's tensors and the transport (the closures never refer to the
        Buffer itself, so that a Buffer dropped with hooks never called goes at once)."""
        self._receive = self._check = None


class LowLatencySlots:
    """Each low-latency call takes the next of two buffer halves. A half is reusable once the hook of the
    call that last used it has finished: a third call while the call two before still waits for its hook
    would overwrite that call's data, so it is refused."""

    def __init__(self) -> None:
        self.next_half = 0
        self._pending: List[Optional[ReceiveHook]] = [None, None]
        self._lock = threading.Lock()

    def check_next(self, name: str) -> None:
        """Raise if the next call may not start yet (the call two before still waits for its hook)."""
        with self._lock:
            self._check_next(name)

    def _check_next(self, name: str) -> None:
        waiting = self._pending[self.next_half]
        if waiting is not None and waiting.pending:
            raise RuntimeError(f"{name}: at most two low-latency results may be pending, and {waiting.describe()} "
                               "first (or, on every rank, clean_low_latency_buffer() to discard it)")

    def next_free(self, name: str) -> int:
        """The half the next call uses (raises if it may not start yet); `take` it once the call has sent."""
        with self._lock:
            self._check_next(name)
            return self.next_half

    def take(self, half: int) -> None:
        """A call has started on `half` (from `next_free`): the next call uses the other half."""
        with self._lock:
            assert half == self.next_half, "low-latency calls of one Buffer were made on two threads at once"
            self._pending[half] = None
            self.next_half ^= 1

    def hold(self, half: int, hook: ReceiveHook) -> None:
        with self._lock:
            self._pending[half] = hook

    def receiving(self, output: object) -> Optional[ReceiveHook]:
        """The hook, not yet finished, that fills in `output` (compared by identity), if any."""
        with self._lock:
            return next((hook for hook in self._pending
                         if hook is not None and hook.pending and hook.output is output), None)

    def reset(self, by: str) -> None:
        """Back to the first half; hooks not yet run are discarded (by `by`). Refused, discarding nothing, while a
        hook runs."""
        with self._lock:
            ReceiveHook.discard_all([hook for hook in self._pending if hook is not None], by)
            self.next_half = 0
            self._pending = [None, None]
