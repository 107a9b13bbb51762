"""Bookkeeping of low-latency calls: the two buffer halves and their pending receive hooks."""
from __future__ import annotations

import threading
from typing import Callable, List, Optional


class ReceiveHook:
    """Completes a low-latency call when invoked; may run on any thread, exactly once."""

    def __init__(self, receive: Callable[[], None], on_done: Callable[[], None], name: str) -> None:
        self._receive, self._on_done, self._name = receive, on_done, name
        self._lock = threading.Lock()
        self._ran = False

    @property
    def ran(self) -> bool:
        return self._ran

    def __call__(self) -> None:
        with self._lock:
            if self._ran:
                raise RuntimeError(f"the receive hook of {self._name} was already called; call each hook once")
            self._ran = True
        try:
            self._receive()
        finally:
            self._on_done()


class LowLatencySlots:
    """Each low-latency call takes the next of two buffer halves. A half is reusable once the hook of the
    call that last used it has run: a third call while the call two before still waits for its hook
    would overwrite that call's data, so it is refused."""

    def __init__(self) -> None:
        self.next_half = 0
        self._pending: List[Optional[ReceiveHook]] = [None, None]
        self._lock = threading.Lock()

    def acquire(self, name: str) -> int:
        with self._lock:
            half = self.next_half
            waiting = self._pending[half]
            if waiting is not None and not waiting.ran:
                raise RuntimeError(f"{name}: the low-latency call two calls ago still has an un-run receive hook; "
                                   "at most two low-latency results may be pending: call its hook first")
            self._pending[half] = None
            self.next_half ^= 1
            return half

    def hold(self, half: int, hook: ReceiveHook) -> None:
        with self._lock:
            self._pending[half] = hook

    def any_pending(self) -> bool:
        with self._lock:
            return any(h is not None and not h.ran for h in self._pending)

    def reset(self) -> None:
        with self._lock:
            self.next_half = 0
            self._pending = [None, None]
