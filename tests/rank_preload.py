"""Imported once by the server process that every test rank forks from
(tests/launch.py), so that a rank starts with torch already loaded instead of
spending ~3 s of CPU importing it (most of a short test's time on 2 cores).

Only what is the same for every test belongs here: torch reads a few
variables when it loads (OpenMP's thread count), so they are set first; the
package under test is not imported (its variables, e.g. PYALLREDUCE_CPU_ISA or
TRITON_INTERPRET, are read per rank).
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads OpenMP and OpenBLAS: no extra threads to fork

import torch.distributed  # noqa: E402,F401
