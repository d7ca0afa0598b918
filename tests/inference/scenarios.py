"""The scenarios of this suite (tests/helpers/harness.py), registered by importing their modules."""

import tests.inference.predict_runs  # noqa: F401
import tests.inference.tp_runs  # noqa: F401
