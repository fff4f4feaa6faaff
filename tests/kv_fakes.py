"""A fake backend that keeps each engine's KV cache as token ids per slot, and a fake Peer
connector worker side that copies blocks between such caches: the sampled tokens depend on
every cached position, so a block loaded wrong or not at all changes them."""

from __future__ import annotations

from twinserve.core import ModelRunnerOutput, SchedulerOutput
from twinserve.core.kv_connector import KVConnectorOutput, KVLoad, PeerConnectorMetadata


class FakeKVBackend:
    """Writes each scheduled token's id into its slot; samples a token that is a function of the
    whole cached context read back through the block table."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, list[int | None]] = {}

    def block(self, block_id: int) -> list[int | None]:
        return self.slots.setdefault(block_id, [None] * self.block_size)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for src, dst in out.blocks_to_copy:
            self.slots[dst] = list(self.block(src))
        sampled = {}
        bs = self.block_size
        for sr in out.scheduled:
            for pos, token in enumerate(sr.token_ids, sr.start):
                self.block(sr.block_ids[pos // bs])[pos % bs] = token
            if sr.sample:
                end = sr.start + sr.num_new_tokens
                context = [self.block(sr.block_ids[p // bs])[p % bs] for p in range(end)]
                if None in context:
                    raise AssertionError(f"{sr.request_id}: position {context.index(None)} "
                                         "has no KV")
                sampled[sr.request_id] = [10 + sum(t * (p + 1) for p, t in enumerate(context)) % 997]
        return ModelRunnerOutput(sampled)


class FakePeerWorker:
    """The Peer connector's worker side over ``FakeKVBackend`` caches. Loads wait until the
    test settles them (``complete``/``fail``) or, with ``auto``, complete at the next poll."""

    def __init__(self, engine_id: str, backend: FakeKVBackend, peers: dict[str, FakePeerWorker],
                 auto: bool = True) -> None:
        self.engine_id, self.backend, self.peers, self.auto = engine_id, backend, peers, auto
        peers[engine_id] = self
        self.pending: dict[str, KVLoad] = {}
        self.published: dict[str, list[int]] = {}
        self.cancelled: list[str] = []
        self.released_early: set[str] = set()
        self._report = KVConnectorOutput()

    def start(self, meta: PeerConnectorMetadata) -> None:
        for load in meta.loads:
            if load.local_block_ids:
                self.pending[load.request_id] = load
            else:  # nothing to copy: the producer may release at once
                self.peers[load.remote_engine_id].release(load.remote_request_id)
        for rid, blocks in meta.sends.items():
            if rid in self.released_early:  # read before this worker heard of the send
                self.released_early.discard(rid)
                self._report.finished_sending.add(rid)
            else:
                self.published[rid] = blocks
        for rid in meta.cancelled:
            self.cancelled.append(rid)
            load = self.pending.pop(rid, None)
            if load is not None:
                self.peers[load.remote_engine_id].release(load.remote_request_id)

    def complete(self, rid: str) -> None:
        load = self.pending.pop(rid)
        producer = self.peers[load.remote_engine_id]
        published = producer.published.get(load.remote_request_id)
        if published is None or any(b not in published for b in load.remote_block_ids):
            producer.release(load.remote_request_id)  # a reader that gives up says so
            self._report.failed_recving.add(rid)
            return
        for remote, local in zip(load.remote_block_ids, load.local_block_ids, strict=True):
            self.backend.slots[local] = list(producer.backend.block(remote))
        producer.release(load.remote_request_id)
        self._report.finished_recving.add(rid)

    def fail(self, rid: str) -> None:
        load = self.pending.pop(rid)
        self.peers[load.remote_engine_id].release(load.remote_request_id)
        self._report.failed_recving.add(rid)

    def release(self, rid: str) -> None:
        """A reader is done with (or gave up on) a published request; also a send's timeout."""
        if self.published.pop(rid, None) is not None:
            self._report.finished_sending.add(rid)
        else:
            self.released_early.add(rid)

    def get_finished(self) -> KVConnectorOutput:
        if self.auto:
            for rid in list(self.pending):
                self.complete(rid)
        report, self._report = self._report, KVConnectorOutput()
        return report

    def close(self) -> None:
        self.pending.clear()


def pd_step(sched, backend: FakeKVBackend, worker: FakePeerWorker, now: float):
    """One engine step with the connector: orders to the worker, forward pass, its report."""
    out = sched.schedule(now)
    worker.start(out.kv_connector_metadata)
    result = backend.execute(out)
    result.kv_connector_output = worker.get_finished()
    return out, sched.update_from_output(out, result, now + 0.01)
