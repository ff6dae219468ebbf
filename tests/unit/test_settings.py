"""The settings registry: one place for every TFPSX_* variable, and the README in step."""

import os
import re

import pytest

from tfpsx import settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_readme_tables_are_the_generated_ones():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"<!-- settings:begin -->\n(.*?)<!-- settings:end -->", readme, re.S)
    assert block, "README.md lost its <!-- settings:begin/end --> markers"
    assert block.group(1) == settings.markdown(), (
        "README.md's settings tables differ from tfpsx/settings.py; regenerate them with "
        "`python -m tfpsx.settings`")


def _names_used_in_code():
    found = set()
    for top in ("tfpsx", "custom_ops", "examples", "benchmarks"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".py", ".cc", ".h")) and "_pb2" not in name:
                    text = open(os.path.join(folder, name), encoding="utf-8").read()
                    found |= set(re.findall(r"\bTFPSX_[A-Z][A-Z_]*[A-Z]\b", text))
    found |= set(re.findall(r"\bTFPSX_[A-Z][A-Z_]*[A-Z]\b",
                            open(os.path.join(ROOT, "setup.py")).read()))
    # C/C++ macro names and header guards, not variables.
    return {n for n in found if not re.match(r"TFPSX_(CORE|KERNELS|OPS|CUDA)_\w+_H_?$", n)
            and n not in ("TFPSX_TF_VERSION", "TFPSX_HOST_DEVICE", "TFPSX_APPLY_OP")
            and not n.startswith("TFPSX_REGISTER_")}


def test_every_variable_the_code_reads_is_registered():
    missing = sorted(_names_used_in_code() - set(settings.SETTINGS) - {"TFPSX_TLS_"})
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
    with pytest.raises(KeyError, match="TFPSX_NOPE.*is not a tfpsx setting"):
        settings.get("TFPSX_NOPE")
    with pytest.raises(ValueError, match="parsed by the cluster resolver"):
        settings.get("TFPSX_SERVER_ENDPOINTS", env={"TFPSX_SERVER_ENDPOINTS": "h:1"})
