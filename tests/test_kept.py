"""What a transport keeps with a handle (deep_ep/transport/kept.py)."""
import gc
import weakref

import torch

from deep_ep.transport.kept import Keeper


def test_each_keeper_sees_only_its_own_entries():
    handle, other = torch.zeros(4), torch.zeros(4)
    first, second = Keeper(), Keeper()
    assert first.get(handle) is None
    first.keep(handle, "first's plan")
    assert first.get(handle) == "first's plan" and second.get(handle) is None and first.get(other) is None
    second.keep(handle, "second's plan")   # a handle used with two Buffers keeps an entry for each
    assert first.get(handle) == "first's plan" and second.get(handle) == "second's plan"
    first.keep(handle, "first's new plan")
    assert first.get(handle) == "first's new plan"


def test_an_entry_lives_and_dies_with_its_tensor():
    class Value:
        pass
    handle, value = torch.zeros(4), Value()
    alive = weakref.ref(value)
    Keeper().keep(handle, value)
    del value
    gc.collect()
    assert alive() is not None
    del handle
    gc.collect()
    assert alive() is None
