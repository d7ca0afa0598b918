"""The scenarios of this suite (tests/helpers/harness.py), registered by importing their modules."""

import tests.moe.zero_ep_worker  # noqa: F401
import tests.moe.ckpt_ep_worker  # noqa: F401
