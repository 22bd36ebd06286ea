"""Hypothesis profiles: PAGEKV_HYPOTHESIS_PROFILE=ci (default), long or dev."""

import os

from hypothesis import HealthCheck, settings

# Session fixtures with the real default model and the transformers reference, the store
# servers, and the Debian packages some tests need (a skip when absent, listed at the end).
pytest_plugins = ["kernel_targets", "models_fixtures", "store_fixtures", "system_packages"]

settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long", settings.get_profile("ci"), max_examples=2000, stateful_step_count=200
)
settings.register_profile("dev", settings.get_profile("ci"), max_examples=30)
settings.load_profile(os.environ.get("PAGEKV_HYPOTHESIS_PROFILE", "ci"))
