"""The communication stream (deep_ep/streams.py): what a call's outputs and inputs are tied to, beyond the
Buffer-level stream tests in test_normal.py and test_api.py."""
import contextlib

import pytest
import torch
from dist_utils import deterministic_algorithms

from deep_ep.streams import CommStream, allocate_outputs, fills_new_memory
from deep_ep.utils import EventHandle, EventOverlap


def filled(comm: CommStream, n: int, value: float, on_caller: bool):
    """A call's body: an output of n floats set to `value` on the comm stream, allocated through allocate_outputs
    (`on_caller`) or not; checks that the comm stream is current again after the allocation."""
    device = comm.stream.device

    def fn():
        out = allocate_outputs(lambda: torch.empty(n, device=device)) if on_caller else torch.empty(n, device=device)
        out.fill_(value)
        assert torch.cuda.current_stream(device) == comm.stream
        return out
    return fn


@pytest.mark.gpu
@pytest.mark.parametrize("on_caller", [False, True], ids=["comm_stream_output", "allocate_outputs"])
def test_an_output_read_by_the_caller_inside_a_capture_is_not_given_to_a_later_call(on_caller):
    """Inside a CUDA-graph capture, a call's output that the caller's stream reads and then frees must not become
    the output of a later call of the same capture that is ordered only after an earlier event (the overlap
    pattern: previous_event recorded before the caller's work): nothing in the graph orders that call's writes
    after the caller's read."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommStream(device)
    n = 1 << 22
    caller = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    kept = {}
    torch.cuda.synchronize(device)
    with torch.cuda.graph(graph, stream=caller):
        before = EventOverlap(EventHandle())   # recorded before the caller's read of the first output
        first, _ = comm.run(filled(comm, n, 1.0, on_caller), (), None, False)
        torch.cuda._sleep(20_000_000)   # the caller's stream reads the output late
        kept["doubled"] = first * 2
        first_address = first.data_ptr()
        del first
        second, _ = comm.run(filled(comm, n, 7.0, on_caller), (), before, False)
        kept["second_address"] = second.data_ptr()
        kept["second"] = second
    assert kept["second_address"] != first_address, "the later call got the memory the caller still reads"
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize(device)
        assert torch.equal(kept["doubled"], torch.full((n,), 2.0, device=device))
        assert torch.equal(kept["second"], torch.full((n,), 7.0, device=device))


def allocation_stream(tensor: torch.Tensor) -> int:
    """The raw stream whose caching-allocator pool `tensor`'s memory came from."""
    address = tensor.untyped_storage().data_ptr()
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return segment["stream"]
    raise AssertionError("the tensor's memory is not in the caching allocator's snapshot")


@pytest.mark.gpu
def test_synchronous_outputs_are_allocated_on_the_callers_stream():
    """A synchronous call that waits for the caller's stream allocates its outputs there (allocate_outputs), as
    DeepEP does, so they need no record_stream; an asynchronous call, one after `previous_event`, and tensors
    allocated otherwise stay on the comm stream (marked as used by the caller's stream)."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommStream(device)
    caller = torch.cuda.Stream(device)
    make = lambda: allocate_outputs(lambda: torch.empty(1 << 20, device=device))  # noqa: E731
    with torch.cuda.stream(caller):
        synchronous, _ = comm.run(make, (), None, False)
        asynchronous, event = comm.run(make, (), None, True)
        event.current_stream_wait()
        after_event, _ = comm.run(make, (), EventOverlap(EventHandle()), False)
        plain, _ = comm.run(lambda: torch.empty(1 << 20, device=device), (), None, False)
        outside = make()
    assert allocation_stream(synchronous) == caller.cuda_stream
    assert allocation_stream(outside) == caller.cuda_stream
    for tensor in (asynchronous, after_event, plain):
        assert allocation_stream(tensor) == comm.stream.cuda_stream


def test_fills_new_memory_follows_torchs_settings():
    with deterministic_algorithms(fill=True):
        assert fills_new_memory()
    with deterministic_algorithms(fill=False):
        assert not fills_new_memory()
    if not torch.are_deterministic_algorithms_enabled():
        assert not fills_new_memory()


@pytest.mark.gpu
def test_synchronous_outputs_stay_on_the_comm_stream_when_torch_fills_new_memory():
    """Under deterministic algorithms torch fills every new tensor, with a kernel that the allocation queues on
    the current stream; on the caller's stream that fill would not be ordered with the call's kernels and could
    overwrite what they wrote. So a synchronous call then allocates its outputs on the comm stream, where the
    fill comes before its kernels, and every output holds what the call wrote."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommStream(device)
    caller = torch.cuda.Stream(device)
    with deterministic_algorithms(fill=True), torch.cuda.stream(caller):
        outputs = [comm.run(filled(comm, 1 << 24, 3.0, True), (), None, False)[0] for _ in range(4)]
    torch.cuda.synchronize(device)
    for out in outputs:
        assert allocation_stream(out) == comm.stream.cuda_stream
        assert torch.equal(out, torch.full_like(out, 3.0))


@pytest.mark.gpu
def test_a_freed_synchronous_output_is_not_written_by_a_later_call_after_an_earlier_event():
    """A synchronous output (on the caller's stream) that the caller's stream still reads when it is freed must
    not become the output of a later call ordered only after an event recorded before that read."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommStream(device)
    caller = torch.cuda.Stream(device)   # (its own pool: the freed output is the only block of its size there)
    n = 1 << 22
    with torch.cuda.stream(caller):
        for _ in range(3):
            before = EventOverlap(EventHandle())
            first, _ = comm.run(filled(comm, n, 1.0, True), (), None, False)
            torch.cuda._sleep(20_000_000)   # the caller's stream reads the output late
            doubled = first * 2
            first_address = first.data_ptr()
            del first
            second, _ = comm.run(filled(comm, n, 7.0, True), (), before, False)
            assert second.data_ptr() != first_address, "the later call got the memory the caller still reads"
            torch.cuda.synchronize(device)
            assert torch.equal(doubled, torch.full((n,), 2.0, device=device))
            assert torch.equal(second, torch.full((n,), 7.0, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["outputs_on_caller", "torch_fills_new_memory", "after_previous_event"])
def test_a_failed_synchronous_call_makes_the_callers_stream_wait_for_its_kernels(case):
    """A synchronous call that raises after launching work must still make the caller's stream wait for it,
    wherever its outputs were allocated: the outputs it dropped may still be written by its kernels, and the
    inputs the caller frees may still be read by them."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommStream(device)
    caller = torch.cuda.Stream(device)

    def fn():
        allocate_outputs(lambda: torch.empty(1 << 20, device=device))
        torch.cuda._sleep(100_000_000)   # a kernel of the call, still running when the call fails
        raise RuntimeError("failed after launching")
    fill = deterministic_algorithms(fill=True) if case == "torch_fills_new_memory" else contextlib.nullcontext()
    with torch.cuda.stream(caller), fill:
        previous = EventOverlap(EventHandle()) if case == "after_previous_event" else None
        with pytest.raises(RuntimeError, match="failed after launching"):
            comm.run(fn, (), previous, False)
        after = torch.cuda.Event()
        after.record(caller)
    assert not after.query(), "the caller's stream went on while the failed call's kernel was running"
    torch.cuda.synchronize(device)
    assert after.query()
