"""Run a worker script with a stack dump of every thread if it is still running after ``LZ_HANG_DUMP_S``.

A rank that waits forever inside a collective prints nothing before the launcher's timeout kills it,
and the kill loses every line it would have printed. Under this wrapper each rank writes its Python
stacks to stderr and exits (code 1) when the deadline passes, so the log names the operation each rank
waited in. Used by benchmarks/run_multi.sh call 5 (the parity suites over NCCL)::

    LZ_HANG_DUMP_S=90 torchrun --nproc-per-node 2 tests/helpers/hang_dump.py -m tests.helpers.run_scenario NAME PARAMS OUT
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import sys


def main() -> None:
    """Arm the dump, then run ``argv[1]`` (a script, or ``-m module``) as ``__main__`` with the remaining
    arguments."""
    faulthandler.dump_traceback_later(float(os.environ.get("LZ_HANG_DUMP_S", "120")), exit=True)
    if sys.argv[1] == "-m":
        module, sys.argv = sys.argv[2], sys.argv[2:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, sys.argv = sys.argv[1], sys.argv[1:]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
