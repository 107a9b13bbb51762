"""Performance configuration of the normal (high-throughput) kernels, with DeepEP's buffer size hints."""
from __future__ import annotations

import functools

import torch

# Integer dtype of every `topk_idx` argument (DeepEP's default build).
topk_idx_t: torch.dtype = torch.int64

# DeepEP's fixed node width: its size-hint formulas assume 8 GPUs per node.
NUM_MAX_NVL_PEERS = 8


def _round_up(value: int, unit: int) -> int:
    return (value + unit - 1) // unit * unit


class Config:
    """Tuning knobs of `dispatch` / `combine`.

    Args:
        num_sms: programs (SMs) the normal kernels may occupy; must be even when used by a kernel.
            It also fixes the number of channels `num_sms // 2`, which shapes the handle matrices.
        num_max_nvl_chunked_send_tokens: DeepEP's tokens per step into an NVLink ring.
        num_max_nvl_chunked_recv_tokens: DeepEP's NVLink ring capacity in tokens, per (channel, peer);
            here it sets the smallest `num_nvl_bytes` a call accepts and the size hint.
        num_max_rdma_chunked_send_tokens: DeepEP's tokens per RDMA write.
        num_max_rdma_chunked_recv_tokens: DeepEP's RDMA ring capacity per (channel, peer node); rounded up
            to a multiple of `num_max_rdma_chunked_send_tokens`, as DeepEP does.
        The chunk sizes are checked as DeepEP checks them and size the buffer hints; this library's
        kernels choose their own steps (the NVLink rings fill whatever `num_nvl_bytes` holds).

    Raises:
        TypeError: when a value is not an int.
        ValueError: when a value breaks DeepEP's constructor rules (the message names it).
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = dict(num_sms=num_sms, num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Config: {name} must be an int, got {type(value).__name__}")
        if num_sms < 0:
            raise ValueError(f"Config: num_sms must be >= 0, got {num_sms}")
        for name in ("num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            if values[name] <= 0:
                raise ValueError(f"Config: {name} must be > 0, got {values[name]}")
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            raise ValueError("Config: num_max_nvl_chunked_send_tokens must be < num_max_nvl_chunked_recv_tokens, "
                             f"got {num_max_nvl_chunked_send_tokens} >= {num_max_nvl_chunked_recv_tokens}")
        rdma_recv = _round_up(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        if num_max_rdma_chunked_send_tokens > rdma_recv // 2:
            raise ValueError("Config: num_max_rdma_chunked_send_tokens must be <= half of "
                             f"num_max_rdma_chunked_recv_tokens (rounded up to {rdma_recv}), "
                             f"got {num_max_rdma_chunked_send_tokens}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    @property
    def num_channels(self) -> int:
        """Channels of the normal kernels (`num_sms // 2`); the column count of the handle matrices."""
        return self.num_sms // 2

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """The `num_nvl_bytes` DeepEP needs for this config (DeepEP's formula); every call with this config and
        rows of at most `hidden_bytes` accepts a buffer of that size.

        Args:
            hidden_bytes: bytes of a token's row, `hidden * max(element size, 2)`.
            num_ranks: the group size.

        Returns the size in bytes, a multiple of 128."""
        _check_positive("hidden_bytes", hidden_bytes)
        _check_positive("num_ranks", num_ranks)
        num_rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        num_nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        channels, ring = self.num_channels, self.num_max_nvl_chunked_recv_tokens
        idx_bytes = topk_idx_t.itemsize
        source_meta_bytes = 8
        slots = channels * num_nvl_ranks * ring
        total = (channels * num_nvl_ranks * (2 * num_rdma_ranks + 3) * 4
                 + slots * hidden_bytes
                 + slots * source_meta_bytes
                 + slots * 128 * idx_bytes
                 + slots * 128 * 4
                 + slots * 128 * 4)
        return _round_up(total, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """The `num_rdma_bytes` DeepEP's normal internode kernels need for this config (DeepEP's formula; this
        library needs none for normal mode).

        Args:
            hidden_bytes: bytes of a token's row, `hidden * max(element size, 2)`.
            num_ranks: the group size.

        Returns the size in bytes, a multiple of 128 (0 for up to 8 ranks, DeepEP's node)."""
        _check_positive("hidden_bytes", hidden_bytes)
        _check_positive("num_ranks", num_ranks)
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        num_rdma_ranks = -(-num_ranks // NUM_MAX_NVL_PEERS)
        channels, ring = self.num_channels, self.num_max_rdma_chunked_recv_tokens
        idx_bytes = topk_idx_t.itemsize
        slots = channels * num_rdma_ranks * ring
        total = (channels * num_rdma_ranks * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
                 + slots * hidden_bytes * 2
                 + slots * 8 * 2
                 + slots * 128 * idx_bytes * 2
                 + slots * 128 * 4 * 2
                 + slots * 128 * 4 * 2
                 + slots * 16 * 2)
        return _round_up(total, 128)


def nvl_bytes_needed(config: Config, row_bytes: int, num_ranks: int, ranks_per_node: int, num_experts: int = 0) -> int:
    """The smallest `num_nvl_bytes` a dispatch or combine accepts, DeepEP's rule: the count exchange, or one
    ring of `num_max_nvl_chunked_recv_tokens` rows of `row_bytes` per (channel, NVLink peer) with its
    counters. DeepEP's node has at most 8 peers (the size hint's count); a larger node of this library
    (more ranks on one host) needs no more: a smaller buffer moves the rows in more rounds."""
    peers, channels = min(ranks_per_node, NUM_MAX_NVL_PEERS), config.num_channels
    ring = channels * peers * config.num_max_nvl_chunked_recv_tokens * row_bytes
    return max(num_ranks * (num_ranks + num_experts // num_ranks) * 4,
               peers * peers * 4 + 4 * channels * peers * 4 + ring)


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# DeepEP's tuned (nvl_send, nvl_recv, rdma_send, rdma_recv) per rank count.
_DISPATCH_TABLE = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}
_COMBINE_TABLE = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}


def _tuned_config(table: dict, num_ranks: int, num_sms: int) -> Config:
    """The `Config` of `table` for `num_ranks` at `num_sms`. No whitelist: a rank count DeepEP never tuned gets
    the entry of the nearest tuned count above it (above the largest, the largest's)."""
    _check_positive("num_ranks", num_ranks)
    known = next((count for count in sorted(table) if count >= num_ranks), max(table))
    return Config(num_sms, *table[known])


def default_dispatch_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's tuned dispatch `Config` for `num_ranks` at `num_sms` (`_tuned_config`)."""
    return _tuned_config(_DISPATCH_TABLE, num_ranks, num_sms)


def default_combine_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's tuned combine `Config` for `num_ranks` at `num_sms` (`_tuned_config`)."""
    return _tuned_config(_COMBINE_TABLE, num_ranks, num_sms)


def low_latency_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """DeepEP's `get_low_latency_rdma_size_hint`: bytes of the double-buffered low-latency area."""
    _check_positive("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
    _check_positive("hidden", hidden)
    _check_positive("num_experts", num_experts)
    layout = LowLatencyLayout(num_max_dispatch_tokens_per_rank, hidden, num_experts)
    return (layout.total_bytes + 128) // 128 * 128


@functools.lru_cache(maxsize=64)
def low_latency_area_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> int:
    """Bytes a low-latency call with these sizes needs (DeepEP's layout total; looked up on every call)."""
    return LowLatencyLayout(num_max_dispatch_tokens_per_rank, hidden, num_experts).total_bytes


class LowLatencyLayout:
    """Byte layout `[signal0][signal1][send0][send1][recv0][recv1]` of the low-latency area (DeepEP's)."""

    def __init__(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        n, num_scales = num_max_dispatch_tokens_per_rank, hidden // 128
        dispatch_msg = 16 + max(2 * hidden, hidden + 4 * num_scales)
        combine_msg = 4 * num_scales + 2 * hidden
        self.send_bytes = _round_up(max(n * dispatch_msg, num_experts * n * combine_msg), 16)
        self.recv_bytes = _round_up(max(num_experts * n * dispatch_msg, num_experts * n * combine_msg), 16)
        self.signal_bytes = _round_up(4 * num_experts, 128)
        self.total_bytes = 2 * (self.send_bytes + self.recv_bytes + self.signal_bytes)

    def signal_offset(self, half: int) -> int:
        return half * self.signal_bytes

    def send_offset(self, half: int) -> int:
        return 2 * self.signal_bytes + half * self.send_bytes

    def recv_offset(self, half: int) -> int:
        return 2 * (self.signal_bytes + self.send_bytes) + half * self.recv_bytes
