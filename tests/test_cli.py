"""The command line, as a user runs it."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def run(*args, env=None):
    # from a directory without the source tree, so that the installed package is found
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run([sys.executable, "-m", "fastattn", *args], capture_output=True,
                              text=True, timeout=300, env=env, cwd=cwd)


def test_info():
    r = run("info")
    assert r.returncode == 0, r.stderr
    assert "SIMD path:" in r.stdout and "OpenMP:" in r.stdout and "threads:" in r.stdout


def test_info_portable_forced():
    r = run("info", env=dict(os.environ, FASTATTN_SIMD="portable"))
    assert r.returncode == 0, r.stderr
    assert "SIMD path: portable" in r.stdout


BUFFERED = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
QUICK_BENCH = ["bench", "--shapes", "tiny", "--runners", "fastattn", "--threads", "1", "--quick",
               "--repeat", "1", "--min-time", "0", "--no-progress"]


@pytest.mark.parametrize("args", [["demo"], ["info"], ["demo", "--help"], QUICK_BENCH],
                         ids=["demo", "info", "help", "bench"])
def test_pipe_closed_early(args):
    """`fastattn demo | head -0`: the reader leaves (here before the command
    has written anything); the command ends quietly.  Without
    PYTHONUNBUFFERED (a fresh machine's default) stdout into a pipe is block
    buffered, so the broken pipe appears in the last flush: that one too."""
    with tempfile.TemporaryDirectory() as cwd:
        p = subprocess.Popen([sys.executable, "-m", "fastattn", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=cwd, env=BUFFERED)
        p.stdout.close()
        err = p.stderr.read().decode()
        p.stderr.close()
        assert p.wait(timeout=300) in (0, 1), err
    assert err == ""


def test_demo():
    r = run("demo")
    assert r.returncode == 0, r.stderr
    assert "2 printed value(s) in the tutorials differ" in r.stdout


def test_bad_command():
    r = run("nonsense")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_import_from_the_source_tree_explains_itself():
    """Inside the repository the source folder hides the installed package;
    without a compiled extension in it the error says what to do."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "fastattn" / "__init__.py").exists():
        pytest.skip("the tests run without the source tree beside them")
    if list((root / "fastattn").glob("_core*.so")) + list((root / "fastattn").glob("_core*.pyd")):
        pytest.skip("built in place: the source tree imports")
    r = subprocess.run([sys.executable, "-c", "import fastattn"], capture_output=True, text=True,
                       cwd=root, timeout=60)
    assert r.returncode != 0
    assert "start Python from another directory" in r.stderr
