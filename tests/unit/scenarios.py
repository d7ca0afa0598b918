"""The harness's own scenario (tests/unit/test_forkserver.py): what a rank sees of its process, and how it ends."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from tests.helpers.harness import ScenarioContext, scenario


@scenario("unit.probe")
def probe(ctx: ScenarioContext) -> dict[str, Any]:
    """``end`` on rank 1: ``return`` (a record), ``raise``, ``exit3`` (``sys.exit(3)``) or ``sigkill``. Every rank
    records its view of the process first: environment, process group, stdin, argv, ``__main__``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    print(f"[probe rank {ctx.rank}] says hello", flush=True)
    main = sys.modules["__main__"]
    ctx.record("view", {"env": dict(os.environ), "pgid": os.getpgid(0), "pid": os.getpid(),
                        "stdin": os.path.realpath(f"/proc/self/fd/{sys.stdin.fileno()}"),
                        "argv": list(sys.argv), "main": getattr(main, "__file__", None), "name": main.__name__,
                        "ppid": os.getppid()})
    end = ctx.params.get("end", "return") if ctx.rank == 1 else "return"
    dist.barrier()
    dist.destroy_process_group()
    if end == "raise":
        raise RuntimeError("probe raised on purpose")
    if end == "exit3":
        sys.exit(3)
    if end == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    return {"rank": ctx.rank}
