"""The command line, as a user runs it."""
import subprocess
import sys


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "fastattn", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_info():
    r = run("info")
    assert r.returncode == 0, r.stderr
    assert "SIMD path:" in r.stdout and "OpenMP:" in r.stdout and "threads:" in r.stdout


def test_info_portable_forced():
    import os
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
