"""Kernel launches with less host work than `kernel[grid](...)`.

Triton's launch path binds every argument, works out each one's specialisation, turns them into a cache-key
string, then lets the C launcher call `data_ptr()` and check every tensor's pointer with the driver. For the
transport's kernels (20 to 45 arguments) that is about 40 us of host time per launch on an H200 machine's
host (benchmarks/host_overhead.py --breakdown), more than some of the kernels take on the GPU; this path
takes about 26 us there.

`launch(fn, grid, *args, **kwargs)` does the same launch with less: the compiled kernel is looked up by a
tuple of what Triton specialises on (each CUDA tensor's dtype and 16-byte alignment, each int's value class,
the constexprs with their types, the options), and CUDA tensors go to the launcher as raw pointers (host
tensors, such as pinned status words, as tensors: the launcher translates their addresses). The first
call with a new key goes through Triton's own path, which compiles or finds the kernel and returns it, so
Triton stays the judge of what a specialisation needs; the key here only has to be at least as fine as
Triton's. Arguments of other kinds (tuples, int subclasses, tensor subclasses, ...), launch hooks (set by
profilers), Triton's interpreter and DEEP_EP_FAST_LAUNCH=0 send the call through Triton's path. Like
Triton's own cache, this one assumes the kernels' global constants do not change after their first launch.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import triton

ENABLED = os.environ.get("DEEP_EP_FAST_LAUNCH", "1") != "0" and os.environ.get("TRITON_INTERPRET", "0") == "0"
_PLAIN = (bool, float, type(None))   # runtime arguments keyed by their type alone (as Triton does)


class _Signature:
    """A kernel's parameters: names in order, which are constexpr. Keeps the kernel alive, so that the
    `id` that keys its compiled forms is never reused."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.names = [param.name for param in fn.params]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.constexpr = [param.is_constexpr for param in fn.params]


class Pointer:
    """`Pointer(tensor, dtype)`: a CUDA tensor's memory as a kernel argument of another dtype, without a torch
    view (each view costs a few us of host time). Triton's launch and `launch` take any object with
    `data_ptr()` and `dtype` as a pointer. Holds the tensor, so that a launch deferred in a closure (a
    receive hook) keeps its memory allocated, as a view would."""
    __slots__ = ("address", "dtype", "tensor")

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        self.tensor = tensor
        self.address = tensor.data_ptr()
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


_signatures: Dict[int, Optional[_Signature]] = {}   # id(fn) -> its signature, None for kernels not cached
_compiled: Dict[Tuple, Any] = {}


def _hook_active(hook: Any) -> bool:
    # a hook is None, a function, or (newer Triton) a chain of functions that may be empty
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    runtime = triton.knobs.runtime
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def _signature(fn: Any) -> Optional[_Signature]:
    key = id(fn)
    if key not in _signatures:
        _signatures[key] = _Signature(fn) if hasattr(fn, "params") else None
    return _signatures[key]


def launch(fn: Any, grid: Tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`fn[grid](*args, **kwargs)` on the current stream: `grid` a tuple of 1 to 3 ints; positional arguments
    first, in the kernel's order."""
    signature = _signature(fn) if ENABLED and not _hooks_set() else None
    if signature is None:
        fn[grid](*args, **kwargs)
        return
    values: List[Any] = list(args)
    values.extend([None] * (len(signature.names) - len(args)))
    options = []
    given = len(args)
    for name, value in kwargs.items():
        position = signature.index.get(name)
        if position is None:
            options.append((name, value))
        else:
            values[position] = value
            given += 1
    if given != len(values):   # defaults, or a wrong call: Triton's path fills them in or says what is wrong
        fn[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    key: List[Any] = [id(fn), device, *options]
    append = key.append
    for position, (value, is_constexpr) in enumerate(zip(values, signature.constexpr)):
        kind = value.__class__
        if is_constexpr:
            append((kind, value))
        elif kind is int:
            append(value if -2 < value < 2 else (value & 15 == 0, -2 ** 31 <= value < 2 ** 31, value < 2 ** 63))
        elif kind is torch.Tensor or kind is Pointer:
            pointer = value.data_ptr()
            append(value.dtype)
            append(pointer & 15 == 0)
            if kind is Pointer or value.is_cuda:   # (host memory, e.g. pinned: the launcher translates it)
                values[position] = pointer
        elif kind in _PLAIN:
            append(kind)
        else:   # anything else (tuples, int subclasses, tensor subclasses, ...) is Triton's to specialise
            fn[grid](*args, **kwargs)
            return
    key_tuple = tuple(key)
    try:
        kernel = _compiled.get(key_tuple)
    except TypeError:   # an unhashable constexpr: Triton's path
        fn[grid](*args, **kwargs)
        return
    if kernel is None:
        _compiled[key_tuple] = fn[grid](*args, **kwargs)
        return
    grid = tuple(grid) + (1, 1)
    stream = torch._C._cuda_getCurrentRawStream(device)
    kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *values)
