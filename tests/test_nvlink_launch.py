"""The NVLink transport's kernel launcher (deep_ep/transport/nvlink/launcher.py): `launch` and `Relaunch`.

On CPU: which calls reach Triton's own path and which the cache, with a stand-in for a compiled kernel. On the
GPU (marked): launches through the cache give what Triton's own launch gives, also when the arguments change
what Triton specialises on (pointer alignment, an int that is 1 or a multiple of 16, int width)."""
import pytest
import torch
from dist_utils import SUPPORTED_TRITON, run_script
from randomness import base_seed, generator

triton = pytest.importorskip("triton", minversion=SUPPORTED_TRITON)
import triton.language as tl  # noqa: E402

from deep_ep.transport.nvlink import launcher  # noqa: E402


@triton.jit
def _scaled_copy(src_ptr, dst_ptr, num, scale, offset, BLOCK: tl.constexpr, NEGATE: tl.constexpr):
    i = tl.arange(0, BLOCK)
    for start in range(0, num, BLOCK):
        live = start + i < num
        value = tl.load(src_ptr + start + i, mask=live, other=0) * scale + (offset % 1000)
        if NEGATE:
            value = -value
        tl.store(dst_ptr + start + i, value, mask=live)


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` (Triton's path) is counted and returns a
    stand-in compiled kernel (itself) whose `run` records what the cache passed it."""

    def __init__(self, fn):
        self.params = fn.params
        self.triton_calls = []
        self.runs = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            return self   # as the compiled kernel
        return call

    # the compiled kernel's side
    function, packed_metadata = "function", "metadata"

    def run(self, *args):
        self.runs.append(args)


@pytest.fixture
def recorder(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(launcher, "ENABLED", True)
    return _Recorder(_scaled_copy)


def test_cache_reuses_a_compiled_kernel_only_for_the_same_specialisation(recorder):
    src = torch.zeros(64, dtype=torch.int32)
    dst = torch.zeros(64, dtype=torch.int32)

    def call(source=src, num=64, scale=3, offset=7, negate=False, warps=4):
        launcher.launch(recorder, (2,), source, dst, num, scale, offset, BLOCK=32, NEGATE=negate, num_warps=warps)

    call()
    assert len(recorder.triton_calls) == 1 and not recorder.runs
    call()   # same specialisation: the cached kernel, the constexprs in place
    assert len(recorder.triton_calls) == 1 and len(recorder.runs) == 1
    grid_x, grid_y, grid_z, stream, function, metadata, launch_metadata, enter, leave, *values = recorder.runs[0]
    assert (grid_x, grid_y, grid_z, stream, function, metadata) == (2, 1, 1, 1234, "function", "metadata")
    assert (launch_metadata, enter, leave) == (None, None, None)
    # host tensors go as tensors (the launcher translates their addresses), a Pointer as its raw address
    assert values[0] is src and values[1] is dst and values[2:] == [64, 3, 7, 32, False]
    call(source=launcher.Pointer(src, torch.int32))   # the same dtype and alignment as src: cached
    assert len(recorder.triton_calls) == 1 and recorder.runs[-1][9] == src.data_ptr()
    call(scale=5, offset=-9, num=48)   # other values of the same classes: still cached
    assert len(recorder.triton_calls) == 1 and len(recorder.runs) == 3
    # each of these changes what Triton specialises on, so it goes through Triton once, then is cached
    changes = [dict(source=src[1:]),          # pointer no longer 16-byte aligned
               dict(source=src.float()),      # another dtype
               dict(num=1), dict(num=17),     # an int equal to 1; not a multiple of 16
               dict(offset=2 ** 40),          # a 64-bit int
               dict(negate=True),             # a constexpr
               dict(warps=8)]                 # an option
    for change in changes:
        before = len(recorder.triton_calls)
        call(**change)
        call(**change)
        assert len(recorder.triton_calls) == before + 1, change


def test_values_triton_specialises_otherwise_are_not_cached(recorder):
    """Int subclasses and tuples go through Triton's path every time; constexprs equal as values but of
    different types (1, 1.0, True) get their own compiled kernels."""
    import enum

    class Level(enum.IntEnum):
        ONE = 1
        SEVENTEEN = 17

    src = torch.zeros(8, dtype=torch.int32)
    for value in (Level.ONE, Level.SEVENTEEN, Level.ONE, (1, 2), (16, 2)):
        launcher.launch(recorder, (1,), src, src, 8, value, 0, BLOCK=8, NEGATE=False)
    assert len(recorder.triton_calls) == 5 and not recorder.runs
    for negate in (1, 1.0, True, 1, 1.0, True):
        launcher.launch(recorder, (1,), src, src, 8, 2, 0, BLOCK=8, NEGATE=negate)
    assert len(recorder.triton_calls) == 8 and len(recorder.runs) == 3
    launcher.launch(recorder, (1,), src, src, 8, 2, 0, BLOCK=8, NEGATE=[1])   # unhashable: not cached
    assert len(recorder.triton_calls) == 9


def test_pointer_keeps_its_tensor_alive():
    import gc
    import weakref
    tensor = torch.arange(16, dtype=torch.int16)
    alive = weakref.ref(tensor)
    pointer = launcher.Pointer(tensor, torch.int32)
    del tensor
    gc.collect()
    assert alive() is not None, "a deferred launch would write into freed memory"
    del pointer
    gc.collect()
    assert alive() is None


def test_hooks_and_missing_arguments_go_through_triton(recorder, monkeypatch):
    src = torch.zeros(8, dtype=torch.int32)
    launcher.launch(recorder, (1,), src, src, 8, 2, 0, BLOCK=8, NEGATE=False)
    launcher.launch(recorder, (1,), src, src, 8, 2, 0, BLOCK=8)   # NEGATE missing: Triton reports it
    assert len(recorder.triton_calls) == 2 and not recorder.runs
    monkeypatch.setattr(launcher, "_hooks_set", lambda: True)   # a profiler's launch hook
    launcher.launch(recorder, (1,), src, src, 8, 2, 0, BLOCK=8, NEGATE=False)
    assert len(recorder.triton_calls) == 3 and not recorder.runs


def test_relaunch_looks_only_at_the_varied_arguments(recorder, monkeypatch):
    import gc
    import weakref
    src = torch.arange(64, dtype=torch.int32)
    dst = torch.zeros(64, dtype=torch.int32)
    example = torch.zeros(64, dtype=torch.int32)
    alive = weakref.ref(example)
    relaunch = launcher.Relaunch(recorder, (2,), ("src_ptr", "num"), example, dst, 64, 3, 7, BLOCK=32, NEGATE=False,
                                 num_warps=4)
    del example
    gc.collect()
    assert alive() is None, "a relaunch kept the value of a varied argument given when it was made"
    pointer = launcher.Pointer(src, torch.int32)
    relaunch(pointer, 64)   # the first call of a specialisation: Triton's path, with every argument
    assert len(recorder.triton_calls) == 1 and not recorder.runs
    grid, args, kwargs = recorder.triton_calls[0]
    assert grid[0] == 2 and args[0] is pointer and args[1] is dst and args[2:] == (64, 3, 7, 32, False)
    assert kwargs == {"num_warps": 4}
    relaunch(pointer, 48)   # same specialisation (int32 multiple of 16): the kernel, fixed arguments in place
    assert len(recorder.triton_calls) == 1 and len(recorder.runs) == 1
    grid_x, grid_y, grid_z, stream, function, metadata, launch_metadata, enter, leave, *values = recorder.runs[0]
    assert (grid_x, grid_y, grid_z, stream, function, metadata) == (2, 1, 1, 1234, "function", "metadata")
    assert (launch_metadata, enter, leave) == (None, None, None)
    assert values[0] == src.data_ptr() and values[1] is dst and values[2:] == [48, 3, 7, 32, False]
    relaunch(pointer, 48, grid=(5, 2))
    assert recorder.runs[-1][:3] == (5, 2, 1)
    # each of these changes the specialisation: Triton's path once, then the relaunch's own kernel
    for changed in [(launcher.Pointer(src[1:], torch.int32), 48), (pointer, 1), (pointer, 17),
                    (launcher.Pointer(src, torch.float32), 48)]:
        before = len(recorder.triton_calls)
        relaunch(*changed)
        relaunch(*changed)
        assert len(recorder.triton_calls) == before + 1, changed
    before = len(recorder.triton_calls)
    relaunch(src, 48)   # a host tensor: the C launcher translates its address, so `launch` (compiled already)
    relaunch(src, 48)
    assert len(recorder.triton_calls) == before and recorder.runs[-1][9] is src
    monkeypatch.setattr(launcher, "_hooks_set", lambda: True)   # a profiler's launch hook
    relaunch(pointer, 48)
    assert len(recorder.triton_calls) == before + 1


def test_relaunch_needs_every_fixed_value_and_fixed_constexprs(recorder):
    dst = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(TypeError, match="no value for .'scale'"):
        launcher.Relaunch(recorder, (1,), ("src_ptr",), dst_ptr=dst, num=8, offset=0, BLOCK=8, NEGATE=False)
    with pytest.raises(TypeError, match="constexprs are fixed"):
        launcher.Relaunch(recorder, (1,), ("src_ptr", "BLOCK"), dst_ptr=dst, num=8, scale=1, offset=0, NEGATE=False)


def test_relaunch_checks_its_names_against_the_kernel(recorder):
    dst = torch.zeros(8, dtype=torch.int32)
    fixed = dict(dst_ptr=dst, num=8, scale=1, offset=0, BLOCK=8, NEGATE=False)
    launcher.Relaunch(recorder, (1,), ("src_ptr",), **fixed, num_warps=4)   # parameters and a launch option
    with pytest.raises(TypeError, match="srcptr not among its parameters"):
        launcher.Relaunch(recorder, (1,), ("srcptr",), **fixed)
    with pytest.raises(TypeError, match="src_ptr named more than once"):
        launcher.Relaunch(recorder, (1,), ("src_ptr", "src_ptr"), **fixed)
    if launcher.launch_options() is not None:   # (a Triton whose CUDA backend can say which options it takes)
        with pytest.raises(TypeError, match="dst_pointer not among its parameters"):
            launcher.Relaunch(recorder, (1,), ("src_ptr",), dst_pointer=dst, **fixed)


def test_relaunch_without_the_cache_goes_through_triton(recorder, monkeypatch):
    monkeypatch.setattr(launcher, "ENABLED", False)   # as under Triton's interpreter
    src = torch.zeros(8, dtype=torch.int32)
    relaunch = launcher.Relaunch(recorder, (1,), ("src_ptr",), dst_ptr=src, num=8, scale=1, offset=0, BLOCK=8,
                                 NEGATE=False)
    for _ in range(3):
        relaunch(launcher.Pointer(src, torch.int32))
    assert len(recorder.triton_calls) == 3 and not recorder.runs


def test_a_kernel_triton_cannot_compile_is_named_with_the_way_around_it(recorder, monkeypatch):
    src = torch.zeros(8, dtype=torch.int32)
    failures = [RuntimeError("PassManager::run failed"), TypeError("missing a required argument: 'num'")]

    def call(*args, **kwargs):
        raise failures[0]
    monkeypatch.setattr(_Recorder, "__getitem__", lambda self, grid: call)   # Triton's path fails
    expected = (r"Triton \S+ could not compile or launch the NVLink transport's kernel .*"
                r"\(RuntimeError: PassManager::run failed\); transport='reference'")
    with pytest.raises(RuntimeError, match=expected) as info:
        launcher.launch(recorder, (1,), src, src, 8, 1, 0, BLOCK=8, NEGATE=False)
    assert info.value.__cause__ is failures[0]
    failures.pop(0)   # arguments that do not bind: Triton's own error, unchanged
    with pytest.raises(TypeError, match="missing a required argument"):
        launcher.Relaunch(recorder, (1,), ("src_ptr",), dst_ptr=src, num=8, scale=1, offset=0, BLOCK=8,
                          NEGATE=False)(src)


def test_relaunch_runs_under_tritons_interpreter(tmp_path):
    """A kernel of Triton's interpreter (no `params`) relaunched on CPU tensors: Triton's own path, correct
    results."""
    import textwrap
    script = tmp_path / "interpreted.py"
    script.write_text(textwrap.dedent("""
        import torch, triton, triton.language as tl
        from deep_ep.transport.nvlink import launcher

        @triton.jit
        def double(src, dst, n, BLOCK: tl.constexpr):
            i = tl.arange(0, BLOCK)
            tl.store(dst + i, tl.load(src + i, mask=i < n) * 2, mask=i < n)

        relaunch = launcher.Relaunch(double, (1,), ("src", "dst", "n"), BLOCK=16)
        for n in (16, 5):
            src = torch.randint(-100, 100, (16,), dtype=torch.int32)
            dst = torch.zeros(16, dtype=torch.int32)
            relaunch(src, dst, n)
            assert torch.equal(dst[:n], src[:n] * 2) and not dst[n:].any(), (n, src, dst)
        print("ok")
    """))
    done = run_script(script, 120, TRITON_INTERPRET="1")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_pointer_is_a_typed_raw_address():
    words = torch.arange(16, dtype=torch.int16)
    pointer = launcher.Pointer(words, torch.int32)
    assert pointer.data_ptr() == words.data_ptr() and pointer.dtype == torch.int32
    assert launcher.Pointer(words, torch.int32, 8).data_ptr() == words.data_ptr() + 8


def _expected(src, num, scale, offset, negate):
    out = src[:num] * scale + (offset % 1000)
    return -out if negate else out


@pytest.fixture
def device():   # the GPU tests below
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
def test_launch_matches_triton_across_specialisations(device):
    for key in [key for key in launcher._compiled if key[0] == id(_scaled_copy)]:
        del launcher._compiled[key]
    seed = base_seed()
    gen = generator(seed, "launch")
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
                base.copy_(torch.randint(-1000, 1000, base.shape, generator=gen, dtype=torch.int32))
            launcher.launch(_scaled_copy, (1,), src, dst, num, scale, offset, BLOCK=1024, NEGATE=negate, num_warps=4)
            torch.cuda.synchronize(device)
            expected = _expected(src, num, scale, offset, negate)
            assert torch.equal(dst[:num], expected), (seed, round_, start, num, scale, offset, negate)
            assert torch.all(dst[num:] == -1), "wrote past num"
    keys = [key for key in launcher._compiled if key[0] == id(_scaled_copy)]
    # the launcher keeps one compiled kernel per distinct specialisation, the repeated case adds none
    assert len(keys) == len(cases) - 1 or not launcher.ENABLED


@pytest.mark.gpu
def test_relaunch_matches_triton_across_specialisations(device):
    seed = base_seed()
    gen = generator(seed, "relaunch")
    base = torch.randint(-1000, 1000, (4096 + 8,), generator=gen, dtype=torch.int32).to(device)
    relaunch = launcher.Relaunch(_scaled_copy, (1,), ("src_ptr", "dst_ptr", "num", "offset"), scale=3, BLOCK=1024,
                                 NEGATE=True, num_warps=4)
    cases = [(0, 4096, 7), (1, 4095, 7), (0, 1, 16), (3, 17, 2 ** 33 + 5), (0, 4096, 7)]   # (start, num, offset)
    for round_ in range(2):   # the second round finds every specialisation compiled
        for start, num, offset in cases:
            base.copy_(torch.randint(-1000, 1000, base.shape, generator=gen, dtype=torch.int32))
            src = base[start:]
            dst = torch.full((num + 8,), -1, dtype=torch.int32, device=device)[start % 4:]
            relaunch(src, dst, num, offset)
            torch.cuda.synchronize(device)
            assert torch.equal(dst[:num], _expected(src, num, 3, offset, True)), (seed, round_, start, num, offset)
            assert torch.all(dst[num:] == -1), "wrote past num"
    assert len(relaunch.kernels) == len(cases) - 1 or not launcher.ENABLED


@pytest.mark.gpu
def test_launch_by_keywords_and_in_a_cuda_graph(device):
    launch = launcher.launch
    seed = base_seed()
    gen = generator(seed, "keywords")
    src = torch.randint(-50, 50, (300,), generator=gen, dtype=torch.int32).to(device)
    dst = torch.zeros(300, dtype=torch.int32, device=device)
    kwargs = dict(src_ptr=src, dst_ptr=dst, num=300, scale=-2, offset=9, BLOCK=128, NEGATE=False)
    launch(_scaled_copy, (1,), **kwargs, num_warps=4)
    launch(_scaled_copy, (1,), **kwargs, num_warps=4)
    torch.cuda.synchronize(device)
    assert torch.equal(dst, src * -2 + 9), seed
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            launch(_scaled_copy, (1,), **kwargs, num_warps=4)
    for replay in range(3):
        src.copy_(torch.randint(-50, 50, (300,), generator=gen, dtype=torch.int32))
        dst.zero_()
        graph.replay()
        torch.cuda.synchronize(device)
        assert torch.equal(dst, src * -2 + 9), (seed, replay)


@pytest.mark.gpu
def test_launch_with_a_hook_goes_through_triton(device):
    launch = launcher.launch
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


def test_a_direct_launch_passes_what_tritons_launcher_wrapper_passes(monkeypatch):
    """`_direct` calls Triton's C launch without the Python wrapper (`compiled_kernel.run`) where that wrapper
    only forwards: the C launch must get exactly the arguments the installed Triton's wrapper gives it (a new
    Triton whose wrapper passes other arguments must fail here, not launch wrongly)."""
    from triton.backends.nvidia.driver import CudaLauncher
    monkeypatch.setattr(triton.runtime.driver, "_active", object(), raising=False)   # (no GPU driver needed)
    received = []
    wrapper = object.__new__(CudaLauncher)   # a compiled kernel's launcher, its C launch recorded
    settings = dict(launch=lambda *args: received.append(args), global_scratch_size=0, global_scratch_align=1,
                    profile_scratch_size=0, profile_scratch_align=1, num_ctas=1, launch_cooperative_grid=False,
                    launch_pdl=True, gsan_enabled=False, arg_annotations=("annotations",), kernel_signature=b"sig")
    for name, value in settings.items():
        setattr(wrapper, name, value)

    class Compiled:
        run, function, packed_metadata = wrapper, 0xF00, (4, 1, 0)

    args = (0x7000, 3, 2 ** 40, None)
    wrapper(2, 1, 1, 1234, Compiled.function, Compiled.packed_metadata, None, None, None, *args)   # Triton's way
    function, head, as_tuple, _ = launcher._direct(Compiled)
    assert function is wrapper.launch, "the wrapper forwards only, but _direct does not know its form"
    function(2, 1, 1, 1234, *head, args) if as_tuple else function(2, 1, 1, 1234, *head, *args)
    assert len(received) == 2 and received[1] == received[0]
    # a wrapper with work to do (scratch memory) is called as it is
    wrapper.global_scratch_size = 64
    function, head, _, _ = launcher._direct(Compiled)
    assert function is wrapper and head == (0xF00, (4, 1, 0), None, None, None)
