import os
import sys

# Quiet TF's C++ start-up chatter in test logs; errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

# Every test's tier is its folder's (README "Tests"): `make test-fast` runs unit and ops.
_TIERS = ("unit", "ops", "cluster", "examples")


# The time guard (docs/testing.md): a test of `make test` (not marked slow) whose call
# (not a module-scoped scenario's set-up) takes longer than this fails, so that the suite CI runs cannot creep back past its 20
# minutes one test at a time. An end-to-end test that needs longer says so and why with
# @pytest.mark.budget(seconds, why=...); a variant or a soak is marked slow (`make
# test-all`). TFPSX_TEST_TIME_LIMIT=0 turns the guard off (a debugger, a loaded machine).
try:
    TIME_LIMIT = float(os.environ.get("TFPSX_TEST_TIME_LIMIT", "20"))
except ValueError:
    raise pytest.UsageError("TFPSX_TEST_TIME_LIMIT: expected seconds (0: no time guard), got "
                            f"{os.environ['TFPSX_TEST_TIME_LIMIT']!r}") from None


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.nodeid.split("/")
        tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else None
        if tier not in _TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in one of tests/"
                                    f"{{{','.join(_TIERS)}}}/ (its tier), not {tier!r}")
        item.add_marker(getattr(pytest.mark, tier))
        budget = item.get_closest_marker("budget")
        if budget is not None and (not budget.args or not budget.kwargs.get("why")):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.budget takes the seconds and "
                                    "why=... (what the test drives that takes that long)")


def _limit(item):
    """The seconds ``item``'s call may take under the guard, or None (not guarded)."""
    if TIME_LIMIT <= 0 or item.get_closest_marker("slow") is not None:
        return None
    budget = item.get_closest_marker("budget")
    return float(budget.args[0]) if budget is not None else TIME_LIMIT


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    limit = _limit(item)
    if call.when != "call" or limit is None or not report.passed or call.duration <= limit:
        return
    whose = ("@pytest.mark.budget" if item.get_closest_marker("budget")
             else "the limit of an unmarked test")
    report.outcome = "failed"
    report.longrepr = (
        f"{item.nodeid} passed, but took {call.duration:.1f} s, over its {limit:g} s ({whose}; "
        "docs/testing.md): make it stop on the event it needs, share a scenario's cluster, "
        "or mark it slow (make test-all) or with a budget that says why")


@pytest.fixture(autouse=True)
def _runtime_left_as_found():
    """No test leaves a role, a control-plane client or a server watch to the next one
    (a test-order failure once came from runtime state leaking): the process runtime is
    reset after every test that loaded it."""
    yield
    runtime = sys.modules.get("tfpsx.runtime")
    if runtime is not None:
        runtime.RUNTIME.reset()
