"""Starting a spawned process from any script.

Spawning re-runs the parent's ``__main__`` file in the child; a script read from standard input
(``python - <<EOF``) names ``<stdin>``, which is no file, and the child fails to start. While the
child starts, that name is hidden: the child then imports only its target's module, as it does
from a notebook (whose ``__main__`` has no file). Children need nothing from ``__main__``.
Torch-free: the data-parallel front starts its replicas with it.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.process import BaseProcess


def start_spawned(proc: BaseProcess) -> None:
    """``proc.start()``, with a ``__main__.__file__`` that is no file hidden meanwhile."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str) or os.path.isfile(path):
        proc.start()
        return
    del main.__file__
    try:
        proc.start()
    finally:
        main.__file__ = path
