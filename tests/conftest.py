import os
import sys

# Quiet TF's C++ start-up chatter in test logs; errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

# Every test's tier is its folder's (README "Tests"): `make test-fast` runs unit and ops.
_TIERS = ("unit", "ops", "cluster", "examples")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.nodeid.split("/")
        tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else None
        if tier not in _TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in one of tests/"
                                    f"{{{','.join(_TIERS)}}}/ (its tier), not {tier!r}")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(autouse=True)
def _runtime_left_as_found():
    """No test leaves a role, a control-plane client or a server watch to the next one
    (a test-order failure once came from runtime state leaking): the process runtime is
    reset after every test that loaded it."""
    yield
    runtime = sys.modules.get("tfpsx.runtime")
    if runtime is not None:
        runtime.RUNTIME.reset()
