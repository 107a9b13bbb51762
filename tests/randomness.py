"""Seeds, per-purpose generators and bitwise views shared by the multi-process tests.

Every run draws a fresh base seed (printed in failure messages); `DEEP_EP_TEST_SEED=<seed>` replays one.
Each rank derives every rank's inputs from the same seed, so an in-process model can see them all."""
from __future__ import annotations

import hashlib
import os
from typing import Any

import torch


def base_seed() -> int:
    env = os.environ.get("DEEP_EP_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(8), "little") >> 1


def generator(seed: int, *keys: Any) -> torch.Generator:
    """A CPU generator determined by the seed and the keys (the same on every rank)."""
    digest = hashlib.sha256(repr((seed,) + keys).encode()).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return gen


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor on the CPU with floating-point values reinterpreted as integers (bitwise comparison)."""
    t = t.detach().cpu().contiguous()
    if t.dtype.is_floating_point:
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t
