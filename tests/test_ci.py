"""A skip that hides a start-up failure in CI is a failure (tests/ci.py): `skip_or_fail` skips outside CI and
fails with CI=true, as test_tp.py does when tensor_parallel_size=2 does not start (issue 39)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_alone(tmp_path: Path, ci: str | None) -> str:
    (tmp_path / "test_tp_start.py").write_text(
        "from ci import skip_or_fail\n\n"
        "def test_tp_reference():\n"
        "    skip_or_fail('vLLM tensor_parallel_size=2 on CPU does not run')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                          str(tmp_path), str(tmp_path / "test_tp_start.py")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip().splitlines()[-1]


def test_a_start_up_failure_is_a_skip_outside_ci_and_a_failure_in_ci(tmp_path):
    assert "1 skipped" in run_alone(tmp_path, None)
    assert "1 failed" in run_alone(tmp_path, "true")


def test_every_test_module_has_a_name_of_its_own():
    """pytest imports tests/ and tests/e2e/ by basename (no packages): two files with one name stop collection
    of the whole suite, which a run of only one directory never shows."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(TESTS)} and {path.relative_to(TESTS)}")
        seen.setdefault(path.name, path)
    assert not clashes, clashes
