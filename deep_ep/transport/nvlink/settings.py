"""The NVLink transport's protocol choices that are still open questions, one environment variable each.

Each selects between two paths that both pass the tests; a measurement on several GPUs is planned to choose
between them (benchmarks/README.md lists the questions), after which the losing path and its variable go.
They are read once, at import; tests that force a path set the attribute in the rank's process before its
Buffer is built. Every rank must use the same values (the transport checks at construction).
"""
from __future__ import annotations

from ...checks import flag_setting, int_setting

# normal mode: the direct protocol (every row pushed straight to its final slot) where a call's largest share
# fits the buffer whole; off: always the rings
DIRECT: bool = bool(flag_setting("DEEP_EP_NVLINK_DIRECT", True))
# direct protocol: tokens a program pushes between two looks at what has arrived; 0: all of them first
STAGE_TOKENS: int = int_setting("DEEP_EP_NVLINK_STAGE_TOKENS", 0, minimum=0, maximum=1 << 30)
# low-latency mode: one kernel that sends and then receives, for calls of few tokens without a receive hook
LL_FUSED: bool = bool(flag_setting("DEEP_EP_LL_FUSED", True))
