"""Loading run folders (``twinserve.core.run_dir``'s format) into DataFrames.

A :class:`Run` is one folder read whole: config and summary as dicts, ``requests.csv`` as a DataFrame
(``success`` as bool, ``itls_ms`` kept as the space-separated string), ``steps.csv`` and ``tenants.csv``
as DataFrames or ``None`` when the backend wrote none (client-side runs).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from twinserve.core.run_dir import REQUEST_COLUMNS, read_config

REQUIRED_FILES = ("summary.json", "requests.csv")
_TEXT_COLUMNS = ("request_id", "tenant", "lora", "finish_reason", "error", "itls_ms")
# Columns that run folders written before them lack (read as their "absent" value).
_OPTIONAL_COLUMNS = {"lora": ""}


class NotARunFolderError(FileNotFoundError):
    """Raised for a path that is not a run folder; the message names the folder and what is missing."""


@dataclass(frozen=True, slots=True)
class Run:
    """One run folder, read."""

    path: Path
    name: str
    config: dict[str, Any]
    summary: dict[str, Any]
    requests: pd.DataFrame
    steps: pd.DataFrame | None
    tenants: pd.DataFrame | None

    @property
    def backend(self) -> str:
        return str(self.config.get("backend", "unknown"))

    @property
    def is_sim(self) -> bool:
        return self.backend == "sim"

    @property
    def display_name(self) -> str:
        """The label shown in tables and legends: ``label [backend]``."""
        return f"{self.name} [{self.backend}]"

    @property
    def ok_requests(self) -> pd.DataFrame:
        """The requests that succeeded (the ones latency statistics are taken over)."""
        return self.requests[self.requests["success"]]


def check_run_folder(path: Path) -> None:
    """Raises :class:`NotARunFolderError` unless ``path`` holds summary.json and requests.csv."""
    if not path.is_dir():
        raise NotARunFolderError(f"{path} is not a run folder: no such directory.")
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise NotARunFolderError(
            f"{path} is not a run folder: {', '.join(missing)} missing "
            f"(a run folder holds config.json, summary.json, requests.csv and, for engine-side "
            f"runs, steps.csv and tenants.csv).")


def load_run(path: str | Path, name: str | None = None) -> Run:
    """Reads one run folder. The name is ``name``, else ``config["label"]``, else the folder name."""
    folder = Path(path)
    check_run_folder(folder)
    config = read_config(folder)
    return Run(
        path=folder,
        name=name or str(config.get("label") or folder.name),
        config=config,
        summary=json.loads((folder / "summary.json").read_text()),
        requests=read_requests(folder / "requests.csv"),
        steps=_read_optional(folder / "steps.csv"),
        tenants=_read_optional(folder / "tenants.csv", dtype={"tenant": str}),
    )


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    """Reads several run folders; repeated names get ``#2``, ``#3``... so legends stay distinct."""
    runs = [load_run(p) for p in paths]
    return [_renamed(run, name) for run, name in zip(runs, unique_names([r.name for r in runs]))]


def unique_names(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} #{seen[name]}")
    return out


def _renamed(run: Run, name: str) -> Run:
    if name == run.name:
        return run
    return Run(run.path, name, run.config, run.summary, run.requests, run.steps, run.tenants)


def read_requests(path: Path) -> pd.DataFrame:
    """``requests.csv`` with text columns as text (empty, not NaN) and ``success`` as bool."""
    text = {c: str for c in _TEXT_COLUMNS}
    df = pd.read_csv(path, dtype=text, keep_default_na=False, na_values={
        c: [""] for c in REQUEST_COLUMNS if c not in _TEXT_COLUMNS})
    for column, absent in _OPTIONAL_COLUMNS.items():
        if column not in df.columns:
            df[column] = absent
    missing = [c for c in REQUEST_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: columns {missing} missing; is it a twinserve requests.csv?")
    df["success"] = df["success"].fillna(0).astype(int).astype(bool)
    df["priority"] = df["priority"].fillna(0).astype(int)
    return df


def _read_optional(path: Path, dtype: dict[str, type] | None = None) -> pd.DataFrame | None:
    if not path.is_file():
        return None
    df = pd.read_csv(path, dtype=dtype, keep_default_na=False, na_values={"time": [""]})
    return df if len(df) else None


def itl_values_ms(requests: pd.DataFrame) -> np.ndarray:
    """Every inter-token latency (ms) of the successful requests, from the ``itls_ms`` column."""
    ok = requests.loc[requests["success"], "itls_ms"]
    text = " ".join(s for s in ok if s)
    return np.array(text.split(), dtype=float) if text else np.array([], dtype=float)
