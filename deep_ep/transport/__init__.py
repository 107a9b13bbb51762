"""Data paths of the Buffer and how one is chosen."""
from __future__ import annotations

import os
import re
import warnings
from typing import Optional

import torch

from ..group import Group, Topology
from ..utils import gpu_uuid, native_peer_atomics_with_all
from .base import Transport
from .reference import ReferenceTransport

TRANSPORTS = ("auto", "reference", "nvlink")
ENV_TRANSPORT = "DEEP_EP_TRANSPORT"
OLDEST_TRITON = (3, 6)   # the oldest Triton the NVLink kernels are tested with


def transport_name(requested: Optional[str]) -> str:
    """The transport asked for by the `transport` argument, else by $DEEP_EP_TRANSPORT, else "auto"."""
    name = requested if requested is not None else os.environ.get(ENV_TRANSPORT, "auto")
    if name not in TRANSPORTS:
        source = "transport" if requested is not None else ENV_TRANSPORT
        raise ValueError(f"{source} must be one of {', '.join(TRANSPORTS)}, got {name!r}")
    return name


def select_transport(name: str, group: Group, topology: Topology, device: torch.device, num_nvl_bytes: int,
                     num_low_latency_bytes: int, timeout_s: float) -> Transport:
    """The transport `name` (from `transport_name`). "auto": the NVLink transport when every rank of the group
    is on one node, on CUDA devices with peer access to each other, with an NVLink buffer
    (`num_nvl_bytes` > 0) or a low-latency area it may use (`num_low_latency_bytes` > 0); else the
    reference transport. The NVLink transport hands the operations it has no buffer for to the reference."""
    if name == "reference":
        return ReferenceTransport(group, topology, device)
    fits = nvlink_fits(group, topology, device, num_nvl_bytes + num_low_latency_bytes)
    if name == "nvlink" and not fits:
        raise ValueError("transport='nvlink' needs every rank on one node, on CUDA devices with peer access "
                         "and native atomics to each other (NVLink), each rank's process seeing every rank's GPU "
                         "(CUDA_VISIBLE_DEVICES), Triton >= 3.6 installed, a PyTorch whose CUDA IPC "
                         "rebuild takes a storage_device argument, and num_nvl_bytes > 0 (or a low-latency buffer)")
    if fits:
        from .nvlink import NVLinkTransport
        return NVLinkTransport(group, topology, device, num_nvl_bytes, num_low_latency_bytes, timeout_s)
    return ReferenceTransport(group, topology, device)


def nvlink_fits(group: Group, topology: Topology, device: torch.device, num_bytes: int) -> bool:
    """Collective: every rank must agree, so the answer is the AND over the group. GPUs are compared by UUID
    (processes may see them under different `CUDA_VISIBLE_DEVICES`); a rank that cannot see a peer's GPU
    cannot enable peer access to it, so its verdict is no."""
    own = _own_gpu(topology, device, num_bytes)
    gpus = group.all_gather_object(own, "NVLink transport check (GPUs)")
    if not all(gpus):   # (every rank sees the same list, so all of them stop here or none)
        return False
    try:
        reachable = native_peer_atomics_with_all(own, gpus)
    except Exception as error:   # (a rank's failure must be a "no" in the exchange, not a missing rank)
        warnings.warn(f"deep_ep: the NVLink transport's peer check failed on this rank ({error}); "
                      f"the group takes the reference transport")
        reachable = False
    return all(group.gather_ints(int(reachable), "NVLink transport check (atomics)"))


def _own_gpu(topology: Topology, device: torch.device, num_bytes: int) -> str:
    """This rank's GPU UUID if it could run the NVLink transport, else ""."""
    if device.type != "cuda" or topology.is_internode or num_bytes <= 0 or not triton_supported():
        return ""
    from .nvlink.peer_memory import ipc_handles_open_on_own_device   # (imports Triton: checked first)
    if not ipc_handles_open_on_own_device():
        return ""
    try:
        return gpu_uuid(device.index)
    except Exception as error:
        warnings.warn(f"deep_ep: cannot read the UUID of {device} ({error}); the group takes the reference "
                      f"transport")
        return ""


def triton_supported(version: Optional[str] = None) -> bool:
    """Whether Triton is installed (or `version` names a release) at least as new as OLDEST_TRITON."""
    if version is None:
        try:
            import triton
        except ImportError:   # (absent, or installed but broken)
            return False
        version = triton.__version__
    numbers = re.match(r"(\d+)\.(\d+)", version)
    return numbers is not None and (int(numbers[1]), int(numbers[2])) >= OLDEST_TRITON


__all__ = ["Transport", "ReferenceTransport", "select_transport", "transport_name", "TRANSPORTS"]
