"""The scenarios of this suite (tests/helpers/harness.py), registered by importing their modules."""

import tests.pipeline.pipe_worker  # noqa: F401
