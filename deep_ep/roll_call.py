"""Roll calls through the rendezvous store: how the ranks of a shrink-mode Buffer find out, on the host, which
peers reached a step and which are gone, without a collective that a gone rank would hold up.

Every step has a key per rank under the Buffer's namespace in the store. A rank arriving at a step sets its own
key to ARRIVED, then polls its peers' keys. A peer whose key is still missing when the timeout expires is
declared ABSENT by writing that value into its key. Both writes are compare-and-set on an empty key, so for
every (step, rank) the store keeps whichever came first: all ranks that reach the step read the same verdict,
and a rank that arrives after being declared absent learns it from its own write. Afterwards the ranks that
arrived exchange among themselves, in the same set on every rank.

Steps are numbered in calls to `step`, which every rank makes in the same order. A rank that is masked by the
others may sit some steps out; `realign` (at a clean with nothing masked, which every rank takes part in)
starts a new numbering, so it rejoins in step.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence

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
        self._epoch = 0         # numberings started by realign()
        self._step = 0          # steps taken in this numbering
        self._last_key: Optional[str] = None   # this rank's key of the previous step (deleted after the next)

    def _key(self, name: str, rank: int) -> str:
        return f"{self.namespace}/{name}/{rank}"

    def step(self, peers: Sequence[int]) -> List[int]:
        """Arrive at the next step and wait for `peers` (group ranks, not this one); returns those declared
        absent. Raises AbsentError if this rank itself was declared absent at this step."""
        name = f"{self._epoch}/{self._step}"
        self._step += 1
        return self._attend(name, peers)

    def realign(self, peers: Sequence[int]) -> List[int]:
        """A step every rank of the group takes, also one that sat out the steps since the last realign (it
        was masked): it starts a new step numbering. Returns the peers declared absent."""
        name = f"realign/{self._epoch}"
        self._epoch += 1
        self._step = 0
        return self._attend(name, peers)

    def gather(self, name: str, peers: Sequence[int]) -> List[int]:
        """Arrive at the one-off step `name` and wait for `peers` up to the timeout, declaring nobody absent
        (for the last step of a Buffer, where nothing depends on the verdict). Returns the peers that did not
        arrive in time."""
        self._arrive(name)
        return self._wait(name, peers)

    def _attend(self, name: str, peers: Sequence[int]) -> List[int]:
        self._arrive(name)
        peers = [peer for peer in peers if peer != self.rank]
        missing = self._wait(name, peers)
        # a key that exists may hold another rank's verdict ABSENT (its wait started earlier and ended first)
        present = [peer for peer in peers if peer not in missing]
        values = _get_all(self.store, [self._key(name, peer) for peer in present])
        absent = sorted([peer for peer, value in zip(present, values) if value == ABSENT] +
                        [peer for peer in missing if self.store.compare_set(self._key(name, peer), "", ABSENT) == ABSENT])
        previous, self._last_key = self._last_key, self._key(name, self.rank)
        if previous is not None:   # every peer that arrived here has taken its verdict on that key
            _delete(self.store, previous)
        return absent

    def _arrive(self, name: str) -> None:
        if self.store.compare_set(self._key(name, self.rank), "", ARRIVED) == ABSENT:
            raise AbsentError(f"rank {self.rank} arrived after the other ranks had waited {self.timeout_s:g} s for it "
                              "and masked it")

    def _wait(self, name: str, peers: Sequence[int]) -> List[int]:
        """Poll the peers' keys until all exist or the timeout expires; returns the peers still missing."""
        pending = [peer for peer in peers if peer != self.rank]
        if not pending or self.store.check([self._key(name, peer) for peer in pending]):
            return []
        deadline = time.monotonic() + self.timeout_s
        pause = _FIRST_POLL_S
        while True:
            pending = [peer for peer in pending if not self.store.check([self._key(name, peer)])]
            if not pending or time.monotonic() > deadline:
                return pending
            time.sleep(pause)
            pause = min(2 * pause, _LONGEST_POLL_S)


def _get_all(store, keys: List[str]) -> List[bytes]:
    if not keys:
        return []
    if hasattr(store, "multi_get"):   # (one round trip; newer torch)
        return list(store.multi_get(keys))
    return [store.get(key) for key in keys]


def _delete(store, key: str) -> None:
    try:
        store.delete_key(key)
    except (RuntimeError, NotImplementedError):   # (a store without deletion keeps the key)
        pass


def default_store():
    """The default process group's rendezvous store, or None (no default group, or a torch without it)."""
    import torch.distributed as dist
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
