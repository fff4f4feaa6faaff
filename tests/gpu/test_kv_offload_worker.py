"""The host KV tier's worker side (gpu/kv_offload/) on CPU tensors."""

from __future__ import annotations

import torch

from twinserve.core.kv_offload import OffloadingConnectorMetadata
from twinserve.gpu.kv_offload.worker import OffloadingConnectorWorker


def _cache(num_blocks: int = 6, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(num_blocks, 4, 2, 8, generator=gen),
             torch.randn(num_blocks, 4, 2, 8, generator=gen)) for _ in range(layers)]


def test_stored_blocks_load_back_bit_exact_into_other_blocks():
    cache = _cache()
    before = [(k.clone(), v.clone()) for k, v in cache]
    worker = OffloadingConnectorWorker(cache, 3)
    worker.start(OffloadingConnectorMetadata(stores=[(1, 0), (4, 2)]))
    assert worker.get_finished().finished_recving == set()  # stores happen after the pass
    for k, v in cache:  # the device blocks are reused meanwhile
        k.zero_()
        v.zero_()
    worker.start(OffloadingConnectorMetadata(loads={"r": [(2, 0), (0, 5)]}))
    report = worker.get_finished()
    assert report.finished_recving == {"r"} and report.failed_recving == set()
    for (k, v), (k0, v0) in zip(cache, before):
        assert torch.equal(k[0], k0[4]) and torch.equal(v[0], v0[4])
        assert torch.equal(k[5], k0[1]) and torch.equal(v[5], v0[1])
        assert not k[1].any() and not k[4].any()  # untouched blocks stay as they were
    assert (worker.num_blocks_stored, worker.num_blocks_loaded) == (2, 2)
    assert worker.host.nbytes == 2 * 2 * 3 * 4 * 2 * 8 * 4


def test_stores_of_a_step_happen_after_its_forward_pass():
    cache = _cache()
    worker = OffloadingConnectorWorker(cache, 2)
    worker.start(OffloadingConnectorMetadata(stores=[(3, 1)]))
    cache[0][0][3].fill_(7.0)  # the forward pass writes the block's KV
    worker.get_finished()
    cache[0][0][3].zero_()
    worker.start(OffloadingConnectorMetadata(loads={"a": [(1, 0)]}))
    worker.get_finished()
    assert bool((cache[0][0][0] == 7.0).all())


def test_a_load_naming_missing_blocks_fails_alone():
    worker = OffloadingConnectorWorker(_cache(), 2)
    worker.start(OffloadingConnectorMetadata(loads={"bad": [(2, 0)], "ok": [(1, 1)]}))
    report = worker.get_finished()
    assert report.failed_recving == {"bad"} and report.finished_recving == {"ok"}
    assert worker.get_finished().failed_recving == set()  # reported once
