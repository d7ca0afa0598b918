"""Settings every test process inherits, the workers the tests launch included."""

from __future__ import annotations

import os

# A worker that dies of a signal (SIGABRT, SIGSEGV) prints every Python thread's stack: the one
# intermittent abort at the exit of multi-fit gloo workers could not be diagnosed without it
# (lightning_zero/comm/collectives.py [Note: destroy at exit]).
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
