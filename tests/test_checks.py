"""deep_ep.checks.check_tensor: every property it checks, accepted and refused, with the argument named."""
import pytest
import torch

from deep_ep.checks import check_tensor

CPU = torch.device("cpu")


def test_a_tensor_as_described_is_returned():
    x = torch.empty(4, 6, dtype=torch.bfloat16)
    assert check_tensor("x", x, device=CPU, dtype=torch.bfloat16, dim=2, shape=(4, 6)) is x
    assert check_tensor("x", x, device=CPU, dtype=(torch.float32, torch.bfloat16), shape=(None, 6)) is x
    assert check_tensor("x", x, device=CPU, shape=[4, 6]) is x
    assert check_tensor("x", x.t(), device=CPU, shape=(6, 4), contiguous=False).shape == (6, 4)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(dtype=torch.float32), TypeError, "x must have dtype torch.float32, got torch.bfloat16"),
    (dict(dtype=(torch.float32, torch.int32)), TypeError,
     "x must have dtype torch.float32 or torch.int32, got torch.bfloat16"),
    (dict(device=torch.device("meta")), ValueError, "x must be on meta (the Buffer's device), got cpu"),
    (dict(dim=3), ValueError, "x must be 3-D, got shape (4, 6)"),
    (dict(shape=(4, 7)), ValueError, r"x must have shape [4, 7], got [4, 6]"),
    (dict(shape=(None, 7)), ValueError, r"x must have shape [*, 7], got [4, 6]"),
    (dict(shape=[5, 6]), ValueError, r"x must have shape [5, 6], got [4, 6]"),
    (dict(shape=(4, 6, 1)), ValueError, r"x must have shape [4, 6, 1], got [4, 6]"),
    (dict(shape=(4,)), ValueError, r"x must have shape [4], got [4, 6]"),
])
def test_each_mismatch_names_the_argument_and_the_expected_value(kwargs, error, message):
    x = torch.empty(4, 6, dtype=torch.bfloat16)
    kwargs.setdefault("device", CPU)
    with pytest.raises(error) as raised:
        check_tensor("x", x, **kwargs)
    assert str(raised.value) == message


def test_non_tensors_and_non_contiguous_tensors_are_refused():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        check_tensor("x", [1, 2], device=CPU)
    with pytest.raises(ValueError, match="x must be contiguous"):
        check_tensor("x", torch.empty(4, 6).t(), device=CPU)
