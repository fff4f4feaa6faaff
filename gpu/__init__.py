"""The real backend: HF Llama-family models on paged KV, CPU (torch + a C++ decode kernel) and CUDA
(Triton). Every module here imports torch; ``simulator/`` never imports this package.

Importing the package sets ``OMP_WAIT_POLICY=PASSIVE`` unless it is already set, so it must come
before ``import torch`` (OpenMP reads it once, when torch loads it). With the default, an idle
OpenMP worker spins; when any other process holds one of the cores, every parallel region then
waits a scheduler time slice for the descheduled worker. On this 2-core machine, with one core
busy elsewhere, a batch-8 decode step took 3.6 s with two threads and 0.21 s with one; with
passive waiting, 0.23 s.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
