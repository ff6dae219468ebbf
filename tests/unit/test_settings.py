"""The settings registry: one place for every TFPSX_* variable, and the docs in step."""

import os
import re

import pytest

from tfpsx import settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_docs_tables_are_the_generated_ones():
    page = open(os.path.join(ROOT, "docs", "settings.md"), encoding="utf-8").read()
    block = re.search(r"<!-- settings:begin -->\n(.*?)<!-- settings:end -->", page, re.S)
    assert block, "docs/settings.md lost its <!-- settings:begin/end --> markers"
    assert block.group(1) == settings.markdown(), (
        "docs/settings.md's tables differ from tfpsx/settings.py; regenerate them with "
        "`python -m tfpsx.settings`")


def _names_used_in_code():
    """Every TFPSX_* name the code reads from the environment: quoted in Python (settings
    are looked up by name), passed to getenv in C++ (macros are not settings)."""
    patterns = {".py": r"""["'](TFPSX_[A-Z][A-Z_]*[A-Z])["']""",
                ".cc": r"""getenv\(\s*"(TFPSX_[A-Z_]+)"\s*\)""",
                ".h": r"""getenv\(\s*"(TFPSX_[A-Z_]+)"\s*\)"""}
    paths = [os.path.join(ROOT, "setup.py"), os.path.join(ROOT, "configure.py")]
    for top in ("tfpsx", "custom_ops", "examples", "benchmarks"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            paths += [os.path.join(folder, n) for n in files if "_pb2" not in n]
    found = set()
    for path in paths:
        ext = os.path.splitext(path)[1]
        if ext in patterns:
            found |= set(re.findall(patterns[ext], open(path, encoding="utf-8").read()))
    return found


def test_every_variable_the_code_reads_is_registered():
    used = _names_used_in_code()
    assert {"TFPSX_RPC_TIMEOUT", "TFPSX_TABLE_HUGE_PAGES", "TFPSX_WITH_CUDA"} <= used
    missing = sorted(used - set(settings.SETTINGS))
    assert not missing, f"TFPSX_* names used in the code but not in tfpsx/settings.py: {missing}"


def test_get_parses_and_names_bad_values():
    assert settings.get("TFPSX_RPC_TIMEOUT", env={}) == 30.0
    assert settings.get("TFPSX_RPC_TIMEOUT", env={"TFPSX_RPC_TIMEOUT": "2.5"}) == 2.5
    assert settings.get("TFPSX_RPC_TIMEOUT", override=7, env={"TFPSX_RPC_TIMEOUT": "2"}) == 7.0
    assert settings.get("TFPSX_TABLE_HUGE_PAGES", env={"TFPSX_TABLE_HUGE_PAGES": "0"}) is False
    assert settings.get("TFPSX_TABLE_HUGE_PAGES", env={"TFPSX_TABLE_HUGE_PAGES": "yes"}) is True
    assert settings.get("TFPSX_PORT", env={"TFPSX_PORT": " "}) is None  # blank is unset
    with pytest.raises(ValueError, match=r"TFPSX_TABLE_HUGE_PAGES: expected one of .*'maybe'"):
        settings.get("TFPSX_TABLE_HUGE_PAGES", env={"TFPSX_TABLE_HUGE_PAGES": "maybe"})
    with pytest.raises(ValueError, match=r"argument for TFPSX_BARRIER_TIMEOUT.*-1"):
        settings.get("TFPSX_BARRIER_TIMEOUT", override=-1)
    with pytest.raises(ValueError, match=r"TFPSX_PORT: expected an integer >= 0, got 'x1'"):
        settings.get("TFPSX_PORT", env={"TFPSX_PORT": "x1"})
    assert settings.get("TFPSX_LISTEN_PORT", env={"TFPSX_LISTEN_PORT": "2222"}) == 2222
    for bad in ("0", "65536", "ab"):
        with pytest.raises(ValueError, match=rf"TFPSX_LISTEN_PORT: expected a TCP port "
                                             rf"\(an integer 1-65535\), got '{bad}'"):
            settings.get("TFPSX_LISTEN_PORT", env={"TFPSX_LISTEN_PORT": bad})
    with pytest.raises(KeyError, match="TFPSX_NOPE.*is not a tfpsx setting"):
        settings.get("TFPSX_NOPE")
    with pytest.raises(ValueError, match="parsed by the cluster resolver"):
        settings.get("TFPSX_SERVER_ENDPOINTS", env={"TFPSX_SERVER_ENDPOINTS": "h:1"})
