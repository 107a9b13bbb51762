"""Opening peers' CUDA IPC handles: where the device argument of PyTorch's rebuild function stands."""
import pytest
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from deep_ep.transport.nvlink.peer_memory import storage_device_position


def test_installed_torch_rebuilds_cuda_tensors_with_a_storage_device_argument():
    position = storage_device_position(rebuild_cuda_tensor)
    assert position >= 0


def test_the_position_follows_the_signature():
    def moved(storage_device, tensor_cls, tensor_size):
        pass

    def later(a, b, c, d, e, f, g, storage_device=None):
        pass

    assert storage_device_position(moved) == 0
    assert storage_device_position(later) == 7


def test_a_rebuild_function_without_the_argument_is_a_clear_error():
    def renamed(tensor_cls, tensor_size, device):
        pass

    with pytest.raises(RuntimeError, match="storage_device.*transport='reference'"):
        storage_device_position(renamed)


def test_handles_cannot_be_opened_without_the_argument(monkeypatch):
    import torch.multiprocessing.reductions as reductions
    from deep_ep.transport.nvlink.peer_memory import ipc_handles_open_on_own_device

    assert ipc_handles_open_on_own_device()
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda tensor_cls, tensor_size, device: None)
    assert not ipc_handles_open_on_own_device()
