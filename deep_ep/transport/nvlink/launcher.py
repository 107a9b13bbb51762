"""Kernel launches with less host work than `kernel[grid](...)`.

Triton's launch path binds every argument, works out each one's specialisation, turns them into a cache-key
string, then lets the C launcher call `data_ptr()` and check every tensor's pointer with the driver. For the
transport's kernels (20 to 45 arguments) that costs more host time per launch than some of the kernels take
on the GPU (benchmarks/host_overhead.py --breakdown; figures in benchmarks/RESULTS.md).

`launch(fn, grid, *args, **kwargs)` does the same launch with less: the compiled kernel is looked up by a
tuple of what Triton specialises on (each CUDA tensor's dtype and 16-byte alignment, each int's value class,
the constexprs with their types, the options), and CUDA tensors go to the launcher as raw pointers (host
tensors, such as pinned status words, as tensors: the launcher translates their addresses). The first
call with a new key goes through Triton's own path, which compiles or finds the kernel and returns it, so
Triton stays the judge of what a specialisation needs; the key here only has to be at least as fine as
Triton's. Arguments of other kinds (tuples, int subclasses, tensor subclasses, ...), launch hooks (set by
profilers) and Triton's interpreter send the call through Triton's path. Like
Triton's own cache, this one assumes the kernels' global constants do not change after their first launch.
A cached kernel is launched through Triton's C launch function itself where the compiled kernel's Python wrapper
(`run`) would only forward to it (`_direct`; tests/test_nvlink_launch.py checks the arguments against the
installed Triton's wrapper).

`Relaunch` goes further for launches repeated with the same shapes: the caller names the arguments that
change from call to call, and a repeat looks only at those; everything else (the rest of the key, the
packing of the fixed arguments, the caller's own preparation of them) is done once.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import triton

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")   # (as Triton reads it)
ENABLED = not INTERPRETED   # (tests turn the fast path off to compare it with Triton's)
_PLAIN = (bool, float, type(None))   # runtime arguments keyed by their type alone (as Triton does)


def next_pow2(value: int) -> int:
    """The smallest power of two >= `value` (1 for values below 2): a block size for `value` elements."""
    return 1 << max(value - 1, 0).bit_length()


def profiler_name(*scopes: str):
    """`triton.jit`'s `repr` for a kernel that profilers should show as the C++ function `scopes[0]::...()`:
    the kernel is named by its Itanium mangling, which they demangle (DeepEP's timing finds a receive hook's
    two phases by `::dispatch` / `::combine` in those names)."""
    symbol = "_ZN" + "".join(f"{len(scope)}{scope}" for scope in scopes) + "Ev"
    return lambda _specialization: symbol


def current_raw_stream(device: torch.device) -> int:
    """The raw handle of `device`'s current stream (0 for CPU memory: the interpreted tests)."""
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0


def launch_options() -> Optional[frozenset]:
    """The launch options this Triton's CUDA backend takes (None where it cannot be asked)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return None
    return frozenset(getattr(CUDAOptions, "__dataclass_fields__", ()))


class _Signature:
    """A kernel's parameters: names in order, which are constexpr. Keeps the kernel alive, so that the
    `id` that keys its compiled forms is never reused."""

    def __init__(self, fn: Any, names: Optional[List[str]] = None, constexpr: Optional[List[bool]] = None) -> None:
        self.fn = fn
        self.names = [param.name for param in fn.params] if names is None else names
        self.index = {name: i for i, name in enumerate(self.names)}
        self.constexpr = [param.is_constexpr for param in fn.params] if constexpr is None else constexpr

    @classmethod
    def of_names(cls, fn: Any) -> "_Signature":
        """The parameter names of a kernel without `params` (constexprs not known)."""
        names = getattr(fn, "arg_names", None)
        if names is None:
            raise TypeError(f"Relaunch needs a Triton kernel, got {fn!r}")
        return cls(fn, list(names), [False] * len(names))


class Pointer:
    """`Pointer(tensor, dtype, offset=0)`: a CUDA tensor's memory from `offset` bytes in, as a kernel argument
    of another dtype, without a torch view (each view or slice costs a few us of host time). Triton's launch
    and `launch` take any object with `data_ptr()` and `dtype` as a pointer. Holds the tensor, so that a
    launch deferred in a closure (a receive hook) keeps its memory allocated, as a view would."""
    __slots__ = ("address", "dtype", "tensor")

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype, offset: int = 0) -> None:
        self.tensor = tensor
        self.address = tensor.data_ptr() + offset
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address

    def as_tensor(self) -> torch.Tensor:
        """The memory from the address to the end of the tensor's storage, as a flat tensor of `dtype`."""
        storage = self.tensor.untyped_storage()
        size = self.dtype.itemsize
        start = self.address - storage.data_ptr()
        return torch.empty(0, dtype=self.dtype, device=self.tensor.device).set_(
            storage, start // size, ((storage.nbytes() - start) // size,))


# Triton's launcher wrappers (`compiled_kernel.run`, a CudaLauncher) whose Python `__call__` only forwards to its
# C `launch` when the kernel needs no scratch memory, by their parameters: (head of the C call between the stream
# and the kernel's arguments, as a function of the launcher and the kernel; whether those arguments go as one tuple)
_FORWARDING_WRAPPERS = {
    ("self", "gridX", "gridY", "gridZ", "stream", "function"):   # Triton 3.6
        (lambda run, kernel: (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                              kernel.packed_metadata, None, None, None), False),
    ("self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
     "launch_enter_hook", "launch_exit_hook"):   # Triton 3.7 to 3.9
        (lambda run, kernel: (kernel.function, run.launch_cooperative_grid, run.launch_pdl, kernel.packed_metadata,
                              None, None, None, None, None, run.arg_annotations, run.kernel_signature), True),
}


_KNOWN_WRAPPERS = ((3, 6), (3, 9))   # the Triton releases whose wrappers _FORWARDING_WRAPPERS describes


def _release(version: str) -> Tuple[int, ...]:
    """(major, minor) of a Triton version string; (0,) where it does not parse."""
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return (0,)


def _direct(kernel: Any) -> Tuple[Any, Tuple[Any, ...], bool, Any]:
    """How to launch a compiled kernel: (function, head, as_tuple, kernel), called as `function(grid_x, grid_y,
    grid_z, stream, *head, *args)`, or with `args` as one tuple after the head where `as_tuple`; the kernel is
    held so that its module stays loaded. That is Triton's C launch itself where its Python wrapper is of a
    form that only forwards to it (_FORWARDING_WRAPPERS, in the releases known: no scratch memory, no
    sanitizer), else `kernel.run` with no launch hooks."""
    run = kernel.run
    call = getattr(type(run), "__call__", None)
    code = getattr(call, "__code__", None)
    known = _KNOWN_WRAPPERS[0] <= _release(triton.__version__) <= _KNOWN_WRAPPERS[1]
    form = None if code is None or not known else _FORWARDING_WRAPPERS.get(code.co_varnames[:code.co_argcount])
    if (form is not None and callable(getattr(run, "launch", None)) and not getattr(run, "gsan_enabled", False)
            and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0):
        try:
            return run.launch, form[0](run, kernel), form[1], kernel
        except AttributeError:   # a wrapper of that form without the attributes it passes on
            pass
    return run, (kernel.function, kernel.packed_metadata, None, None, None), False, kernel


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


def _int_spec(value: int) -> Any:
    """What Triton specialises an int argument on: -1, 0 and 1 by value, others by divisibility by 16 and
    width."""
    return value if -2 < value < 2 else (value & 15 == 0, -2 ** 31 <= value < 2 ** 31, value < 2 ** 63)


def _bind(signature: _Signature, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
    """(every parameter's value in order, {option: value}); a parameter without a value holds _MISSING."""
    values: List[Any] = list(args)
    values.extend([_MISSING] * (len(signature.names) - len(args)))
    options = {}
    for name, value in kwargs.items():
        position = signature.index.get(name)
        if position is None:
            options[name] = value
        else:
            values[position] = value
    return values, options


_MISSING = object()   # a parameter's place in _bind's values until it gets one


def launch(fn: Any, grid: Tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`fn[grid](*args, **kwargs)` on the current stream: `grid` a tuple of 1 to 3 ints; positional arguments
    first, in the kernel's order."""
    _launch(fn, grid, args, kwargs)


def _launch(fn: Any, grid: Tuple[int, ...], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """`launch`; returns how to launch the compiled kernel (`_direct`) when the call went by the cache's key
    (None when it went through Triton's path for another reason: hooks, arguments the key does not cover, ...)."""
    signature = _signature(fn) if ENABLED and not _hooks_set() else None
    values, options = _bind(signature, args, kwargs) if signature is not None else ((), {})
    if signature is None or any(value is _MISSING for value in values):
        if INTERPRETED:   # (Triton's interpreter takes tensors, not raw pointers)
            args = tuple(a.as_tensor() if isinstance(a, Pointer) else a for a in args)
            kwargs = {k: v.as_tensor() if isinstance(v, Pointer) else v for k, v in kwargs.items()}
        _through_triton(fn, grid, args, kwargs)   # (missing values: Triton fills in defaults or says what is wrong)
        return None
    device = torch._C._cuda_getDevice()   # (torch.cuda.current_device() without its wrapper)
    key: List[Any] = [id(fn), device, *options.items()]
    append = key.append
    for position, (value, is_constexpr) in enumerate(zip(values, signature.constexpr)):
        kind = value.__class__
        if is_constexpr:
            append((kind, value))
        elif kind is int:
            append(_int_spec(value))
        elif kind is torch.Tensor or kind is Pointer:
            pointer = value.data_ptr()
            append(value.dtype)
            append(pointer & 15 == 0)
            if kind is Pointer or value.is_cuda:   # (host memory, e.g. pinned: the launcher translates it)
                values[position] = pointer
        elif kind in _PLAIN:
            append(kind)
        else:   # anything else (tuples, int subclasses, tensor subclasses, ...) is Triton's to specialise
            _through_triton(fn, grid, args, kwargs)
            return None
    key_tuple = tuple(key)
    try:
        direct = _compiled.get(key_tuple)
    except TypeError:   # an unhashable constexpr: Triton's path
        _through_triton(fn, grid, args, kwargs)
        return None
    if direct is None:
        direct = _compiled[key_tuple] = _direct(_through_triton(fn, grid, args, kwargs))
        return direct
    _run_direct(direct, tuple(grid) + (1, 1), device, values)
    return direct


def _run_direct(direct: Tuple[Any, Tuple[Any, ...], bool, Any], grid: Tuple[int, ...], device: int,
                values: List[Any]) -> None:
    """Launch on the current stream of `device` as `_direct` says, `grid` padded to 3 entries at least."""
    function, head, as_tuple, _ = direct
    stream = torch._C._cuda_getCurrentRawStream(device)
    if as_tuple:
        function(grid[0], grid[1], grid[2], stream, *head, tuple(values))
    else:
        function(grid[0], grid[1], grid[2], stream, *head, *values)


def _through_triton(fn: Any, grid: Tuple[int, ...], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """`fn[grid](*args, **kwargs)`: Triton's own launch, which compiles the kernel on its first use. A failure
    other than arguments that do not bind is raised again naming the kernel, Triton's version and the
    transport that needs no kernels (a Triton version can fail to compile a kernel that others compile)."""
    try:
        return fn[grid](*args, **kwargs)
    except TypeError:   # (Triton's message says which argument)
        raise
    except Exception as error:
        detail = (str(error).strip().splitlines() or [""])[0]
        raise RuntimeError(f"deep_ep: Triton {triton.__version__} could not compile or launch the NVLink transport's "
                           f"kernel {_name(fn)} ({type(error).__name__}: {detail}); transport='reference' (or "
                           "DEEP_EP_TRANSPORT=reference) runs without these kernels") from error


class Relaunch:
    """A launch prepared once and repeated with new values for a few arguments.

    `Relaunch(fn, grid, vary, *args, **kwargs)` takes the arguments of `launch` and the names of the
    parameters that change from call to call (their values in `args` / `kwargs` are ignored; leave them out
    or pass anything); `relaunch(*values, grid=None)` launches with those parameters set to `values`, in
    `vary`'s order (and on another grid, if given).
    A repeat looks only at the changed values: their specialisation (each pointer's dtype and 16-byte
    alignment, each int's class) picks one of the compiled kernels this relaunch has used, and the other
    arguments are already packed. A specialisation not seen yet, launch hooks, and values the cache does
    not cover go through `launch`. The fixed arguments stay referenced as long as the relaunch lives."""

    __slots__ = ("fn", "grid", "values", "options", "positions", "packed", "kernels")

    def __init__(self, fn: Any, grid: Tuple[int, ...], vary: Tuple[str, ...], *args: Any, **kwargs: Any) -> None:
        self.fn, self.grid = fn, tuple(grid) + (1, 1)
        # (Triton's interpreter gives kernels without `params`: their relaunches always take `launch`'s path,
        # which hands them to Triton)
        signature = _signature(fn) or _Signature.of_names(fn)
        _check_names(fn, signature, vary, kwargs)
        varied = [signature.index[name] for name in vary]
        if any(signature.constexpr[position] for position in varied):
            raise TypeError(f"Relaunch of {_name(fn)}: constexprs are fixed (vary: {vary})")
        values, self.options = _bind(signature, args, kwargs)
        for position in varied:   # (never keep a per-call tensor alive)
            values[position] = _MISSING
        missing = [name for name, value in zip(signature.names, values) if value is _MISSING and name not in vary]
        if missing:
            raise TypeError(f"Relaunch of {_name(fn)}: no value for {missing}")
        self.values = values
        self.packed = [_packed(value) for value in values]   # as the compiled kernel's launcher takes them
        self.positions = varied
        self.kernels: Dict[Tuple, Any] = {}   # (device, specialisation of the varied values) -> `_direct` of its kernel

    def __call__(self, *changed: Any, grid: Optional[Tuple[int, ...]] = None) -> None:
        grid = self.grid if grid is None else tuple(grid) + (1, 1)
        if not ENABLED:
            return self._launch(grid, changed, None)
        packed = self.packed.copy()
        device = torch._C._cuda_getDevice()
        spec: List[Any] = [device]
        append = spec.append
        for position, value in zip(self.positions, changed):
            kind = value.__class__
            if kind is int:
                append(_int_spec(value))
                packed[position] = value
                continue
            if kind is Pointer:
                pointer = value.address   # (the attribute: a method call costs more)
            elif kind is torch.Tensor and value.is_cuda:
                pointer = value.data_ptr()
            else:
                return self._launch(grid, changed, None)
            append(value.dtype)
            append(pointer & 15 == 0)
            packed[position] = pointer
        key = tuple(spec)
        direct = self.kernels.get(key)
        if direct is None or _hooks_set():
            return self._launch(grid, changed, key)
        _run_direct(direct, grid, device, packed)

    def _launch(self, grid: Tuple[int, ...], changed: Tuple[Any, ...], key: Optional[Tuple]) -> None:
        values = list(self.values)
        for position, value in zip(self.positions, changed):
            values[position] = value
        direct = _launch(self.fn, grid[:3], tuple(values), self.options)
        if direct is not None and key is not None:
            self.kernels[key] = direct


def _check_names(fn: Any, signature: _Signature, vary: Tuple[str, ...], kwargs: Dict[str, Any]) -> None:
    """TypeError unless every name in `vary` is a parameter of `fn`, appearing once, and every keyword is a
    parameter or a launch option of this Triton."""
    unknown = [name for name in vary if name not in signature.index]
    repeated = sorted({name for name in vary if vary.count(name) > 1})
    options = launch_options()
    if options is not None:
        unknown += [name for name in kwargs if name not in signature.index and name not in options]
    if unknown or repeated:
        raise TypeError(f"Relaunch of {_name(fn)}: {', '.join(unknown)} not among its parameters "
                        f"({', '.join(signature.names)}) or launch options" if unknown else
                        f"Relaunch of {_name(fn)}: {', '.join(repeated)} named more than once in vary")


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def _packed(value: Any) -> Any:
    """A fixed argument as the compiled kernel's launcher takes it (CUDA memory as its address)."""
    kind = value.__class__
    if kind is Pointer or (kind is torch.Tensor and value.is_cuda):
        return value.data_ptr()
    return value
