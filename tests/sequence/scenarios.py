"""The scenarios of this suite (tests/helpers/harness.py), registered by importing their modules."""

import tests.sequence.sp_model_worker  # noqa: F401
import tests.sequence.sp_train_worker  # noqa: F401
