"""Peer-mapped buffers: every rank's NVLink buffer opened in every other rank of the node (CUDA IPC).

Each rank allocates one ordinary CUDA tensor, shares it as a CUDA IPC handle through the Buffer's own
group (gloo, NCCL or mixed; several ranks per GPU work), and opens its peers' handles. The device table
`bases[r]` holds the address of rank r's buffer as mapped in this process, for kernels that store into
peers. Layout of each buffer (all offsets in bytes, identical on every rank):

    [flags: int64 x FLAG_SLOTS][notify records: int32 [R, record]][staging: R x capacity slots]
"""
from __future__ import annotations

from typing import List

import torch
from torch.multiprocessing.reductions import reduce_tensor

from ...group import Group


class PeerBuffers:
    def __init__(self, local: torch.Tensor, group: Group) -> None:
        if not local.is_cuda:
            raise ValueError("the NVLink transport needs the Buffer's device to be a CUDA device")
        shared = group.all_gather_object(reduce_tensor(local))
        self.local = local
        self.peers: List[torch.Tensor] = []
        for rank, (rebuild, args) in enumerate(shared):
            self.peers.append(local if rank == group.rank else rebuild(*args))
        for peer in self.peers:
            _enable_peer_access(local.device, peer.device)
        self.bases = torch.tensor([t.data_ptr() for t in self.peers], dtype=torch.int64, device=local.device)

    def close(self) -> None:
        self.peers = [self.local]


def _enable_peer_access(own: torch.device, other: torch.device) -> None:
    """Let kernels on `own` reach memory of `other`. PyTorch enables peer access (both ways) the first time
    it copies between two devices; an opened IPC handle alone enables it only for the owner's device."""
    if own != other:
        with torch.cuda.device(own):
            torch.empty(1, device=other).copy_(torch.empty(1, device=own))
            torch.empty(1, device=own).copy_(torch.empty(1, device=other))
