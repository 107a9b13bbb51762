"""Local work around the notify of a non-cached dispatch (no communication): it replaces dozens of small
torch operations, whose launch cost would dominate the dispatch.

prepare_kernel (R + 1 programs), before the notify:
  program d < R: before[t, d] = tokens before t that go to rank d (exclusive prefix over is_token_in_rank),
    send_head[t, d] = before[t, d] or -1, channel_counts[d, q], and mismatch[d] = 1 when
    num_tokens_per_rank[d] is not the column sum;
  program R: checks = (flags: 1 = an id of the last layouts out of range, 2 = an id of topk_idx out of
    range, 8 = this rank does not wait for the counts (num_worst_tokens); smallest id; largest id; an
    offending layout id), and advances the notify epoch.
plan_tables (run by the notify kernel's last program, once every record arrived): from the received records,
  where every received row goes (prefix, recv_count, recv_base), where this rank's rows go in the direct
  protocol, the handle's matrices, and, where the host waits (ticket > 0), the payload and then the ticket in
  the host's mailbox (mailbox.py).
"""
import triton
import triton.language as tl


@triton.jit
def prepare_kernel(in_rank_ptr, per_rank_ptr, idx_ptr, layout_bad_ptr, before_ptr, send_head_ptr,
                   channel_counts_ptr, mismatch_ptr, checks_ptr, epoch_ptr, num_tokens, num_ids, num_experts, C,
                   no_wait, R: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_IDS: tl.constexpr):
    d = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if d < R:
        carry = tl.zeros([], tl.int32)
        tl.store(before_ptr + d, 0)
        for first in range(0, num_tokens, BLOCK):
            t = first + offs
            live = t < num_tokens
            hit = (tl.load(in_rank_ptr + t.to(tl.int64) * R + d, mask=live, other=0) != 0).to(tl.int32)
            inclusive = tl.cumsum(hit, axis=0) + carry
            tl.store(before_ptr + (t.to(tl.int64) + 1) * R + d, inclusive, mask=live)
            tl.store(send_head_ptr + t.to(tl.int64) * R + d, tl.where(hit != 0, inclusive - 1, -1), mask=live)
            carry += tl.sum(hit, axis=0)
        tl.store(mismatch_ptr + d, (carry != tl.load(per_rank_ptr + d)).to(tl.int64))
        tl.debug_barrier()
        q = tl.arange(0, BLOCK_C)
        per_channel = tl.maximum(tl.cdiv(num_tokens, C), 1)
        starts = tl.minimum(q * per_channel, num_tokens)
        ends = tl.minimum(starts + per_channel, num_tokens)
        counts = (tl.load(before_ptr + ends.to(tl.int64) * R + d, mask=q < C, other=0)
                  - tl.load(before_ptr + starts.to(tl.int64) * R + d, mask=q < C, other=0))
        tl.store(channel_counts_ptr + d * C + q, counts, mask=q < C)
    else:
        low = tl.full([], 0, tl.int64)
        high = tl.full([], 0, tl.int64)
        if num_ids > 0:
            low = tl.full([], 1 << 62, tl.int64)
            high = tl.full([], -(1 << 62), tl.int64)
        ids_offs = tl.arange(0, BLOCK_IDS)   # wide steps: each step's min/max waits for its loads
        for first in range(0, num_ids, BLOCK_IDS):
            i = first + ids_offs
            ids = tl.load(idx_ptr + i, mask=i < num_ids, other=0)
            low = tl.minimum(low, tl.min(tl.where(i < num_ids, ids, 1 << 62), axis=0))
            high = tl.maximum(high, tl.max(tl.where(i < num_ids, ids, -(1 << 62)), axis=0))
        layout_bad = tl.load(layout_bad_ptr)
        flags = ((layout_bad > 0).to(tl.int64) + 2 * ((low < -1) | (high >= num_experts)).to(tl.int64)
                 + 8 * no_wait)
        tl.store(checks_ptr, flags)
        tl.store(checks_ptr + 1, low)
        tl.store(checks_ptr + 2, high)
        tl.store(checks_ptr + 3, tl.load(layout_bad_ptr + 1))
        tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)


@triton.jit
def plan_tables(received_ptr, channel_counts_ptr, prefix_ptr, recv_count_ptr, recv_base_ptr, rank_prefix_ptr,
                channel_prefix_ptr, recv_channel_prefix_ptr, push_row0_ptr, combine_row0_ptr, mailbox_ptr, checks_ptr,
                ticket, rank, experts_per_rank, expert_alignment, REC: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    """Record of source s (received[s]): [signature | flags | tokens per destination (R) | its tokens per
    expert of this rank (E_loc) | its tokens for this rank per channel (C)]."""
    rs = tl.arange(0, BLOCK_R)
    rd = tl.arange(0, BLOCK_R)
    qs = tl.arange(0, BLOCK_C)
    es = tl.arange(0, BLOCK_E)
    rmask = rs < R
    # rank_prefix_matrix[s, d] = sum over s' <= s of tokens s' sends to d
    sent = tl.load(received_ptr + rs[:, None] * REC + 2 + rd[None, :], mask=rmask[:, None] & (rd[None, :] < R), other=0)
    rank_prefix = tl.cumsum(sent, axis=0)
    tl.store(rank_prefix_ptr + rs[:, None] * R + rd[None, :], rank_prefix, mask=rmask[:, None] & (rd[None, :] < R))
    mine = tl.sum(tl.where(rd[None, :] == rank, sent, 0), axis=1)          # [R] rows from each source
    # the direct protocol (direct.py): this rank's first row in each destination's outputs, and its first
    # slot in each source's combine area (after the rows that source sent to ranks before this one)
    tl.store(push_row0_ptr + rd, tl.sum(tl.where(rs[:, None] < rank, sent, 0), axis=0), mask=rd < R)
    tl.store(combine_row0_ptr + rs, tl.sum(tl.where(rd[None, :] < rank, sent, 0), axis=1), mask=rmask)
    inclusive = tl.cumsum(mine, axis=0)
    tl.store(prefix_ptr + 1 + rs, inclusive, mask=rmask)
    tl.store(prefix_ptr, 0)
    # per (source, channel): counts, exclusive prefix within the source, first output row
    cmask = rmask[:, None] & (qs[None, :] < C)
    counts = tl.load(received_ptr + rs[:, None] * REC + 2 + R + experts_per_rank + qs[None, :], mask=cmask,
                     other=0)
    exclusive = tl.cumsum(counts, axis=1) - counts
    tl.store(recv_count_ptr + rs[:, None] * C + qs[None, :], counts, mask=cmask)
    tl.store(recv_channel_prefix_ptr + rs[:, None] * C + qs[None, :], exclusive, mask=cmask)
    tl.store(recv_base_ptr + rs[:, None] * C + qs[None, :], (inclusive - mine)[:, None] + exclusive, mask=cmask)
    # this rank's channel_prefix_matrix [destination, channel], inclusive
    own = tl.load(channel_counts_ptr + rs[:, None] * C + qs[None, :], mask=cmask, other=0)
    tl.store(channel_prefix_ptr + rs[:, None] * C + qs[None, :], tl.cumsum(own, axis=1), mask=cmask)
    if ticket > 0:
        _post_counts(mailbox_ptr, ticket, received_ptr, checks_ptr, sent, mine, rs, es, rmask, experts_per_rank,
                     expert_alignment, REC, R)


@triton.jit
def _post_counts(mailbox_ptr, ticket, received_ptr, checks_ptr, sent, mine, rs, es, rmask, experts_per_rank,
                 expert_alignment, REC: tl.constexpr, R: tl.constexpr):
    """The host payload (int64; its layout is mailbox.Counts') after the mailbox's ticket word, then the
    ticket, released to the host."""
    payload_ptr = mailbox_ptr + 1
    emask = es < experts_per_rank
    per_expert = tl.sum(tl.load(received_ptr + rs[:, None] * REC + 2 + R + es[None, :],
                                mask=rmask[:, None] & emask[None, :],
                                other=0), axis=0)
    aligned = (per_expert + expert_alignment - 1) // expert_alignment * expert_alignment
    tl.store(payload_ptr, tl.sum(mine, axis=0).to(tl.int64))
    tl.store(payload_ptr + 1 + es, aligned.to(tl.int64), mask=emask)
    tail = payload_ptr + 1 + experts_per_rank
    signatures = tl.load(received_ptr + rs * REC, mask=rmask, other=0)
    flags = tl.load(received_ptr + rs * REC + 1, mask=rmask, other=0)
    tl.store(tail + rs, signatures.to(tl.int64), mask=rmask)
    tl.store(tail + R + rs, flags.to(tl.int64), mask=rmask)
    four = tl.arange(0, 4)
    tl.store(tail + 2 * R + four, tl.load(checks_ptr + four))
    tl.store(tail + 2 * R + 4, tl.max(tl.sum(sent, axis=0), axis=0).to(tl.int64))
    tl.store(tail + 2 * R + 5, tl.max(tl.sum(sent, axis=1), axis=0).to(tl.int64))
    tl.debug_barrier()   # every thread's payload stores before the ticket's release (system scope: the host)
    tl.atomic_xchg(mailbox_ptr, ticket, sem="release", scope="sys")
