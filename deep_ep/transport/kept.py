"""What a transport keeps with a handle (its routing, plans, the order of its rows): stored on one of the
handle's tensors as an attribute, so it lives and dies with the handle at no host cost per call (a registry keyed
by the tensor's id needs a finalizer per handle to forget it, a few microseconds a call). Entries are kept per
owner (a token of the transport that stored them, not the transport itself, which must not outlive its Buffer
through a handle), so a handle of another Buffer is not taken for one of this Buffer's, and a handle used with
several Buffers keeps an entry for each."""
from __future__ import annotations

from typing import Any, Optional

import torch

_ATTRIBUTE = "_deep_ep_kept"


class Keeper:
    """Keeps values with tensors for one transport."""

    __slots__ = ("_token",)

    def __init__(self) -> None:
        self._token = object()

    def keep(self, tensor: torch.Tensor, value: Any) -> None:
        entries = getattr(tensor, _ATTRIBUTE, None)
        if entries is None:
            setattr(tensor, _ATTRIBUTE, {self._token: value})
        else:
            entries[self._token] = value

    def get(self, tensor: torch.Tensor) -> Optional[Any]:
        """The value this keeper stored with `tensor`, or None."""
        entries = getattr(tensor, _ATTRIBUTE, None)
        return None if entries is None else entries.get(self._token)
