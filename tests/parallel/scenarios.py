"""The scenarios of this suite (tests/helpers/harness.py), registered by importing their modules."""

import tests.parallel.tp_worker  # noqa: F401
import tests.parallel.pp_tp_worker  # noqa: F401
import tests.parallel.tp_ckpt_worker  # noqa: F401
