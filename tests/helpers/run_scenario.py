"""The one worker entry of the distributed-test harness (tests/helpers/harness.py), run on every rank:

    python -m torch.distributed.run --nproc-per-node N -m tests.helpers.run_scenario NAME PARAMS.json OUT

It imports the scenario's suite module, calls the scenario with this rank's :class:`ScenarioContext` and
records a returned value as ``result``. Nothing else: a scenario owns its process group and its failures.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path


def main(argv: list[str]) -> None:
    name, params_path, out = argv
    warnings.filterwarnings("ignore")
    from tests.helpers.harness import ScenarioContext, resolve

    fn = resolve(name)
    # torchrun sets RANK; Lightning's own launcher sets LOCAL_RANK in the processes it starts (one node)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    ctx = ScenarioContext(name=name, params=json.loads(Path(params_path).read_text()), out=Path(out), rank=rank,
                          world_size=int(os.environ.get("WORLD_SIZE", "1")))
    result = fn(ctx)
    if result is not None:
        ctx.record("result", result)


if __name__ == "__main__":
    main(sys.argv[1:])
