"""The communication stream (deep_ep/streams.py): what a call's outputs and inputs are tied to, beyond the
Buffer-level stream tests in test_normal.py and test_api.py."""
import pytest
import torch

from deep_ep.streams import CommStream
from deep_ep.utils import EventHandle, EventOverlap


@pytest.mark.gpu
def test_an_output_read_by_the_caller_inside_a_capture_is_not_given_to_a_later_call():
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
        first, _ = comm.run(lambda: torch.full((n,), 1.0, device=device), (), None, False)
        torch.cuda._sleep(20_000_000)   # the caller's stream reads the output late
        kept["doubled"] = first * 2
        first_address = first.data_ptr()
        del first
        second, _ = comm.run(lambda: torch.full((n,), 7.0, device=device), (), before, False)
        kept["second_address"] = second.data_ptr()
        kept["second"] = second
    assert kept["second_address"] != first_address, "the later call got the memory the caller still reads"
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize(device)
        assert torch.equal(kept["doubled"], torch.full((n,), 2.0, device=device))
        assert torch.equal(kept["second"], torch.full((n,), 7.0, device=device))
