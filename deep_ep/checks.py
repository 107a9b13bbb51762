"""Argument checks that name the argument and the expected value, and the message for ranks that disagree."""
from __future__ import annotations

import functools
import os
import zlib
from typing import Optional, Sequence, Tuple, Union

import torch

Dtypes = Union[torch.dtype, Tuple[torch.dtype, ...]]


def check_tensor(name: str, value, *, device: torch.device, dtype: Optional[Dtypes] = None,
                 dim: Optional[int] = None, shape: Optional[Sequence[Optional[int]]] = None,
                 contiguous: bool = True) -> torch.Tensor:
    """Raise TypeError/ValueError unless `value` is a tensor as described (None in `shape` = any size)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    # each test starts with the comparison that holds for valid arguments: these checks run on every call
    if dtype is not None and value.dtype != dtype and not (isinstance(dtype, tuple) and value.dtype in dtype):
        expected = " or ".join(str(d) for d in dtype) if isinstance(dtype, tuple) else str(dtype)
        raise TypeError(f"{name} must have dtype {expected}, got {value.dtype}")
    if value.device != device and not same_device(value.device, device):
        raise ValueError(f"{name} must be on {device} (the Buffer's device), got {value.device}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(value.shape)}")
    if shape is not None and value.shape != shape and (
            value.dim() != len(shape) or any(want is not None and got != want for got, want in zip(value.shape, shape))):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {expected}, got {list(value.shape)}")
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return value


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.type != "cuda" or (a.index if a.index is not None else torch.cuda.current_device()) == \
        (b.index if b.index is not None else torch.cuda.current_device())


def check_int(name: str, value, *, minimum: Optional[int] = None, maximum: Optional[int] = None,
              multiple_of: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    if multiple_of is not None and value % multiple_of:
        raise ValueError(f"{name} must be a multiple of {multiple_of}, got {value}")
    return value


def int_setting(variable: str, default: int, *, minimum: int, maximum: int) -> int:
    """The integer environment setting `variable` (`default` where unset); ValueError naming it otherwise."""
    text = os.environ.get(variable)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{variable} must be an integer, got {text!r}") from None
    if not minimum <= value <= maximum:
        raise ValueError(f"{variable} must be in [{minimum}, {maximum}], got {value}")
    return value


def flag_setting(variable: str, default: Optional[bool]) -> Optional[bool]:
    """The on/off environment setting `variable`: 1 on, 0 off, `default` where unset; ValueError naming it
    otherwise (so that `false` or `off` cannot silently mean on)."""
    text = os.environ.get(variable)
    if text is None:
        return default
    if text.strip() not in ("0", "1"):
        raise ValueError(f"{variable} must be 0 (off) or 1 (on), got {text!r}")
    return text.strip() == "1"


def check_expert_ids(name: str, topk_idx: torch.Tensor, num_experts: int) -> None:
    """Entries must be -1 (no selection) or in [0, num_experts)."""
    if topk_idx.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(topk_idx))
    if low < -1 or high >= num_experts:
        bad = low if low < -1 else high
        raise ValueError(f"{name} entries must be -1 or in [0, {num_experts}), found {bad}")


def too_many_rows_message(rank: int, local_expert: int, how: str) -> str:
    """The error for a low-latency dispatch that sent one local expert more rows than its receive buffer has
    (num_ranks * num_max_dispatch_tokens_per_rank): only tokens that list an expert several times can."""
    return (f"topk_idx of a low-latency dispatch: rank {rank}'s local expert {local_expert} was sent more rows than "
            "num_ranks * num_max_dispatch_tokens_per_rank; a row of topk_idx lists that expert several times (each "
            f"copy is a row), too often for its receive buffer ({how})")


@functools.lru_cache(maxsize=None)
def dtype_code(dtype: torch.dtype) -> int:
    """A number for every dtype, the same in every process (for exchanges of call descriptions)."""
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


_DTYPE_NAMES = {dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}


def disagreement(op: str, names: Sequence[str], mine: Sequence[int], theirs: Sequence[int], rank: int,
                 other: int) -> Optional[str]:
    """The error message for the first field of `names` whose value on rank `other` (`theirs`) differs from
    this rank's (`mine`), or None when all agree. Fields whose name ends in "dtype" hold `dtype_code`s."""
    for name, a, b in zip(names, mine, theirs):
        if a != b:
            shown = (lambda v: _DTYPE_NAMES.get(v, v)) if name.endswith("dtype") else (lambda v: v)
            return (f"{op}: {name} is {shown(a)} on rank {rank} but {shown(b)} on rank {other}; every rank must "
                    "pass the same value")
    return None
