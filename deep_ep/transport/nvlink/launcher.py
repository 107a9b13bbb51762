"""Kernel launches with less host work than `kernel[grid](...)`.

Triton's launch path binds every argument, works out each one's specialisation, turns them into a cache-key
string, then lets the C launcher call `data_ptr()` and check every tensor's pointer with the driver. For the
transport's kernels (20 to 45 arguments) that is about 40 us of host time per launch on an H200 machine's
host (benchmarks/host_overhead.py --breakdown), more than some of the kernels take on the GPU; this path
takes about 26 us there.

`launch(fn, grid, *args, **kwargs)` does the same launch with less: the compiled kernel is looked up by a
tuple of what Triton specialises on (each tensor's dtype and 16-byte alignment, each int's value class, the
constexprs, the options), and tensors go to the launcher as raw pointers. The first call with a new key goes
through Triton's own path, which compiles or finds the kernel and returns it, so Triton stays the judge of
what a specialisation needs; the key here only has to be at least as fine as Triton's. Launch hooks (set by
profilers) and DEEP_EP_FAST_LAUNCH=0 send every call through Triton's path.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import torch
import triton

ENABLED = os.environ.get("DEEP_EP_FAST_LAUNCH", "1") != "0"


class _Signature:
    """A kernel's parameters: names in order, which are constexpr."""

    def __init__(self, fn: Any) -> None:
        self.names = [param.name for param in fn.params]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.constexpr = [param.is_constexpr for param in fn.params]


class Pointer:
    """`Pointer(tensor, dtype)`: the tensor's memory as a kernel argument of another dtype, without a torch view (each view costs a few
    us of host time). Triton's launch and `launch` take any object with `data_ptr()` and `dtype` as a
    pointer. Like any argument, the tensor must stay allocated until the kernel has run."""
    __slots__ = ("address", "dtype")

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        self.address = tensor.data_ptr()
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


_signatures: Dict[Any, _Signature] = {}
_compiled: Dict[Tuple, Any] = {}


def _hook_active(hook: Any) -> bool:
    # a hook is None, a function, or (newer Triton) a chain of functions that may be empty
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    runtime = triton.knobs.runtime
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def launch(fn: Any, grid: Tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`fn[grid](*args, **kwargs)` on the current stream; positional arguments first, in the kernel's order."""
    if not ENABLED or _hooks_set():
        fn[grid](*args, **kwargs)
        return
    signature = _signatures.get(id(fn))
    if signature is None:
        signature = _signatures[id(fn)] = _Signature(fn)
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
        if is_constexpr:
            append(value)
        elif value.__class__ is int:
            append(value if -2 < value < 2 else (value & 15 == 0, -2 ** 31 <= value < 2 ** 31, value < 2 ** 63))
        elif isinstance(value, torch.Tensor) or value.__class__ is Pointer:
            pointer = value.data_ptr()
            append(value.dtype)
            append(pointer & 15 == 0)
            values[position] = pointer
        else:   # bool, float, None
            append(value if value is None else value.__class__)
    key_tuple = tuple(key)
    kernel = _compiled.get(key_tuple)
    if kernel is None:
        _compiled[key_tuple] = fn[grid](*args, **kwargs)
        return
    grid = tuple(grid) + (1, 1)
    stream = torch._C._cuda_getCurrentRawStream(device)
    kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *values)
