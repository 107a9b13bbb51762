"""The communication stream (deep_ep/streams.py): what a call's outputs and inputs are tied to, beyond the
Buffer-level stream tests in test_normal.py and test_api.py."""
import contextlib

import pytest
import torch
from dist_utils import deterministic_algorithms

from deep_ep.streams import CommStream, allocate_outputs, fills_new_memory
from deep_ep.utils import EventHandle, EventOverlap


def filled(comm: CommStream, n: int, value: float, on_caller: bool):
    """A call's body: an output of n floats set to `value` on the stream the call runs on, allocated through
    allocate_outputs (`on_caller`) or not; checks that the call's stream is current again after the allocation."""
    device = comm.stream.device

    def fn():
        runs_on = torch.cuda.current_stream(device)
        out = allocate_outputs(lambda: torch.empty(n, device=device)) if on_caller else torch.empty(n, device=device)
        assert torch.cuda.current_stream(device) == runs_on
        out.fill_(value)
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
    """A synchronous call that waits for the caller's stream runs there (Note [synchronous calls on the caller's
    stream]), so its outputs are allocated there, as DeepEP allocates them, and need no record_stream; an
    asynchronous call and one after `previous_event` run on the comm stream and allocate there (outputs marked as
    used by the caller's stream)."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommStream(device)
    caller = torch.cuda.Stream(device)
    make = lambda: allocate_outputs(lambda: torch.empty(1 << 20, device=device))  # noqa: E731
    with torch.cuda.stream(caller):
        synchronous, _ = comm.run(make, (), None, False)
        plain, _ = comm.run(lambda: torch.empty(1 << 20, device=device), (), None, False)
        asynchronous, event = comm.run(make, (), None, True)
        event.current_stream_wait()
        after_event, _ = comm.run(make, (), EventOverlap(EventHandle()), False)
        outside = make()
        runs_on = [comm.run(lambda: torch.cuda.current_stream(device), (), previous, async_finish)[0]
                   for previous, async_finish in ((None, False), (None, True), (EventOverlap(EventHandle()), False))]
    for tensor in (synchronous, plain, outside):
        assert allocation_stream(tensor) == caller.cuda_stream
    for tensor in (asynchronous, after_event):
        assert allocation_stream(tensor) == comm.stream.cuda_stream
    assert runs_on == [caller, comm.stream, comm.stream]


def test_fills_new_memory_follows_torchs_settings():
    with deterministic_algorithms(fill=True):
        assert fills_new_memory()
    with deterministic_algorithms(fill=False):
        assert not fills_new_memory()
    if not torch.are_deterministic_algorithms_enabled():
        assert not fills_new_memory()


@pytest.mark.gpu
@pytest.mark.parametrize("after_event", [False, True], ids=["synchronous", "after_previous_event"])
def test_outputs_hold_what_the_call_wrote_when_torch_fills_new_memory(after_event):
    """Under deterministic algorithms torch fills every new tensor, with a kernel that the allocation queues on
    the current stream: that fill must come before the call's kernels. A synchronous call runs on the caller's
    stream, so its fill does; a call after `previous_event` allocates on the comm stream (allocate_outputs does
    not move it to the caller's stream, where the fill would not be ordered with its kernels)."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommStream(device)
    caller = torch.cuda.Stream(device)
    with deterministic_algorithms(fill=True), torch.cuda.stream(caller):
        outputs = [comm.run(filled(comm, 1 << 24, 3.0, True), (), EventOverlap(EventHandle()) if after_event else None,
                            False)[0] for _ in range(4)]
    torch.cuda.synchronize(device)
    for out in outputs:
        assert allocation_stream(out) == (comm.stream if after_event else caller).cuda_stream
        assert torch.equal(out, torch.full_like(out, 3.0))


def late_write(target: torch.Tensor, value: float):
    """A call's body: a long sleep on the stream it runs on, then `target` set to `value`."""
    def fn():
        torch.cuda._sleep(100_000_000)
        target.fill_(value)
    return fn


def add_one(target: torch.Tensor):
    return lambda: target.add_(1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["async_then_sync", "sync_on_two_streams", "sync_then_after_older_event",
                                   "sync_then_async"])
def test_calls_follow_one_another_whatever_stream_they_run_on(order):
    """Calls of one Buffer follow one another as on DeepEP's single comm stream, though a synchronous call runs
    on the caller's stream (Note [synchronous calls on the caller's stream]): the second call's work starts after
    the first call's long-running work, whichever streams the two run on."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommStream(device)
    first_stream, second_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
    target = torch.zeros(1 << 20, device=device)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(first_stream):
        older = EventOverlap(EventHandle())
        comm.run(late_write(target, 1.0), (), None, order == "async_then_sync")
    with torch.cuda.stream(first_stream if order != "sync_on_two_streams" else second_stream):
        if order == "sync_then_after_older_event":
            comm.run(add_one(target), (), older, False)
        else:
            comm.run(add_one(target), (), None, order == "sync_then_async")
    torch.cuda.synchronize(device)
    assert torch.equal(target, torch.full_like(target, 2.0))


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


@pytest.mark.gpu
def test_a_call_after_previous_event_does_not_wait_for_caller_work_queued_after_a_synchronous_call():
    """The overlap `previous_event` is for: after a synchronous call (run on the caller's stream), a call ordered
    after an event recorded before the caller's later work must not wait for that work."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommStream(device)
    caller = torch.cuda.Stream(device)
    target = torch.zeros(16, device=device)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(caller):
        comm.run(add_one(target), (), None, False)
        before = EventOverlap(EventHandle())
        torch.cuda._sleep(2_000_000_000)   # the caller's later work, about a second
        caller_done = torch.cuda.Event()
        caller_done.record(caller)
        _, overlap = comm.run(add_one(target), (), before, True)
    overlap.event.event.synchronize()
    assert not caller_done.query(), "the call waited for the caller's work queued after its previous_event"
    torch.cuda.synchronize(device)
    assert torch.equal(target, torch.full_like(target, 2.0))


@pytest.mark.gpu
def test_synchronous_calls_run_on_the_comm_stream_once_it_was_handed_out():
    """After `get_comm_stream()` a caller may order work after the comm stream: synchronous calls run there, as
    in DeepEP."""
    device = torch.device("cuda", torch.cuda.current_device())
    comm = CommStream(device)
    caller = torch.cuda.Stream(device)
    with torch.cuda.stream(caller):
        before = comm.run(lambda: torch.cuda.current_stream(device), (), None, False)[0]
        comm.exposed = True   # what Buffer.get_comm_stream sets
        after = comm.run(lambda: torch.cuda.current_stream(device), (), None, False)[0]
    assert before == caller and after == comm.stream
