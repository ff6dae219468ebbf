"""The exit of a process whose error ends it uncaught (tfpsx.control.watchdog): a lost
server that surfaced raw where no tfpsx code could catch it is still named, and the
process still leaves with the code a restart policy retries."""

import subprocess
import sys
import textwrap

import pytest

from tfpsx.control import watchdog

_SCRIPT = textwrap.dedent("""
    import atexit, sys
    from tfpsx.control import watchdog
    from tfpsx.errors import ServerUnavailableError

    class Raw(Exception):
        pass

    def translate(error):
        if isinstance(error, Raw):
            return ServerUnavailableError("worker 1: fit() lost server 0 at 127.0.0.1:1")
        return None

    atexit.register(lambda: print("ATEXIT RAN", flush=True))
    watchdog.translate_uncaught(translate)
    raise (Raw("recvmsg:Connection reset by peer") if sys.argv[1] == "raw"
           else ValueError("a bad value"))
""")


def _run(kind):
    return subprocess.run([sys.executable, "-c", _SCRIPT, kind], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.timeout(90)
def test_an_uncaught_raw_loss_is_named_and_exits_to_be_restarted():
    done = _run("raw")
    assert done.returncode == watchdog.EXIT_PEER_LOST, done.stderr
    # The original first, then the named error it caused.
    assert "Raw: recvmsg:Connection reset by peer" in done.stderr
    assert "direct cause" in done.stderr
    assert ("tfpsx.errors.ServerUnavailableError: worker 1: fit() lost server 0 at "
            "127.0.0.1:1") in done.stderr
    assert "ATEXIT RAN" not in done.stdout  # no teardown that could block on a lost peer


@pytest.mark.timeout(90)
def test_an_error_the_translator_leaves_ends_the_process_as_python_does():
    done = _run("other")
    assert done.returncode == 1, done.stderr
    assert "ValueError: a bad value" in done.stderr
    assert "ServerUnavailableError" not in done.stderr
    assert "ATEXIT RAN" in done.stdout  # the interpreter's own teardown ran



@pytest.mark.timeout(60)
def test_runtime_reset_leaves_the_excepthook_and_translators_as_before_any_strategy():
    """A strategy chains a translator of uncaught errors into sys.excepthook (as the Keras
    strategy and the hybrid mode do); RUNTIME.reset() undoes it, the exit-on-uncaught
    too, and a later strategy installs it afresh."""
    from tfpsx.runtime import RUNTIME

    before = sys.excepthook
    translate = lambda error: None  # noqa: E731
    watchdog.translate_uncaught(translate)
    watchdog.exit_if_uncaught()
    assert sys.excepthook is not before and watchdog._translators == [translate]
    RUNTIME.reset()
    assert sys.excepthook is before
    assert watchdog._translators == [] and watchdog._exit_on_uncaught is False
    watchdog.translate_uncaught(translate)  # installed again, once
    assert sys.excepthook is not before and watchdog._translators == [translate]
    RUNTIME.reset()
    assert sys.excepthook is before
