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


def test_demo_into_a_pipe_closed_early():
    """`fastattn demo | head -0`: the reader leaves (here before the demo has
    started writing); no traceback."""
    with tempfile.TemporaryDirectory() as cwd:
        p = subprocess.Popen([sys.executable, "-m", "fastattn", "demo"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=cwd)
        p.stdout.close()
        err = p.stderr.read().decode()
        assert p.wait(timeout=300) in (0, 1)
    assert "Traceback" not in err, err


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
