"""Every UCXCOMM_* variable is declared once (ucxcomm/settings.py), read only there and
listed in docs/settings.md; malformed values fail loudly, naming the variable."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ucxcomm import settings

ROOT = Path(__file__).resolve().parent.parent
_NAME = re.compile(r"UCXCOMM_[A-Z0-9_]+")
# UCXCOMM_ names that are not variables (C identifiers of the extension).
_NOT_VARIABLES = {"UCXCOMM_INPROGRESS", "UCXCOMM_CONST", "UCXCOMM_UCP_H",
                  "UCXCOMM_INTERNAL_H", "UCXCOMM_FAST_SMALL_MAX", "UCXCOMM_FAST_SEND_MAX",
                  "UCXCOMM_STATS_ROWS", "UCXCOMM_STATS_UNCLASSIFIED"}


def _names_in(paths):
    found = set()
    for path in paths:
        found |= set(_NAME.findall(path.read_text()))
    return found - _NOT_VARIABLES


def test_every_variable_in_the_code_is_declared():
    code = [*ROOT.joinpath("ucxcomm").rglob("*.py"), *ROOT.joinpath("ci").glob("*.sh"),
            ROOT / "tools" / "build_ucp.py", *ROOT.joinpath("csrc").glob("*.[ch]")]
    undeclared = _names_in(code) - set(settings.SETTINGS)
    assert not undeclared, f"declare these in ucxcomm/settings.py: {sorted(undeclared)}"


def test_docs_table_matches_the_declarations():
    text = (ROOT / "docs" / "settings.md").read_text()
    rows = re.findall(r"^\| `(UCXCOMM_[A-Z0-9_]+)` \| ([^|]+) \|", text, re.M)
    assert [name for name, _ in rows] == list(settings.SETTINGS)
    for name, default in rows:
        want = settings.SETTINGS[name].default
        shown = "unset" if want is None else "empty" if want == "" else f"`{want}`"
        assert default.strip() == shown, name


def test_only_the_settings_module_reads_the_variables():
    reader = re.compile(r"""(?:environ|env)(?:\.get\(|\[)\s*["']UCXCOMM_""")
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.joinpath("ucxcomm").rglob("*.py")
                 if p.name != "settings.py" and reader.search(p.read_text())]
    assert not offenders, offenders


@pytest.mark.parametrize("name, value, message", [
    ("UCXCOMM_SPIN_US", "fast", "must be a number"),
    ("UCXCOMM_SPIN_US", "-5", "must be >= 0"),
    ("UCXCOMM_RMA_SPIN_US", "nan", "must be >= 0"),
    ("UCXCOMM_MMAP_THRESHOLD", "1M", "must be an integer"),
    ("UCXCOMM_POOL_MB", "-1", "must be >= 0"),
    ("UCXCOMM_TIMEOUT", "0", "must be > 0"),
    ("UCXCOMM_PORT", "70000", "TCP port"),
    ("UCXCOMM_TRANSPORT", "infiniband", "must be one of auto, rdma, tcp"),
    ("UCXCOMM_TAG_OFFLOAD", "sometimes", "must be auto, yes or no"),
    ("UCXCOMM_TM_THRESH", "big", "must be an integer"),
])
def test_malformed_values_name_the_variable(name, value, message):
    with pytest.raises(ValueError, match=message) as info:
        settings.get(name, {name: value})
    assert str(info.value).startswith(f"{name}={value!r}")


def test_defaults_and_parsing():
    assert settings.get("UCXCOMM_SPIN_US", {}) == 200.0
    assert settings.get("UCXCOMM_SPIN_US", {"UCXCOMM_SPIN_US": ""}) == 200.0
    assert settings.get("UCXCOMM_DEVICES", {"UCXCOMM_DEVICES": "mlx5_0:1, mlx5_1:1"}) == \
        ["mlx5_0:1", "mlx5_1:1"]
    assert settings.get("UCXCOMM_TAG_OFFLOAD", {"UCXCOMM_TAG_OFFLOAD": "No"}) is False
    assert settings.get("UCXCOMM_TRANSPORT", {"UCXCOMM_TRANSPORT": " TCP "}) == "tcp"


def test_a_malformed_variable_fails_init_before_any_io():
    """Seen by a user: the error names the variable, at the call."""
    code = ("import asyncio, ucxcomm\n"
            "async def main():\n"
            "    await ucxcomm.init()\n"
            "try:\n"
            "    asyncio.run(main())\n"
            "except ValueError as exc:\n"
            "    print('ERR', exc)\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("UCXCOMM_", "RANK", "WORLD_SIZE", "MASTER_", "SLURM_",
                                "OMPI_", "PMI_"))}
    env["UCXCOMM_SPIN_US"] = "fast"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert "ERR UCXCOMM_SPIN_US='fast': must be a number" in proc.stdout, proc.stderr
