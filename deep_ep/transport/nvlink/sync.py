"""Flags between ranks: epoch-valued int64 words, written with release stores and read with acquire loads
at system scope, and bounded spins.

Every operation of the Buffer takes the next value `e` of a device-resident epoch counter (so that a
CUDA graph replay advances it too). A flag holds the epoch of the last operation that raised it and only
grows, so nothing is ever reset. A wait gives up after `timeout_ns`: it records (code, peer) in the
host-visible status words and returns False; the host turns that into an error naming rank and peer.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

# status codes (status[0]); status[1] holds the peer
WAIT_NOTIFY = tl.constexpr(1)
WAIT_DATA = tl.constexpr(2)
WAIT_CONSUMED = tl.constexpr(3)
STATUS_WHAT = {1: "its dispatch counts (notify)", 2: "its rows", 3: "it to finish reading the previous operation's rows"}


@triton.jit
def fence_sys():
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_flag(flag_ptr, target, timeout_ns, status_ptr, code, peer):
    """Spin until the int64 flag at `flag_ptr` is >= target; False (and status set) on timeout."""
    start = globaltimer()
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    waiting = value < target
    while waiting:
        value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        waiting = (value < target) & ((globaltimer() - start) < timeout_ns)
    ok = value >= target
    if not ok:
        if tl.atomic_cas(status_ptr, 0, code, sem="relaxed", scope="sys") == 0:
            tl.atomic_xchg(status_ptr + 1, peer, sem="relaxed", scope="sys")
    return ok


@triton.jit
def wait_all_peers(flags_ptr, target, timeout_ns, status_ptr, code, R: tl.constexpr):
    """Wait until the flag slot of every peer (flags_ptr[0..R)) is >= target; False if any timed out."""
    ready = True
    for peer in tl.static_range(R):
        ready = ready & wait_flag(flags_ptr + peer, target, timeout_ns, status_ptr, code, peer)
    return ready


@triton.jit
def signal_peers_kernel(bases_ptr, flag_word, epoch_ptr, rank):
    """Program d raises this rank's flag slot `flag_word + rank` (int64 words) in rank d's buffer to the
    current epoch, after everything this rank stored before (stream order + system fence)."""
    dest = tl.program_id(0)
    epoch = tl.load(epoch_ptr)
    fence_sys()
    base = tl.load(bases_ptr + dest).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(base + flag_word + rank, epoch, sem="release", scope="sys")
