"""The NVLink transport against the same independent model as the reference transport (GPU machine only).

Run with `DEEP_EP_TEST_DEVICE=cuda python -m pytest tests/test_nvlink.py`: 2 ranks on 2 GPUs, and 3 and 4
ranks with several processes per GPU (a gloo control plane, CUDA IPC between the processes)."""
import pytest
import torch

from randomness import base_seed
from test_normal import CASES_2, CASES_3, CASES_4, EDGE_CASES, _report, random_cases, run_cases

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world_size,cases", [(2, CASES_2), (3, CASES_3), (4, CASES_4)],
                         ids=["2ranks", "3ranks", "4ranks"])
def test_nvlink_matches_model(pool, world_size, cases):
    seed = base_seed()
    cases = cases + random_cases(seed, world_size, 3) + EDGE_CASES[world_size]
    _report(seed, lambda: pool(world_size).run(run_cases, seed, cases, None, "nvlink"))


def run_fallback_then_fast(ctx) -> None:
    """Rows that do not fit the staging area go through the reference transport; the fast path must keep
    working afterwards (the fallback closes its epoch)."""
    from deep_ep import Buffer, Config
    config = Config(2, 1, 2)
    buffer = Buffer(ctx.group, 1 << 20, 0, transport="nvlink", explicitly_destroy=True, timeout_s=20)
    num_experts, hidden = 2 * ctx.world_size, 256
    for num_tokens in (2000, 2000, 16, 16):   # 2000 BF16 rows do not fit 1 MiB; 16 do
        gen = torch.Generator().manual_seed(ctx.rank * 1000 + num_tokens)
        x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16).to(ctx.device)
        topk_idx = torch.randint(0, num_experts, (num_tokens, 1), generator=gen).to(ctx.device)
        weights = torch.ones(num_tokens, 1, device=ctx.device)
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights, config=config)
        cached, *_ = buffer.dispatch(x, handle=handle, config=config)
        assert torch.equal(cached, recv_x)
        combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w, config=config)
        assert torch.equal(combined, x), f"rank {ctx.rank}: combine(dispatch(x)) != x with {num_tokens} tokens"
        assert torch.equal(combined_w, weights)
    buffer.destroy()


def test_nvlink_fallback_keeps_the_fast_path_working(pool):
    pool(2).run(run_fallback_then_fast)
