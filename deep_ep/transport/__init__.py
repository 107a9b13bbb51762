"""Data paths of the Buffer and how one is chosen."""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..group import Group, Topology
from .base import Transport
from .reference import ReferenceTransport

TRANSPORTS = ("auto", "reference")
ENV_TRANSPORT = "DEEP_EP_TRANSPORT"


def transport_name(requested: Optional[str]) -> str:
    """The transport asked for by the `transport` argument, else by $DEEP_EP_TRANSPORT, else "auto"."""
    name = requested if requested is not None else os.environ.get(ENV_TRANSPORT, "auto")
    if name not in TRANSPORTS:
        source = "transport" if requested is not None else ENV_TRANSPORT
        raise ValueError(f"{source} must be one of {', '.join(TRANSPORTS)}, got {name!r}")
    return name


def select_transport(name: str, group: Group, topology: Topology, device: torch.device) -> Transport:
    """The transport `name` (from `transport_name`); "auto" picks the fastest that fits.

    Only the reference transport exists so far, so "auto" resolves to it everywhere."""
    return ReferenceTransport(group, topology, device)


__all__ = ["Transport", "ReferenceTransport", "select_transport", "transport_name", "TRANSPORTS"]
