"""DeepEP V1's expert-parallel communication API in pure Python.

`from deep_ep import Buffer, Config, EventOverlap, EventHandle` works as with DeepEP."""
from .buffer import Buffer
from .config import Config, topk_idx_t
from .group import CommTimeoutError
from .utils import EventHandle, EventOverlap

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t", "CommTimeoutError"]
