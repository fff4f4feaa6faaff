"""The subsets of Vidur's profiles kept in ``simulator/data/profiles/vidur/``, cut from a git copy.

Vidur's ``mlp.csv`` holds min/max/mean/median/std of every operator per (TP size, token count),
a few (TP, tokens) twice; its ``all_reduce.csv`` the same statistics per (workers, devices per
node, size). Kept here: the medians (the statistic Vidur fits on), the first row of each key, and
for the all-reduce only the rows Vidur's simulator reads (``devices_per_node == num_workers``)::

    python -m twinserve.simulator.vidur_extract /work/.mirror/microsoft+vidur/repo

rewrites the kept files and prints each source's blob, size and sha256 (for ``PROVENANCE.md``).
Re-cutting ``a100_meta-llama-3-8b_mlp.csv`` this way gives the bundled file byte for byte.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from twinserve.simulator.vidur_profiles import VIDUR_DIR

MLP_OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
           "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


@dataclass(slots=True, frozen=True)
class KeptFile:
    """One kept file: its name here and its path in microsoft/vidur."""

    name: str
    source: str

    @property
    def is_network(self) -> bool:
        return self.source.startswith("data/profiling/network/")


KEPT: tuple[KeptFile, ...] = (
    *(KeptFile(f"{sku}_{m.split('/')[1].lower()}_mlp.csv", f"data/profiling/compute/{sku}/{m}/mlp.csv")
      for sku, m in (("a100", "meta-llama/Meta-Llama-3-8B"), ("a100", "meta-llama/Meta-Llama-3-70B"),
                     ("a100", "meta-llama/Llama-2-70b-hf"), ("h100", "meta-llama/Llama-2-7b-hf"),
                     ("h100", "meta-llama/Llama-2-70b-hf"))),
    *(KeptFile(f"{net}_all_reduce.csv", f"data/profiling/network/{net}/all_reduce.csv")
      for net in ("a100_dgx", "a100_pairwise_nvlink", "h100_dgx", "h100_pairwise_nvlink")),
)


def _num(text: str) -> str:
    return repr(round(float(text), 6))


def cut_mlp(text: str) -> list[list[str]]:
    """Header + one row per (TP, tokens), sorted: TP, tokens and each operator's median (ms)."""
    rows: dict[tuple[int, int], list[str]] = {}
    for r in csv.DictReader(io.StringIO(text)):
        key = (int(r["num_tensor_parallel_workers"]), int(r["num_tokens"]))
        if key not in rows:
            rows[key] = [str(key[0]), str(key[1]),
                         *(_num(r[f"time_stats.{op}.median"]) for op in MLP_OPS)]
    header = ["num_tensor_parallel_workers", "num_tokens", *(f"{op}_ms" for op in MLP_OPS)]
    return [header, *(rows[k] for k in sorted(rows))]


def cut_all_reduce(text: str) -> list[list[str]]:
    """Header + one row per (workers, size) of one node's all-reduce: median ms."""
    rows: dict[tuple[int, int], list[str]] = {}
    for r in csv.DictReader(io.StringIO(text)):
        if r["collective"] != "all_reduce" or r["devices_per_node"] != r["num_workers"]:
            continue
        key = (int(r["num_workers"]), int(r["size"]))
        rows.setdefault(key, [str(key[0]), str(key[1]), _num(r["time_stats.all_reduce.median"])])
    return [["num_workers", "size", "all_reduce_ms"], *(rows[k] for k in sorted(rows))]


def git_show(repo: Path, path: str, commit: str = "HEAD") -> tuple[str, bytes]:
    """(blob id, bytes) of ``path`` at ``commit`` in the git directory ``repo``."""
    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", str(repo), *args], check=True,
                              capture_output=True).stdout
    return git("rev-parse", f"{commit}:{path}").decode().strip(), git("show", f"{commit}:{path}")


def write_rows(rows: list[list[str]], path: Path) -> Path:
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)  # "\r\n" line ends, as the bundled files
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinserve.simulator.vidur_extract",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("repo", type=Path, help="a git directory of microsoft/vidur")
    p.add_argument("--commit", default="HEAD")
    p.add_argument("--out", type=Path, default=VIDUR_DIR)
    args = p.parse_args(argv)
    for kept in KEPT:
        blob, data = git_show(args.repo, kept.source, args.commit)
        rows = (cut_all_reduce if kept.is_network else cut_mlp)(data.decode())
        path = write_rows(rows, args.out / kept.name)
        digest = hashlib.sha256(data).hexdigest()
        print(f"{kept.name}: {kept.source} blob {blob[:8]} {len(data):,} bytes sha256 "
              f"{digest} -> {len(rows) - 1} rows, {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
