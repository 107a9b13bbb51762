"""The NVLink transport's kernel launcher (deep_ep/transport/nvlink/launcher.py) on the GPU (skipped elsewhere):
launches through the compiled-kernel cache give what Triton's own launch gives, also when the arguments
change what Triton specialises on (pointer alignment, an int that is 1 or a multiple of 16, int width)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402


@triton.jit
def _scaled_copy(src_ptr, dst_ptr, num, scale, offset, BLOCK: tl.constexpr, NEGATE: tl.constexpr):
    i = tl.arange(0, BLOCK)
    for start in range(0, num, BLOCK):
        live = start + i < num
        value = tl.load(src_ptr + start + i, mask=live, other=0) * scale + (offset % 1000)
        if NEGATE:
            value = -value
        tl.store(dst_ptr + start + i, value, mask=live)


def _expected(src, num, scale, offset, negate):
    out = src[:num] * scale + (offset % 1000)
    return -out if negate else out


@pytest.fixture
def device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda", torch.cuda.current_device())


def test_launch_matches_triton_across_specialisations(device):
    from deep_ep.transport.nvlink import launcher
    for key in [key for key in launcher._compiled if key[0] == id(_scaled_copy)]:
        del launcher._compiled[key]
    gen = torch.Generator(device="cpu").manual_seed(torch.seed() % 2 ** 31)
    base = torch.randint(-1000, 1000, (4096 + 8,), generator=gen, dtype=torch.int32).to(device)
    cases = [  # (offset into base, num, scale, offset argument, negate)
        (0, 4096, 3, 7, False), (1, 4095, 3, 7, False),        # aligned, then a pointer 4 bytes off
        (0, 1, 1, 16, False), (0, 17, 2, 2 ** 33 + 5, True),    # ints == 1 and % 16, a 64-bit int
        (2, 64, 5, 0, True), (0, 4096, 3, 7, False),            # back to the first key: a cached launch
    ]
    for round_ in range(2):   # the second round finds every key cached
        for start, num, scale, offset, negate in cases:
            src = base[start:]
            dst = torch.full((num + 8,), -1, dtype=torch.int32, device=device)[start % 4:]
            if round_:
                base.random_(-1000, 1000)
            launcher.launch(_scaled_copy, (1,), src, dst, num, scale, offset, BLOCK=1024, NEGATE=negate, num_warps=4)
            torch.cuda.synchronize(device)
            expected = _expected(src, num, scale, offset, negate)
            assert torch.equal(dst[:num], expected), (round_, start, num, scale, offset, negate)
            assert torch.all(dst[num:] == -1), "wrote past num"
    keys = [key for key in launcher._compiled if key[0] == id(_scaled_copy)]
    # the launcher keeps one compiled kernel per distinct specialisation, the repeated case adds none
    assert len(keys) == len(cases) - 1 or not launcher.ENABLED


def test_launch_by_keywords_and_in_a_cuda_graph(device):
    from deep_ep.transport.nvlink.launcher import launch
    src = torch.randint(-50, 50, (300,), dtype=torch.int32, device=device)
    dst = torch.zeros(300, dtype=torch.int32, device=device)
    kwargs = dict(src_ptr=src, dst_ptr=dst, num=300, scale=-2, offset=9, BLOCK=128, NEGATE=False)
    launch(_scaled_copy, (1,), **kwargs, num_warps=4)
    launch(_scaled_copy, (1,), **kwargs, num_warps=4)
    torch.cuda.synchronize(device)
    assert torch.equal(dst, src * -2 + 9)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            launch(_scaled_copy, (1,), **kwargs, num_warps=4)
    for _ in range(3):
        src.random_(-50, 50)
        dst.zero_()
        graph.replay()
        torch.cuda.synchronize(device)
        assert torch.equal(dst, src * -2 + 9)


def test_launch_with_a_hook_goes_through_triton(device):
    from deep_ep.transport.nvlink.launcher import launch
    seen = []
    runtime = triton.knobs.runtime
    chain = runtime.launch_enter_hook
    hook = lambda metadata: seen.append(1)  # noqa: E731
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        runtime.launch_enter_hook = hook
    try:
        src = torch.arange(64, dtype=torch.int32, device=device)
        dst = torch.zeros_like(src)
        launch(_scaled_copy, (1,), src, dst, 64, 1, 0, BLOCK=64, NEGATE=False)
        torch.cuda.synchronize(device)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            runtime.launch_enter_hook = chain
    assert seen, "a profiler's launch hook was not called"
    assert torch.equal(dst, src)
