"""The twin's KV link model against transfers measured on this machine.

    python -m twinserve.benchmarks.kv_link_fit [--blocks 1,4,16,64 --concurrency 1,2,4
        --fit-blocks 1,16,64 --fit-concurrency 1,2 --repeats 7]

Measures the Peer connector between two processes (``gpu/measurement/kv_transfer.py``: the
decode side's load path, shared memory on a CPU) over a grid of transfer sizes and concurrency,
fits the link (``fit_link``) on the cells of ``--fit-blocks`` x ``--fit-concurrency`` only, and
predicts every cell with the twin's own transfer path (``simulator/kv_transfer.py``,
``concurrent_load_seconds``: ``SimPeerWorker`` loads over a ``LinkNetwork``). The held-out
cells (other sizes, higher concurrency) test the model. Two more tables fit the same samples
with the models before it, for comparison: the link's capacity one flow's rate (no flow cap),
and the whole fixed cost as latency (the link fitted on one-at-a-time transfers alone).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from twinserve.gpu.kv_transfer.region import KVLayout
from twinserve.gpu.measurement.kv_transfer import (
    TransferSample,
    fit_link,
    measure_transfers,
    transfer_table,
)
from twinserve.simulator.kv_transfer import LinkSpec, concurrent_load_seconds


@dataclass(slots=True, frozen=True)
class Prediction:
    """One (bytes, concurrency) cell: measured and predicted median seconds per load."""

    num_bytes: int
    concurrency: int
    measured_s: float
    predicted_s: float
    held_out: bool

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s


def predict(samples: Sequence[TransferSample], fit_bytes: set[int], fit_concurrency: set[int],
            capacity: bool = True) -> tuple[LinkSpec, list[Prediction]]:
    """Fits the link on the samples of ``fit_bytes`` x ``fit_concurrency`` (which must hold 1)
    and predicts every cell of the table with the twin; a cell is held out unless fitted.
    ``capacity``: as ``fit_link``'s."""
    if 1 not in fit_concurrency:
        raise ValueError("fit_concurrency must include 1 (the bandwidth comes from it).")
    def fitted(s: TransferSample) -> bool:
        return s.num_bytes in fit_bytes and s.concurrency in fit_concurrency
    link = LinkSpec.from_dict(fit_link([s for s in samples if fitted(s)], capacity).to_kv_link())
    rows = []
    for row in transfer_table(samples):
        ends = sorted(concurrent_load_seconds(link, row.num_bytes, row.concurrency))
        predicted = ends[len(ends) // 2]  # the median load, as the measured row
        held_out = not fitted(TransferSample(row.num_bytes, row.concurrency, row.seconds))
        rows.append(Prediction(row.num_bytes, row.concurrency, row.seconds, predicted, held_out))
    return link, rows


def format_table(link: LinkSpec, rows: Sequence[Prediction], title: str) -> str:
    held = [abs(r.error) for r in rows if r.held_out]
    lines = [f"{title}: {link.flow_rate / 1e9:.2f} GB/s a flow, {link.bandwidth_bytes_per_s / 1e9:.2f} "
             f"GB/s shared, latency {link.latency_s * 1e3:.3f} ms, overhead "
             f"{link.overhead_s * 1e3:.3f} ms",
             f"{'bytes':>10} {'conc':>4} {'measured ms':>12} {'twin ms':>9} {'error':>7}  held out"]
    for r in rows:
        lines.append(f"{r.num_bytes:>10} {r.concurrency:>4} {r.measured_s * 1e3:>12.3f} "
                     f"{r.predicted_s * 1e3:>9.3f} {r.error:>+7.0%}  {'yes' if r.held_out else ''}")
    if held:
        lines.append(f"held-out cells: mean |error| {sum(held) / len(held):.0%}, max {max(held):.0%}")
        by_c = {c: [abs(r.error) for r in rows if r.held_out and r.concurrency == c]
                for c in sorted({r.concurrency for r in rows if r.held_out})}
        lines.append("held-out mean |error| by concurrency: " + ", ".join(
            f"{c} at once {sum(e) / len(e):.0%}" for c, e in by_c.items()))
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=_ints, default=[1, 4, 16, 64])
    parser.add_argument("--fit-blocks", type=_ints, default=[1, 16, 64])
    parser.add_argument("--concurrency", type=_ints, default=[1, 2, 4])
    parser.add_argument("--fit-concurrency", type=_ints, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layout", default="30,16,3,64,bfloat16",
                        help="slots,block_size,kv_heads,head_dim,dtype (default: the bundled "
                             "SmolLM2's, 368,640 bytes a block)")
    ns = parser.parse_args(argv)
    slots, block_size, heads, head_dim, dtype = ns.layout.split(",")
    for fit, grid, name in ((ns.fit_blocks, ns.blocks, "blocks"),
                            (ns.fit_concurrency, ns.concurrency, "concurrency")):
        if not set(fit) <= set(grid):
            parser.error(f"--fit-{name} {sorted(set(fit) - set(grid))} are not among --{name}")
    layout = KVLayout(int(slots), int(block_size), int(heads), int(head_dim), dtype,
                      max(ns.blocks) * max(ns.concurrency))
    samples = measure_transfers(layout, ns.blocks, ns.concurrency, ns.repeats)
    fit_bytes = {n * layout.bytes_per_block for n in ns.fit_blocks}
    print(f"Peer connector, {layout.bytes_per_block:,} bytes a block, {ns.repeats} rounds a "
          f"cell; fitted on {ns.fit_blocks} blocks x {ns.fit_concurrency} at once\n")
    for fit_concurrency, capacity, title in (
            (set(ns.fit_concurrency), True, "twin, fitted link (flow cap and capacity)"),
            (set(ns.fit_concurrency), False, "twin, capacity = one flow's rate (no flow cap)"),
            ({1}, False, "twin, fixed cost all latency (fit at 1 at once)")):
        link, rows = predict(samples, fit_bytes, fit_concurrency, capacity)
        print(format_table(link, rows, title) + "\n")


if __name__ == "__main__":
    main()
