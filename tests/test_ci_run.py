"""`.ci/run` reports itself: its pytest command, with pyproject.toml's addopts, ends with the summary line
that counts passes and skips and lists every skip with its reason (`-rs`); a skip for a missing instruction
set names it and what the host has."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

from tests.conftest import REPO, isa_skip_reason


def ci_pytest_options() -> list[str]:
    """The options of .ci/run's pytest command: `<python> -m pytest OPTIONS tests`."""
    line = next(ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if " -m pytest " in ln)
    words = shlex.split(line)
    assert words[-1] == "tests", line
    return words[words.index("pytest") + 1 : -1]


def test_ci_run_ends_with_counts_and_skip_reasons(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n\n"
        "def test_passes():\n    pass\n\n"
        "def test_skips():\n    pytest.skip('needs AVX512-BF16 (host has AVX2 only)')\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", *ci_pytest_options(), "-c", str(REPO / "pyproject.toml")]
        + ["--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.fullmatch(r"1 passed, 1 skipped in [\d.]+s", lines[-1]), lines[-3:]
    assert any(ln.startswith("SKIPPED [1]") and ln.endswith("needs AVX512-BF16 (host has AVX2 only)") for ln in lines)


def test_isa_skip_reason_names_the_isa_and_the_host():
    reason = isa_skip_reason("the int4 k64 kernel", "AVX512-BF16")
    assert reason.startswith("the int4 k64 kernel needs AVX512-BF16 (host has ") and reason.endswith(")")
