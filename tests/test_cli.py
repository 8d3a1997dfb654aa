"""The command line, as a user runs it."""
import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import fastattn


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
    if args[0] == "bench":  # its extra (CI's sanitizer stage runs without it)
        for module in ("tqdm", "threadpoolctl"):
            pytest.importorskip(module)
    with tempfile.TemporaryDirectory() as cwd:
        p = subprocess.Popen([sys.executable, "-m", "fastattn", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=cwd, env=BUFFERED)
        p.stdout.close()
        err = p.stderr.read().decode()
        p.stderr.close()
        assert p.wait(timeout=300) in (0, 1), err
    assert err == ""


def test_help_into_a_closed_pipe():
    """Bare `fastattn 2>&1 | true`: the help goes to stderr, whose reader has
    gone; the command ends with a plain status, whatever the buffering."""
    with tempfile.TemporaryDirectory() as cwd:
        p = subprocess.Popen([sys.executable, "-m", "fastattn"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, cwd=cwd, env=BUFFERED)
        p.stdout.close()
        assert p.wait(timeout=300) in (1, 2)


def test_version():
    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"fastattn {fastattn.__version__}\n"


def test_no_command_prints_the_help():
    r = run()
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("usage: fastattn")
    for command in ("info", "demo", "bench", "--version"):
        assert command in r.stderr
    assert "Traceback" not in r.stderr and "required" not in r.stderr


def test_demo_help_says_what_it_shows():
    r = run("demo", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for what in ("worked examples", "Q, K, V", "scaled scores", "weights A", "output O = A V",
                 "--plot FILE.png"):
        assert what in text, what


def test_bench_help_names_every_peer():
    """The library of every runner, OpenVINO's too, in both help texts."""
    from fastattn.bench.runners import LIBRARY_NAMES, RUNNERS
    for args in (["--help"], ["bench", "--help"]):
        r = run(*args)
        assert r.returncode == 0, r.stderr
        text = " ".join(r.stdout.split())
        for runner in RUNNERS.values():
            assert LIBRARY_NAMES[runner.library] in text, (args, runner.library)


def test_gpt2_help_names_every_storage():
    """--compare-storage's help lists KVCache's storages from their table."""
    from fastattn._storage import FLOAT32_STORAGES
    script = Path(__file__).resolve().parents[1] / "examples" / "gpt2.py"
    if not script.exists():
        pytest.skip("examples/gpt2.py is not beside the tests")
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert f"caches in {', '.join(FLOAT32_STORAGES)} and compare" in text


def test_bench_notes_of_storages_read_right():
    """The note of a peer's row at a cache storage: no "a int8"."""
    import dataclasses
    import re

    from fastattn.bench.runners import RUNNERS
    from fastattn.bench.shapes import SHAPES
    torch = dataclasses.replace(RUNNERS["torch"], requires=())  # installed or not
    notes = [torch.missing(s) for s in SHAPES if s.storage != "float32"]
    assert notes and all(notes)
    assert not [n for n in notes if re.search(r"\ban? [a-z]", n)], notes
    assert notes[0].startswith("float16 key/value caches are fastattn's")


def test_bench_table_after_ctrl_c_has_no_empty_thread_block():
    """Ctrl-C during the 1-thread cases: the table ends there, with no
    header of the 2-thread block that never ran."""
    from fastattn.bench import report
    result = {
        "machine": {"cpu": "a CPU", "logical_cpus": 2, "simd_paths": ["portable"],
                    "fastattn": fastattn.__version__, "fastattn_simd": "portable",
                    "openmp": True, "numpy": "2", "python": "3"},
        "settings": {"shapes": ["tiny"], "runners": ["fastattn"], "simd": ["portable"],
                     "threads": [1, 2], "repeat": 3, "min_time": 0.2, "warmup": 1, "busy": 0,
                     "interrupted": True},
        "peaks": {},
        "cases": [{"runner": "fastattn", "simd": "portable", "shape": "tiny", "threads": 1,
                   "status": "ok", "median": 4e-6, "us": 4.0}]}
    table = report.format_table(result)
    assert "== 1 thread ==" in table and "4.0 us" in table
    assert "2 threads" not in table
    # a run under FASTATTN_INT8_DOT=off says so in its header (older records lack the key)
    assert "FASTATTN_INT8_DOT" not in table
    result["machine"]["int8_dot"] = False
    assert "without the CPU's dot products, FASTATTN_INT8_DOT=off" in report.format_table(result)


def test_bench_memory_column_is_never_negative(monkeypatch):
    """A first call that adds nothing and frees what its set-up held
    (OpenVINO's on window-8192 and packed-16) read -0.1 MB; it is 0."""
    from fastattn.bench import worker

    class Freed:  # PeakRSS as it read on those shapes
        bytes, why = -64 << 10, None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(worker, "PeakRSS", Freed)
    result = worker.run_case({"runner": "fastattn", "shape": "tiny", "threads": 1, "repeat": 0})
    assert result["status"] == "ok" and result["peak_extra_bytes"] == 0


@pytest.mark.parametrize("args, shapes", [
    (["--quick"], "QUICK_SHAPES"),
    ([], "DEFAULT_SHAPES"),
    (["--quick", "--shapes", "tiny,long-8192"], ("tiny", "long-8192")),  # as records ran it
])
def test_bench_quick_runs_a_few_shapes_unless_given(monkeypatch, args, shapes):
    """--quick alone: a few minutes' shapes; with --shapes, those."""
    pytest.importorskip("tqdm")
    pytest.importorskip("threadpoolctl")
    from fastattn.bench import cli as bench_cli
    from fastattn.bench import suite

    class Ran(Exception):
        pass

    def run_suite(shape_names, *rest, **settings):
        raise Ran(shape_names, settings["repeat"])

    monkeypatch.setattr(suite, "run_suite", run_suite)
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    with pytest.raises(Ran) as ran:
        bench_cli.main(parser.parse_args(args))
    want = getattr(bench_cli, shapes) if isinstance(shapes, str) else shapes
    assert ran.value.args == (list(want), 3 if "--quick" in args else 5)
    if "--quick" not in args:
        assert "long-8192" in want and len(want) > len(bench_cli.QUICK_SHAPES)
    elif not isinstance(shapes, tuple):
        assert set(want) < set(bench_cli.DEFAULT_SHAPES) and "long-8192" not in want


def test_demo():
    r = run("demo")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    # the three examples in full, from the inputs to the output
    for line in ("Q = [[1.0000, 0.0000], [0.0000, 1.0000]]",
                 "V = [[2.0000, 0.0000], [0.0000, 4.0000]]",
                 "S / sqrt(2) = [[0.7071, 0.0000], [0.0000, 0.7071]]",
                 "A = exp / sum = [[0.6698, 0.3302], [0.3302, 0.6698]]",
                 "O = A V = [[1.3395, 1.3210], [0.6605, 2.6790]]",
                 "mask M = [[0.0000, -inf], [0.0000, 0.0000]]",
                 "O = A V = [[2.0000, 0.0000], [0.6605, 2.6790]]",
                 "Q = [[1.0000, 0.0000], [0.0000, 1.0000], [1.0000, 1.0000]]",
                 "S = Q K^T = [[1.0000, 0.0000, 1.0000], [0.0000, 1.0000, 1.0000], "
                 "[1.0000, 1.0000, 2.0000]]",
                 "row sums = [5.0562, 5.0562, 8.1695]",
                 "[0.2483, 0.2483, 0.5035]]",
                 "[0.7517, 0.7517]]"):
        assert line in text, line
    # the tutorial's wrong row, said once
    assert text.count("0.27, 0.27, 0.46") == 1
    assert ("row 你, which it prints as weights 0.27, 0.27, 0.46 and output 0.73, 0.73; the "
            "exact values are 0.2483, 0.2483, 0.5035 and 0.7517, 0.7517") in text
    assert "DIFFERS" not in text and "NO." not in text
    # nothing outside the repository
    for outside in ("seed 0", "shared", "beside", "../"):
        assert outside not in text, outside


def test_demo_plot_refuses_a_name_without_png():
    """--plot writes exactly the name given, so it must be a .png name;
    refused before the demo runs."""
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-m", "fastattn", "demo", "--plot", "out"],
                           capture_output=True, text=True, timeout=300, cwd=cwd)
        assert os.listdir(cwd) == []
    assert r.returncode == 2 and r.stdout == ""
    assert "'out' does not end in .png" in r.stderr and "out.png" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("where, message", [
    ("/nonexistent-dir/w.png", "cannot write /nonexistent-dir/w.png: no such directory"),
    (".", "cannot write .: it is a directory"),
])
def test_demo_plot_path_checked_first(where, message):
    r = run("demo", "--plot", where)
    assert r.returncode == 2 and r.stdout == ""
    assert message in r.stderr and "Traceback" not in r.stderr


def test_demo_plot_without_matplotlib():
    """Checked before the demo runs: no walk-through that ends in an error."""
    with tempfile.TemporaryDirectory() as fake:
        os.mkdir(os.path.join(fake, "matplotlib"))
        with open(os.path.join(fake, "matplotlib", "__init__.py"), "w") as f:
            f.write("raise ImportError('not installed here')\n")
        path = os.pathsep.join(p for p in (fake, os.environ.get("PYTHONPATH")) if p)
        r = run("demo", "--plot", "w.png", env=dict(os.environ, PYTHONPATH=path))
    assert r.returncode == 2 and r.stdout == ""
    assert "matplotlib cannot be imported" in r.stderr
    assert "pip install 'fastattn[plot]'" in r.stderr and "Traceback" not in r.stderr


def test_demo_plot_writes_the_name_given():
    pytest.importorskip("matplotlib")
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-m", "fastattn", "demo", "--plot", "w.png"],
                           capture_output=True, text=True, timeout=300, cwd=cwd)
        assert r.returncode == 0, r.stderr
        assert os.listdir(cwd) == ["w.png"]
        with open(os.path.join(cwd, "w.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert r.stdout.rstrip().endswith("weights drawn in w.png")


def test_demo_plot_write_error_is_a_message(capsys):
    """A write that fails after the checks (say, the disk is full) ends with
    a message and exit status 1, not a traceback."""
    pytest.importorskip("matplotlib")
    from fastattn import demo
    assert demo.main("/nonexistent-dir/w.png") == 1
    assert "fastattn demo: cannot write /nonexistent-dir/w.png" in capsys.readouterr().err


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


def test_plot_name_with_another_suffix_suggests_png():
    """demo --plot x.jpg suggests x.png (it suggested x.jpg.png)."""
    from fastattn.bench import cli as bench_cli
    with pytest.raises(argparse.ArgumentTypeError, match=r"like x\.png$"):
        bench_cli.output_file(".png")("x.jpg")
