"""The scenarios of this suite (tests/helpers/harness.py), registered by importing their modules."""

import tests.fabric.fabric_worker  # noqa: F401
