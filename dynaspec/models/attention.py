"""Paged attention over a flat KV cache, for a varlen batch of sequences.

Every scheduled token of a step is one row of a flat batch ``[num_tokens, ...]``. Each sequence
contributes ``q_len`` new tokens at the end of a context of ``ctx_len`` tokens whose K/V live in
cache slots named by its block table. Two implementations:
- row-wise (CPU, when the C++ kernels build: csrc/attention.cpp): each query row attends to its
  own sequence's keys in place, in a fixed order, so its result does not depend on the batch
  (batch invariance: speculative verification gives the same numbers as plain decoding);
- grouped (elsewhere): sequences are grouped by similar ``q_len`` (decodes with their drafts
  together, each prefill chunk alone) so padding stays small, and a group runs as one batched
  scaled-dot-product attention over gathered K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# Sequences whose q_len is at most this are batched together (decode + drafts); longer
# ones (prefill chunks) each form their own group.
SHORT_QUERY_MAX = 16
# A windowed model (a drafter with ``draft_context_window``) keeps the context's first tokens in
# view: attention leans on them (StreamingLLM's attention sinks).
SINK_TOKENS = 4


@dataclass(slots=True)
class AttentionGroup:
    token_index: torch.Tensor  # [b * q_max] int64 row in the flat batch; padding points at row 0
    valid_index: torch.Tensor  # [valid tokens] int64 positions in [b * q_max] that are real queries
    kv_slots: torch.Tensor  # [b * c_max] int64 cache slot of each context position; padding -> 0
    mask: torch.Tensor  # [b, 1, q_max, c_max] bool, True where the query may attend
    batch: int
    q_max: int
    c_max: int


@dataclass(slots=True)
class RowwisePlan:
    slot_table: torch.Tensor  # [num_seqs, c_max] int64 cache slot of each context position; padding -> 0
    row_seq: torch.Tensor  # [num_tokens] int64 sequence of each row
    row_len: torch.Tensor  # [num_tokens] int64 keys each row sees (its position + 1)


@dataclass(slots=True)
class DecodeMetadata:
    """Attention for a step of fixed shape: ``b`` sequences of ``query_len`` new tokens each, laid out
    row by row (sequence i's tokens are rows i * query_len ..), every tensor on the device and of a
    size fixed by (b, query_len), so the pass can be captured as a CUDA graph and replayed."""

    slot_mapping: torch.Tensor  # [b * query_len] int64 cache slot of each new token; -1: not written
    block_table: torch.Tensor  # [b, max_blocks] int32 cache blocks of each sequence
    seq_lens: torch.Tensor  # [b] int32 tokens of each sequence's context, its new ones included
    query_len: int
    block_size: int
    window: int | None = None  # a drafter's draft_context_window (attention sinks + the last window)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot each new token's K/V is written to
    groups: list[AttentionGroup]  # empty when rowwise is set
    out_index: (
        torch.Tensor | None
    )  # [num_tokens] int64 row of each token in the concatenated valid group outputs
    rowwise: RowwisePlan | None = None


def build_attention_metadata(
    q_lens: list[int],
    ctx_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    rowwise: bool = False,
    window: int | None = None,
    batch_prefills: bool | None = None,
) -> AttentionMetadata:
    """Plan attention for sequences whose new tokens are laid out back to back in the flat batch.

    ``ctx_lens[i]`` counts the sequence's tokens including its ``q_lens[i]`` new ones. With
    ``window``, a token at position p sees only the first ``SINK_TOKENS`` positions and the last
    ``window`` up to itself (p - window < key <= p), a sliding window whose cost stays flat as the
    context grows. Built with numpy on the host (small arrays: torch's per-op overhead dominated
    here), copied once. ``batch_prefills`` (default: on CUDA) groups alike prefill chunks into one
    batched call each (``_alike``) instead of one call per chunk.
    """
    slots = [_slots(table, block_size, c) for c, table in zip(ctx_lens, block_tables)]  # [c] each
    slot_mapping = np.concatenate([s[c - q :] for s, q, c in zip(slots, q_lens, ctx_lens)])
    if rowwise:
        arrays = _rowwise_tables(slots, q_lens, ctx_lens, window)
        plan = RowwisePlan(*(torch.from_numpy(a).to(device) for a in arrays))
        return AttentionMetadata(torch.from_numpy(slot_mapping).to(device), [], None, plan)

    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int64)
    total = int(sum(q_lens))

    short = [i for i, q in enumerate(q_lens) if q <= SHORT_QUERY_MAX]
    long = [i for i, q in enumerate(q_lens) if q > SHORT_QUERY_MAX]
    if batch_prefills is None:
        batch_prefills = device.type == "cuda"  # there a call per prefill chunk would dominate
    if batch_prefills:
        member_lists = ([short] if short else []) + _alike(long, q_lens, ctx_lens)
    else:
        member_lists = ([short] if short else []) + [[i] for i in long]

    groups = []
    order = []  # flat rows in the order group outputs are concatenated
    for members in member_lists:
        q_max = max(q_lens[i] for i in members)
        c_max = max(ctx_lens[i] for i in members)
        b = len(members)
        token_index = np.zeros((b, q_max), dtype=np.int64)
        query_valid = np.zeros((b, q_max), dtype=bool)
        kv_slots = np.zeros((b, c_max), dtype=np.int64)
        mask = np.zeros((b, 1, q_max, c_max), dtype=bool)
        key_pos = np.arange(c_max)
        for row, i in enumerate(members):
            q, c = q_lens[i], ctx_lens[i]
            rows = np.arange(starts[i], starts[i] + q)
            token_index[row, :q] = rows
            query_valid[row, :q] = True
            kv_slots[row, :c] = slots[i]
            # query j sits at position c - q + j and sees keys 0..c - q + j
            query_pos = np.arange(c - q, c)[:, None]
            mask[row, 0, :q] = key_pos[None, :] <= query_pos
            if window is not None:  # ... of which the sinks and the last `window`
                mask[row, 0, :q] &= (key_pos[None, :] < SINK_TOKENS) | (key_pos[None, :] > query_pos - window)
            order.append(rows)
        # padded query rows attend to key 0 so softmax stays finite; their output is dropped
        mask[:, 0, :, 0] |= ~query_valid
        groups.append(
            AttentionGroup(
                token_index=torch.from_numpy(token_index.reshape(-1)).to(device),
                valid_index=torch.from_numpy(np.flatnonzero(query_valid)).to(device),
                kv_slots=torch.from_numpy(kv_slots.reshape(-1)).to(device),
                mask=torch.from_numpy(mask).to(device),
                batch=b,
                q_max=q_max,
                c_max=c_max,
            )
        )
    out_index = np.empty(total, dtype=np.int64)
    out_index[np.concatenate(order)] = np.arange(total)
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        groups=groups,
        out_index=torch.from_numpy(out_index).to(device),
    )


LONG_GROUP_ELEMENTS = 1 << 22  # a batched group of prefill chunks: at most this many (query, key) pairs


def _alike(members: list[int], q_lens: list[int], ctx_lens: list[int]) -> list[list[int]]:
    """Prefill chunks in groups of alike shapes (queries and contexts within 2x of the group's
    first), so a burst of prompts attends in a few batched calls with little padding."""
    groups: list[list[int]] = []
    for i in sorted(members, key=lambda i: (q_lens[i], ctx_lens[i])):
        if groups:
            first, group = groups[-1][0], groups[-1]
            q_max, c_max = q_lens[i], max(ctx_lens[i], max(ctx_lens[j] for j in group))
            alike = q_lens[i] <= 2 * q_lens[first] and c_max <= 2 * min(ctx_lens[j] for j in group + [i])
            if alike and (len(group) + 1) * q_max * c_max <= LONG_GROUP_ELEMENTS:
                group.append(i)
                continue
        groups.append([i])
    return groups


def _rowwise_tables(
    slots: list[np.ndarray], q_lens: list[int], ctx_lens: list[int], window: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slot table, row_seq, row_len) of the row-wise plan. A sequence shares one table row among
    its rows; one that a sliding window cuts gets a table row per query row instead (its sinks,
    then its last ``window`` keys up to that row), so each row reads only what it sees."""
    tables: list[np.ndarray] = []
    row_seq: list[int] = []
    row_len: list[int] = []
    for s, q, c in zip(slots, q_lens, ctx_lens):
        if window is None or c <= SINK_TOKENS + window:
            tables.append(s)
            row_seq += [len(tables) - 1] * q
            row_len += range(c - q + 1, c + 1)
            continue
        for p in range(c - q, c):  # the row at position p
            lo = max(SINK_TOKENS, p + 1 - window)
            tables.append(np.concatenate([s[: min(SINK_TOKENS, p + 1)], s[lo : p + 1]]))
            row_seq.append(len(tables) - 1)
            row_len.append(len(tables[-1]))
    table = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    return table, np.asarray(row_seq, dtype=np.int64), np.asarray(row_len, dtype=np.int64)


def _slots(
    block_table: list[int], block_size: int, end: int
) -> np.ndarray:  # [end] cache slot of positions 0..end-1
    pos = np.arange(end)
    return np.asarray(block_table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write the new K/V into the cache, then attend each new token to its sequence's context.

    Gathers use index_select: advanced indexing on a large cache is ~300x slower on CPU.
    """
    plan = meta.rowwise
    if plan is not None and k.dtype == v.dtype == torch.float32 and k.stride(-1) == v.stride(-1) == 1:
        torch.ops.dynaspec.kv_write_(k_cache, v_cache, k, v, meta.slot_mapping)
    else:
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    if plan is not None:
        out = torch.ops.dynaspec.paged_attention_rows(
            q.float().contiguous(),
            k_cache,
            v_cache,
            plan.slot_table,
            plan.row_seq,
            plan.row_len,
            q.shape[-1] ** -0.5,
        )
        return out.to(q.dtype)
    outputs = []
    for g in meta.groups:
        b, q_max, c_max = g.batch, g.q_max, g.c_max
        qg = q.index_select(0, g.token_index).view(b, q_max, *q.shape[1:]).transpose(1, 2)
        kg = k_cache.index_select(0, g.kv_slots).view(b, c_max, *k_cache.shape[1:]).transpose(1, 2)
        vg = v_cache.index_select(0, g.kv_slots).view(b, c_max, *v_cache.shape[1:]).transpose(1, 2)
        if q_max <= SHORT_QUERY_MAX:
            out = _short_query_attention(qg, kg, vg, g.mask)
        else:
            kg, vg = kg.to(q.dtype), vg.to(q.dtype)  # a float32 query over a bfloat16 cache
            out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b * q_max, *q.shape[1:])
        outputs.append(out.index_select(0, g.valid_index))  # [valid_tokens, heads, head_dim]
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out.index_select(0, meta.out_index)


def _short_query_attention(
    q: torch.Tensor,  # [b, heads, q_max, head_dim]
    k: torch.Tensor,  # [b, kv_heads, c_max, head_dim]
    v: torch.Tensor,  # [b, kv_heads, c_max, head_dim]
    mask: torch.Tensor,  # [b, 1, q_max, c_max] bool
) -> torch.Tensor:  # [b, heads, q_max, head_dim]
    """Decode/verify attention as two batched float32 matmuls.

    For a few queries per sequence this beats the CPU flash kernel (which parallelises over query
    blocks) by ~2x; float32 also avoids the slow bf16 elementwise path of the softmax.
    """
    b, heads, q_max, head_dim = q.shape
    kv_heads, c_max = k.shape[1], k.shape[2]
    group = heads // kv_heads
    qf = q.float().reshape(b, kv_heads, group * q_max, head_dim)
    scores = qf @ k.float().transpose(-1, -2) * head_dim**-0.5  # [b, kv_heads, group * q_max, c_max]
    scores = scores.view(b, kv_heads, group, q_max, c_max).masked_fill(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(-1).view(b, kv_heads, group * q_max, c_max)
    out = (probs @ v.float()).view(b, heads, q_max, head_dim)
    return out.to(q.dtype)
