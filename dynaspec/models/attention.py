"""Paged attention over a flat KV cache, for a varlen batch of sequences.

Every scheduled token of a step is one row of a flat batch ``[num_tokens, ...]``. Each sequence
contributes ``q_len`` new tokens at the end of a context of ``ctx_len`` tokens whose K/V live in
cache slots named by its block table. Sequences are grouped by similar ``q_len`` (decodes with
their drafts together, each prefill chunk alone) so padding stays small; a group runs as one
batched scaled-dot-product attention over gathered K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Sequences whose q_len is at most this are batched together (decode + drafts); longer
# ones (prefill chunks) each form their own group.
SHORT_QUERY_MAX = 16


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
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot each new token's K/V is written to
    groups: list[AttentionGroup]
    out_index: torch.Tensor  # [num_tokens] int64 row of each token in the concatenated valid group outputs


def build_attention_metadata(
    q_lens: list[int],
    ctx_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Plan attention for sequences whose new tokens are laid out back to back in the flat batch.

    ``ctx_lens[i]`` counts the sequence's tokens including its ``q_lens[i]`` new ones.
    """
    starts = []
    total = 0
    for q in q_lens:
        starts.append(total)
        total += q
    slot_mapping = []
    for q, c, table in zip(q_lens, ctx_lens, block_tables):
        slot_mapping.extend(_slots(table, block_size, c - q, c))

    short = [i for i, q in enumerate(q_lens) if q <= SHORT_QUERY_MAX]
    long = [i for i, q in enumerate(q_lens) if q > SHORT_QUERY_MAX]
    member_lists = ([short] if short else []) + [[i] for i in long]

    groups = []
    order = []  # flat rows in the order group outputs are concatenated
    for members in member_lists:
        q_max = max(q_lens[i] for i in members)
        c_max = max(ctx_lens[i] for i in members)
        token_index = torch.zeros(len(members), q_max, dtype=torch.long)
        query_valid = torch.zeros(len(members), q_max, dtype=torch.bool)
        kv_slots = torch.zeros(len(members), c_max, dtype=torch.long)
        mask = torch.zeros(len(members), 1, q_max, c_max, dtype=torch.bool)
        for row, i in enumerate(members):
            q, c = q_lens[i], ctx_lens[i]
            token_index[row, :q] = torch.arange(starts[i], starts[i] + q)
            query_valid[row, :q] = True
            kv_slots[row, :c] = torch.tensor(_slots(block_tables[i], block_size, 0, c))
            # query j sits at position c - q + j and sees keys 0..c - q + j
            key_pos = torch.arange(c_max)
            query_pos = torch.arange(c - q, c)
            mask[row, 0, :q] = key_pos[None, :] <= query_pos[:, None]
            order.extend(range(starts[i], starts[i] + q))
        # padded query rows attend to key 0 so softmax stays finite; their output is dropped
        mask[:, 0, :, 0] |= ~query_valid
        groups.append(
            AttentionGroup(
                token_index=token_index.reshape(-1).to(device),
                valid_index=query_valid.reshape(-1).nonzero().squeeze(1).to(device),
                kv_slots=kv_slots.reshape(-1).to(device),
                mask=mask.to(device),
                batch=len(members),
                q_max=q_max,
                c_max=c_max,
            )
        )
    out_index = torch.empty(total, dtype=torch.long)
    out_index[torch.tensor(order, dtype=torch.long)] = torch.arange(total)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        groups=groups,
        out_index=out_index.to(device),
    )


def _slots(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


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
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    outputs = []
    for g in meta.groups:
        b, q_max, c_max = g.batch, g.q_max, g.c_max
        qg = q.index_select(0, g.token_index).view(b, q_max, *q.shape[1:]).transpose(1, 2)
        kg = k_cache.index_select(0, g.kv_slots).view(b, c_max, *k_cache.shape[1:]).transpose(1, 2)
        vg = v_cache.index_select(0, g.kv_slots).view(b, c_max, *v_cache.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b * q_max, *q.shape[1:])
        outputs.append(out.index_select(0, g.valid_index))  # [valid_tokens, heads, head_dim]
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out.index_select(0, meta.out_index)
