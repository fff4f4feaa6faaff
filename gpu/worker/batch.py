"""Flatten a step's ``ScheduledRequest`` list into the model's inputs (vectorised, no padding)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from twinserve.core.kv_cache_groups import KVCacheLayout
from twinserve.core.outputs import ScheduledRequest
from twinserve.gpu.layers.attention_backend import AttentionMetadata


@dataclass(slots=True)
class ModelInput:
    """``input_ids[T]``, ``positions[T]``, attention metadata, and which rows sample:
    ``sample_rows`` (row of each sampling request's last token) for ``sample_index[N]``
    (its index in the scheduled list). A verification entry (speculative decoding, k drafts)
    samples at all its 1 + k rows: ``sample_counts[N]`` says how many rows each takes in
    ``sample_rows`` (empty when every entry takes one)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    sample_index: list[int]
    sample_counts: list[int] = field(default_factory=list)


def build_model_input(scheduled: list[ScheduledRequest], block_size: int,
                      max_positions: int, device: torch.device,
                      layout: KVCacheLayout | None = None) -> ModelInput:
    """The step's inputs; with a hybrid ``layout`` (several KV cache groups) every group's
    block table and slot mapping (``AttentionMetadata.groups``)."""
    num_seqs = len(scheduled)
    q_lens = np.fromiter((sr.num_new_tokens for sr in scheduled), np.int64, num_seqs)
    starts = np.fromiter((sr.start for sr in scheduled), np.int64, num_seqs)
    seq_lens = starts + q_lens
    if (q_lens <= 0).any():
        raise ValueError("every scheduled request needs num_new_tokens >= 1.")
    if int(seq_lens.max()) > max_positions:
        raise ValueError(f"a scheduled sequence reaches {int(seq_lens.max())} tokens, beyond "
                         f"max_model_len={max_positions}.")
    query_start_loc = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    token_ids: list[int] = []
    for sr in scheduled:
        token_ids.extend(sr.token_ids)
    # positions: start_b + (row - query_start_b) for each row of sequence b
    seq_of_row = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(total) - query_start_loc[seq_of_row] + starts[seq_of_row]
    block_tables = _block_tables(scheduled, seq_lens, block_size)
    slots = (block_tables[seq_of_row, positions // block_size].astype(np.int64) * block_size
             + positions % block_size)
    sample_index = [i for i, sr in enumerate(scheduled) if sr.sample]
    sample_rows = query_start_loc[1:][sample_index] - 1
    sample_counts: list[int] = []
    if any(scheduled[i].spec_token_ids for i in sample_index):
        sample_rows, sample_counts = _verification_rows(scheduled, sample_index, query_start_loc)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        block_tables=torch.from_numpy(block_tables).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
        max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()))
    if layout is not None and layout.num_groups > 1:
        meta = _with_groups(meta, scheduled, seq_lens, seq_of_row, positions, block_size, layout)
    return ModelInput(
        input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        positions=torch.from_numpy(positions).to(device),
        meta=meta,
        sample_rows=torch.from_numpy(sample_rows).to(device),
        sample_index=sample_index, sample_counts=sample_counts)


def _verification_rows(scheduled: list[ScheduledRequest], sample_index: list[int],
                       query_start_loc: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Every sampling entry's last row, or all 1 + k rows of a verification entry."""
    rows: list[int] = []
    counts: list[int] = []
    for i in sample_index:
        sr = scheduled[i]
        count = 1 + len(sr.spec_token_ids) if sr.spec_token_ids else 1
        if sr.spec_token_ids and sr.num_new_tokens != count:
            raise ValueError(f"request {sr.request_id!r} verifies {count - 1} drafts in "
                             f"{sr.num_new_tokens} tokens (must be 1 + drafts).")
        end = int(query_start_loc[i + 1])
        rows.extend(range(end - count, end))
        counts.append(count)
    return np.asarray(rows, np.int64), counts


def _with_groups(meta: AttentionMetadata, scheduled: list[ScheduledRequest],
                 seq_lens: np.ndarray, seq_of_row: np.ndarray, positions: np.ndarray,
                 block_size: int, layout: KVCacheLayout) -> AttentionMetadata:
    """``meta`` with one metadata per KV cache group (its block table and slot mapping); a
    sliding group's table holds the null block where its window no longer looks."""
    device = meta.seq_lens.device
    groups = [meta]
    for g in range(1, layout.num_groups):
        tables = _block_tables(scheduled, seq_lens, block_size, g)
        slots = (tables[seq_of_row, positions // block_size].astype(np.int64) * block_size
                 + positions % block_size)
        groups.append(AttentionMetadata(
            torch.from_numpy(slots).to(device), torch.from_numpy(tables).to(device),
            meta.seq_lens, meta.query_start_loc, meta.max_query_len, meta.max_seq_len))
    return replace(meta, groups=tuple(groups), group_windows=layout.group_windows,
                   layer_groups=layout.layer_group)


def _block_tables(scheduled: list[ScheduledRequest], seq_lens: np.ndarray,
                  block_size: int, group: int = 0) -> np.ndarray:
    """``[B, max_blocks]`` int32 (of KV cache group ``group``), padded with block 0 (never
    read: masked by ``seq_lens``)."""
    needed = (seq_lens + block_size - 1) // block_size
    table = np.zeros((len(scheduled), int(needed.max())), np.int32)
    for b, sr in enumerate(scheduled):
        n = int(needed[b])
        ids = sr.block_ids if group == 0 else _group_ids(sr, group)
        if len(ids) < n:
            raise ValueError(f"request {sr.request_id!r}: {len(ids)} blocks cannot hold "
                             f"{int(seq_lens[b])} tokens at block_size={block_size}.")
        table[b, :n] = ids[:n]
    return table


def _group_ids(sr: ScheduledRequest, group: int) -> list[int]:
    if len(sr.group_block_ids) <= group:
        raise ValueError(f"request {sr.request_id!r} has no block table for KV cache group "
                         f"{group}: the scheduler's KV layout differs from the runner's.")
    return sr.group_block_ids[group]
