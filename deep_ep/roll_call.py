"""Roll calls through the rendezvous store: how the ranks of a shrink-mode Buffer find out, on the host, which
peers reached a step and which are gone, without a collective that a gone rank would hold up.

Every step has a key per rank under the Buffer's namespace in the store. A rank arriving at a step sets its own
key to ARRIVED (with a number it passes along and the ranks its shrink mask marks), then polls its peers' keys.
A peer whose key is still missing when the timeout expires is declared ABSENT by writing that value into its
key. Both writes are compare-and-set on an empty key, so for every (step, rank) the store keeps whichever came
first: all ranks that reach the step read the same verdict, and a rank that arrives after being declared
absent learns it from its own write. Afterwards the ranks that arrived exchange among themselves, in the same
set on every rank.

Steps are named by the index of the last clean (`clean_low_latency_buffer`) and their number since it. A rank
masked by the others may sit out steps and cleans: at its next clean it looks at the clean of the next index
and, if every rank holding that clean (a rank that came there and that no one who came has masked) has it
masked, it sat that clean out and looks at the next, until one where it is expected; so it rejoins in step,
also together with other ranks that sat the same cleans out.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

ARRIVED = b"arrived"
ABSENT = b"absent"
_FIRST_POLL_S = 50e-6
_LONGEST_POLL_S = 5e-3


class AbsentError(RuntimeError):
    """This rank reached a step after its peers had stopped waiting for it and declared it absent."""


class RollCall:
    """Roll calls of one Buffer's ranks. `store`: a store every rank of the group reaches (the default
    group's rendezvous store); `namespace`: the same string on every rank, unique to the Buffer."""

    def __init__(self, store, namespace: str, rank: int, timeout_s: float) -> None:
        self.store, self.namespace, self.rank, self.timeout_s = store, namespace, rank, timeout_s
        self._clean = 0         # index of the last clean this rank took part in
        self._step = 0          # steps since then
        self._last_key: Optional[str] = None   # this rank's key of its previous step (deleted after the next)
        self._last_peers: List[int] = []       # that step's peers

    def _key(self, name: str, rank: int) -> str:
        return f"{self.namespace}/{name}/{rank}"

    def step(self, peers: Sequence[int]) -> List[int]:
        """Arrive at the next step and wait for `peers` (group ranks); returns those declared absent. Raises
        AbsentError if this rank itself was declared absent at this step."""
        name = f"{self._clean}/{self._step}"
        self._step += 1
        peers = [peer for peer in peers if peer != self.rank]
        self._arrive(name, 0, 0)
        absent, _ = self._verdicts(name, *self._read(name, peers))
        self._forget_previous(peers, absent)
        self._last_key, self._last_peers = self._key(name, self.rank), peers
        return absent

    def _forget_previous(self, peers: List[int], absent: List[int]) -> None:
        """Delete this rank's key of the previous step once every peer of that step has come to this one (it
        has then taken its verdict there). A peer that is not here (masked since) may still be reading it."""
        here = set(peers) - set(absent)
        if self._last_key is not None and set(self._last_peers) <= here:
            _delete(self.store, self._last_key)
            self._last_key = None

    def clean(self, peers: Sequence[int], masked: Sequence[int], number: int) -> Tuple[List[int], int]:
        """Arrive at the next clean and wait for `peers`; `masked`: the ranks this rank's mask marks. Returns the
        peers declared absent and the largest `number` passed by the ranks that came. A rank with no peers (it
        has masked every other rank) takes no clean index, like a rank that sits the clean out. Clean keys stay
        in the store: a rank that sat a clean out reads them when it rejoins."""
        peers = [peer for peer in peers if peer != self.rank]
        if not peers:
            return [], number
        bits = sum(1 << r for r in masked)
        index = self._clean + 1
        while True:
            name = f"clean/{index}"
            self._arrive(name, number, bits)
            missing, records = self._read(name, peers)
            masks = {peer: _masked(record) for peer, record in records.items() if record != ABSENT}
            # the ranks that hold this clean: those that came and that no one who came has masked (not another
            # rank that sat it out and comes back now)
            holders = [peer for peer in masks if not any(peer in other for other in masks.values())]
            if not holders or not all(self.rank in masks[peer] for peer in holders):
                break
            index += 1   # every rank holding this clean has this rank masked: a clean it sat out
        self._clean, self._step = index, 0
        absent, numbers = self._verdicts(name, missing, records)
        return absent, max([number, *numbers])

    def gather(self, name: str, peers: Sequence[int]) -> List[int]:
        """Arrive at the one-off step `name` and wait for `peers` up to the timeout, declaring nobody absent
        (for the last step of a Buffer, where nothing depends on the verdict). Returns the peers that did not
        arrive in time."""
        peers = [peer for peer in peers if peer != self.rank]
        self._arrive(name, 0, 0)
        missing = self._wait(name, peers)
        self._forget_previous(peers, missing)
        return missing

    def _read(self, name: str, peers: List[int]) -> Tuple[List[int], Dict[int, bytes]]:
        """Wait at step `name` for `peers` (not this rank); returns the peers still missing at the timeout and
        the records of the others."""
        missing = self._wait(name, peers)
        present = [peer for peer in peers if peer not in missing]
        return missing, dict(zip(present, _get_all(self.store, [self._key(name, peer) for peer in present])))

    def _verdicts(self, name: str, missing: List[int], records: Dict[int, bytes]) -> Tuple[List[int], List[int]]:
        """After the wait at step `name` (`_read`): (peers declared absent, the numbers of the peers that came). A
        record may be another rank's verdict ABSENT (its wait started earlier and ended first)."""
        values = dict(records)
        for peer in missing:
            values[peer] = self.store.compare_set(self._key(name, peer), "", ABSENT)
        absent = sorted(peer for peer, value in values.items() if value == ABSENT)
        return absent, [int(value.split()[1]) for value in values.values() if value != ABSENT]

    def _arrive(self, name: str, number: int, masked_bits: int) -> None:
        record = b"%s %d %x" % (ARRIVED, number, masked_bits)
        if self.store.compare_set(self._key(name, self.rank), "", record) == ABSENT:
            raise AbsentError(f"rank {self.rank} arrived after the other ranks had waited {self.timeout_s:g} s "
                              "for it and masked it")

    def _wait(self, name: str, peers: List[int]) -> List[int]:
        """Poll the peers' keys (one request a poll) until all exist or the timeout expires; returns the peers
        still missing."""
        keys = [self._key(name, peer) for peer in peers]
        deadline = time.monotonic() + self.timeout_s
        pause = _FIRST_POLL_S
        while keys and not self.store.check(keys):
            if time.monotonic() > deadline:
                return [peer for peer in peers if not self.store.check([self._key(name, peer)])]
            time.sleep(pause)
            pause = min(2 * pause, _LONGEST_POLL_S)
        return []


def _masked(record: bytes) -> Set[int]:
    """The ranks an ARRIVED record says its rank had masked."""
    bits = int(record.split()[2], 16)
    return {rank for rank in range(bits.bit_length()) if (bits >> rank) & 1}


def _get_all(store, keys: List[str]) -> List[bytes]:
    if not keys:
        return []
    if hasattr(store, "multi_get"):   # one round trip; newer torch
        return list(store.multi_get(keys))
    return [store.get(key) for key in keys]


def _delete(store, key: str) -> None:
    try:
        store.delete_key(key)
    except (RuntimeError, NotImplementedError):   # a store without deletion keeps the key
        pass


def default_store():
    """The default process group's rendezvous store, or None (no default group, or a torch without it)."""
    import torch.distributed as dist
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
