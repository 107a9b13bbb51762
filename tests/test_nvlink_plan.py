"""The NVLink transport's bookkeeping that needs no GPU: rebuilding where every row went from a handle
(the path a copied handle takes), against the independent model; when a dropped transport waits for the GPU."""
import pytest
import torch

import model
from inputs import make_routing
from randomness import base_seed, generator
from deep_ep.group import Group
from deep_ep.transport import nvlink
from deep_ep.transport.nvlink import NVLinkTransport
from deep_ep.transport.nvlink.normal import plan_from_handle


@pytest.mark.parametrize("num_ranks,num_channels", [(2, 3), (3, 5), (4, 1)])
def test_plan_from_handle_matches_the_model(num_ranks, num_channels):
    seed = base_seed()
    experts = 4 * num_ranks
    sources = []
    for s in range(num_ranks):
        gen = generator(seed, "plan", s)
        num_tokens = int(torch.randint(0, 40, (1,), generator=gen))
        idx, weights = make_routing(gen, num_tokens, 3, experts, mask_frac=0.2)
        x = torch.randn(num_tokens, 16, generator=gen).to(torch.bfloat16)
        sources.append(model.Source(x, idx, weights, model.layout(idx, experts, num_ranks, None)))
    results = [model.dispatch(sources, g, experts, num_channels=num_channels) for g in range(num_ranks)]
    sent = torch.tensor([[sum(1 for r, _ in results[d].rows if r == s) for d in range(num_ranks)]
                         for s in range(num_ranks)], dtype=torch.int32)   # rows s sends to d
    for g, result in enumerate(results):
        handle = tuple(result.handle[name] for name in model.INTRANODE_HANDLE_FIELDS)
        assert plan_from_handle(handle, g, read_shares=False)[-2:] == (None, None)
        plan = plan_from_handle(handle, g, read_shares=True)
        # expected, from the received rows (source, token) in order
        count = torch.zeros(num_ranks, num_channels, dtype=torch.int32)
        base = torch.full((num_ranks, num_channels), -1, dtype=torch.int32)
        for i, (s, t) in enumerate(result.rows):
            q = model.channel_of_token(sources[s].num_tokens, num_channels)[t]
            if base[s, q] < 0:
                base[s, q] = i
            count[s, q] += 1
        rows_per_source = torch.tensor([sum(1 for s, _ in result.rows if s == r) for r in range(num_ranks)])
        prefix = torch.cat([torch.zeros(1, dtype=torch.int64), rows_per_source.cumsum(0)]).to(torch.int32)
        msg = f"seed {seed}, rank {g}"
        assert torch.equal(plan.prefix, prefix), msg
        assert torch.equal(plan.recv_count, count), msg
        filled = base >= 0
        assert torch.equal(plan.recv_base[filled], base[filled]), msg
        assert plan.num_channels == num_channels
        in_rank = handle[4].to(torch.int32)
        before = torch.cat([torch.zeros(1, num_ranks, dtype=torch.int32), in_rank.cumsum(0).to(torch.int32)])
        assert torch.equal(plan.before, before), msg
        # the direct protocol's places: first row in each destination, first slot in each source's combine area
        assert torch.equal(plan.push_row0, sent[:g].sum(0).to(torch.int32)), msg
        assert torch.equal(plan.combine_row0, sent[:, :g].sum(1).to(torch.int32)), msg
        assert (plan.max_recv_rows, plan.max_send_rows) == (int(sent.sum(0).max()), int(sent.sum(1).max())), msg
        # a num_worst_tokens handle (rows padded with -1, or fewer than arrived): its dispatch used the rings,
        # and so does its rebuilt plan (the direct protocol would put rows past the outputs)
        received = handle[3].shape[0]
        for worst in {received + 3, max(received - 1, 1)} - {received}:
            padded = handle[:3] + (handle[3].new_full((worst,), -1),) + handle[4:]
            worst_plan = plan_from_handle(padded, g, read_shares=True)
            assert worst_plan[-2:] == (None, None), msg
            assert torch.equal(worst_plan.prefix, prefix) and torch.equal(worst_plan.recv_base, plan.recv_base), msg


class _GroupOf:
    """A stand-in for the transport's group: gather_int_lists returns this rank's values and the others'."""
    agree_on = Group.agree_on

    def __init__(self, others):
        self.others = others

    def gather_int_lists(self, values, what):
        return [list(values)] + [other(list(values)) for other in self.others]


def test_ranks_must_agree_on_the_protocol_settings():
    from deep_ep.transport.nvlink import _agree_on_settings, settings
    _agree_on_settings(_GroupOf([lambda values: values, lambda values: values]))   # all alike: no error
    other_protocol = lambda values: [1 - values[0]]  # noqa: E731
    mine = int(settings.DIRECT)
    with pytest.raises(ValueError, match=rf"DEEP_EP_NVLINK_DIRECT.*\[{mine}, {mine}, {1 - mine}\]"):
        _agree_on_settings(_GroupOf([lambda values: values, other_protocol]))


@pytest.mark.parametrize("released, broken, capturing, waits", [
    (False, False, None, True),      # dropped without destroy(): wait for this rank's kernels first
    (True, False, None, False),      # destroy() waited already
    (False, True, None, False),      # after a timeout a collective that never ends may hold the GPU
    (False, False, "own", False),    # a wait would end the caller's graph capture on the Buffer's device
    (False, False, "current", False),   # ... or on the current device
])
def test_a_dropped_transport_waits_for_the_gpu_only_where_it_must_and_may(monkeypatch, released, broken, capturing,
                                                                         waits):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    monkeypatch.setattr(nvlink, "capturing", lambda device: capturing == "own" and device == torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing == "current")
    transport = NVLinkTransport.__new__(NVLinkTransport)   # (its construction needs GPUs; only the drop is tested)
    transport.group = type("FakeGroup", (), {"broken": broken})()
    transport.device, transport._released = torch.device("cuda", 1), released
    transport.__del__()   # (called directly: an exception raised in it would fail the test, not just warn)
    assert waited == ([torch.device("cuda", 1)] if waits else [])
    transport._released = True   # (the collection that follows waits no more)
