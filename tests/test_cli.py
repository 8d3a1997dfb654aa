"""The command line, as a user runs it."""
import os
import subprocess
import sys
import tempfile


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


def test_demo():
    r = run("demo")
    assert r.returncode == 0, r.stderr
    assert "2 printed value(s) in the tutorials differ" in r.stdout


def test_bad_command():
    r = run("nonsense")
    assert r.returncode == 2 and "invalid choice" in r.stderr
