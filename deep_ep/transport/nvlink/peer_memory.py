"""Peer-mapped buffers: every rank's NVLink buffer opened in every other rank of the node (CUDA IPC).

Each rank allocates one ordinary CUDA tensor, shares it as a CUDA IPC handle through the Buffer's own
group (gloo, NCCL or mixed; several ranks per GPU work), and opens its peers' handles. The device table
`bases[r]` holds the address of rank r's buffer as mapped in this process, for kernels that store into
peers. What a buffer holds is its user's: header.py for the normal mode, low_latency.py for the low-latency
area.
"""
from __future__ import annotations

import inspect
from typing import List

import torch
from torch.multiprocessing import reductions

from ...group import Group
from ...utils import gpu_uuid, visible_gpus


class PeerBuffers:
    def __init__(self, local: torch.Tensor, group: Group) -> None:
        if not local.is_cuda:
            raise ValueError("the NVLink transport needs the Buffer's device to be a CUDA device")
        # one share per peer: PyTorch gives each share a cross-process counter that its one consumer
        # releases, and keeps the memory (reporting it at exit) while a counter is held. A single share opened
        # by every peer would be released too often with 3+ ranks and never with one.
        shares = [None if rank == group.rank else reductions.reduce_tensor(local) for rank in range(group.size)]
        shared = group.all_gather_object((gpu_uuid(local.device.index), shares), "CUDA IPC handle exchange")
        reach_peers(local.device.index, [gpu for gpu, _ in shared], group.rank)
        self.local = local
        self.peers: List[torch.Tensor] = []
        for rank, (_, their_shares) in enumerate(shared):
            if rank == group.rank:
                self.peers.append(local)
            else:
                rebuild, args = their_shares[group.rank]
                self.peers.append(_open_on(local.device.index, rebuild, args))
        self.bases = torch.tensor([t.data_ptr() for t in self.peers], dtype=torch.int64, device=local.device)

    def close(self) -> None:
        self.peers = [self.local]


def reach_peers(own_device: int, gpus: List[str], rank: int) -> None:
    """Let kernels on this rank's GPU (`own_device`) reach every rank's GPU (`gpus`: UUIDs by rank), each
    found by UUID among the GPUs this process sees."""
    visible = visible_gpus()
    for peer, gpu in enumerate(gpus):
        if gpu not in visible:   # (the transport choice rules this out; a clear error if it changed since)
            raise RuntimeError(f"the NVLink transport: the GPU of rank {peer} ({gpu}) is not visible to rank "
                               f"{rank} (CUDA_VISIBLE_DEVICES), so its buffer cannot be reached")
        _enable_peer_access(own_device, visible[gpu])


def _open_on(device_index: int, rebuild, args) -> torch.Tensor:
    """Open a peer's IPC handle in this rank's own device context (PyTorch would open it on the owner's
    device, where this rank's kernels cannot reach it)."""
    args = list(args)
    args[storage_device_position(rebuild)] = device_index
    return rebuild(*args)


def ipc_handles_open_on_own_device() -> bool:
    """Whether this PyTorch lets a rank open a peer's CUDA IPC handle on its own device (`_open_on`)."""
    try:
        storage_device_position(reductions.rebuild_cuda_tensor)
    except RuntimeError:
        return False
    return True


def storage_device_position(rebuild) -> int:
    """Where `storage_device` stands in the arguments of PyTorch's CUDA tensor rebuild function (read from its
    signature, so that a reordering in a later PyTorch is an error here, not a handle opened on a wrong GPU)."""
    names = list(inspect.signature(rebuild).parameters)
    if "storage_device" not in names:
        raise RuntimeError(f"the NVLink transport cannot open CUDA IPC handles with this PyTorch "
                           f"({torch.__version__}): {getattr(rebuild, '__qualname__', rebuild)} takes no "
                           f"'storage_device' argument (its arguments: {', '.join(names)}); "
                           f"use transport='reference'")
    return names.index("storage_device")


def _enable_peer_access(own: int, other: int) -> None:
    """Let kernels on GPU `own` reach memory of GPU `other` (an opened IPC handle alone does not)."""
    if own == other:
        return
    from cuda.bindings import runtime
    previous = torch.cuda.current_device()
    runtime.cudaSetDevice(own)
    (error,) = runtime.cudaDeviceEnablePeerAccess(other, 0)
    runtime.cudaSetDevice(previous)
    if error not in (runtime.cudaError_t.cudaSuccess, runtime.cudaError_t.cudaErrorPeerAccessAlreadyEnabled):
        raise RuntimeError(f"cannot enable peer access from GPU {own} to GPU {other}: {error}")
