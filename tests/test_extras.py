"""The examples and the command line without an optional package: one line
naming the extra that installs it (fastattn/_extras.py), not a traceback.

The package is made unimportable in the child process (None in
sys.modules), so that these run where it is installed too."""
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fastattn import _extras

ROOT = Path(__file__).resolve().parents[1]

# sys.argv and the run of a script (a path) or of `python -m fastattn`, with
# the modules named first made unimportable
BLOCKED_RUN = """
import runpy, sys
blocked, target, args = sys.argv[1].split(","), sys.argv[2], sys.argv[3:]
for name in blocked:
    sys.modules[name] = None  # import name: ModuleNotFoundError
sys.argv = [target, *args]
if target == "fastattn":
    runpy.run_module("fastattn", run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
"""


def run_without(blocked, target, *args):
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run([sys.executable, "-c", BLOCKED_RUN, ",".join(blocked), target,
                               *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def example(name):
    path = ROOT / "examples" / f"{name}.py"
    if not path.exists():
        pytest.skip(f"examples/{name}.py is not beside the tests")
    return str(path)


@pytest.mark.parametrize("name, args, blocked, extra", [
    ("sharded_decode", [], ["ray"], "ray"),
    ("minilm", [], ["safetensors"], "minilm"),
    ("minilm", [], ["scipy"], "minilm"),
    ("transformers_generate", [], ["torch"], "transformers"),
    ("gpt2", ["--compare-storage"], ["ml_dtypes"], "bfloat16"),
    ("serve", ["--plot", "s.png"], ["matplotlib"], "plot"),
])
def test_example_without_its_extra_names_it(name, args, blocked, extra):
    r = run_without(blocked, example(name), *args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    # (transformers without torch warns of it on stderr first, in one line)
    line = r.stderr.splitlines()[-1]
    # (the others of the extra may be missing too: a minimal venv lists them all)
    missing = line.partition(": ")[2].partition(" cannot be imported")[0].split(", ")
    assert line.startswith(f"examples/{name}.py") and blocked[0] in missing
    assert line.endswith(f"install with: pip install 'fastattn[{extra}]'")


@pytest.mark.parametrize("args, blocked, extra", [
    (["bench", "--sharded"], ["ray"], "ray"),
    (["bench", "--shapes", "tiny"], ["tqdm"], "bench"),
    (["demo", "--plot", "w.png"], ["matplotlib"], "plot"),
])
def test_command_without_its_extra_names_it(args, blocked, extra):
    r = run_without(blocked, "fastattn", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    line, = r.stderr.splitlines()
    assert line.endswith(f"install with: pip install 'fastattn[{extra}]'")


def test_gpt2_without_ml_dtypes_runs_its_default():
    """Only --compare-storage needs bfloat16: the plain demo is NumPy's."""
    r = run_without(["ml_dtypes"], example("gpt2"), "--new-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "agree within 1e-4" in r.stdout


def test_extras_are_pyprojects():
    """EXTRAS lists the modules of every extra of pyproject.toml, no more."""
    tomllib = pytest.importorskip("tomllib")
    path = ROOT / "pyproject.toml"
    if not path.exists():
        pytest.skip("pyproject.toml is not beside the tests")
    with open(path, "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {extra: tuple(req.split(">")[0].split("=")[0].split("[")[0].strip()
                          for req in reqs) for extra, reqs in extras.items()}
    assert names == _extras.EXTRAS


def test_unknown_extra_is_refused():
    with pytest.raises(ValueError, match="extra must be one of plot, .*, got 'plots'"):
        _extras.install_command("plots")
