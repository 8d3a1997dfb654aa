"""Packaging: what the installed package holds, what a wheel and an sdist
would hold, and the message of a build without a C compiler.

The build checks run setup.py commands that compile nothing (build_py, sdist)
or stop at the first compiler probe, on a copy of the source tree: a few
seconds in all.  They are skipped where the tests run without the sources
(.ci/sanitize.sh copies tests/ alone).
"""
import importlib.metadata
import importlib.resources
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

import fastattn
from fastattn import _core, _peak

REPO = Path(__file__).resolve().parents[1]


def _why_setup_py_cannot_run():
    """'' when setup.py and pyproject's build requirements are at hand, else why not."""
    if not (REPO / "setup.py").is_file():
        return "the source tree (setup.py) is not beside the tests"
    try:
        import Cython  # noqa: F401
        import setuptools
    except ImportError as exc:
        return f"a build requirement is missing: {exc}"
    if int(setuptools.__version__.split(".")[0]) < 77:
        return f"setuptools {setuptools.__version__} is older than the 77 pyproject.toml asks for"
    return ""


NO_SETUP_PY = _why_setup_py_cannot_run()
needs_sources = pytest.mark.skipif(bool(NO_SETUP_PY), reason=NO_SETUP_PY)
needs_unix_cc = pytest.mark.skipif(sysconfig.get_config_var("CC") is None,
                                   reason="no Unix-style compiler (CC) in Python's build config")


def _installed_distribution():
    """The distribution that installed the imported fastattn, or skip.

    Run from a source tree (PYTHONPATH, an in-place build) the imported
    package is not the one the metadata describes.
    """
    try:
        dist = importlib.metadata.distribution("fastattn")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fastattn is not installed (imported from the source tree)")
    if dist.read_text("RECORD") is None:  # an egg-info of a source tree
        pytest.skip("fastattn is not installed from a wheel")
    if Path(dist.locate_file("fastattn/__init__.py")).resolve() != Path(fastattn.__file__).resolve():
        pytest.skip("the imported fastattn is not the installed distribution")
    return dist


def _copy_sources(dest):
    """The source tree without build products, as a clean checkout has it."""
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "*.so", "__pycache__", ".hypothesis",
        ".benchmarks", ".pytest_cache", ".venv*", "_core.c", "_peak.c", "*.html", "_build",
        "generated"))
    return dest


def _setup_py(src, *args, **env):
    return subprocess.run([sys.executable, "setup.py", *args], cwd=src, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def test_py_typed_is_in_the_package():
    # PEP 561: type checkers read the annotations of a package only with this marker
    assert importlib.resources.files("fastattn").joinpath("py.typed").is_file()


def test_installed_metadata():
    dist = _installed_distribution()
    meta = dist.metadata
    assert meta["License-Expression"] == "MIT"
    licenses = [f for f in dist.files if f.name == "LICENSE"]
    assert len(licenses) == 1, dist.files
    text = licenses[0].read_text()
    assert "MIT License" in text and "the fastattn developers" in text
    classifiers = meta.get_all("Classifier")
    assert "Topic :: Scientific/Engineering :: Artificial Intelligence" in classifiers
    # the Python versions named are the ones Requires-Python admits, from the oldest on
    oldest = re.fullmatch(r">=3\.(\d+)", meta["Requires-Python"]).group(1)
    minors = sorted(int(c.rsplit(".", 1)[1]) for c in classifiers
                    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert minors == list(range(int(oldest), minors[-1] + 1))
    assert sys.version_info.minor in minors


def test_installed_files():
    dist = _installed_distribution()
    names = {f.name for f in dist.files if f.parts[0] == "fastattn"}
    assert "py.typed" in names
    assert not {n for n in names if n.endswith((".c", ".pyx", ".pxd"))}
    for pyi in Path(fastattn.__file__).parent.rglob("*.pyi"):
        assert pyi.name in names


def _elf_sections(path):
    """Section names of a 64-bit little-endian ELF file, or None for another format."""
    data = Path(path).read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i):  # sh_name, sh_offset
        base = shoff + i * shentsize
        return struct.unpack_from("<I", data, base)[0], struct.unpack_from("<Q", data, base + 0x18)[0]

    strtab = header(shstrndx)[1]
    return {data[strtab + name:data.index(b"\0", strtab + name)].decode()
            for name, _ in map(header, range(shnum))}


@pytest.mark.parametrize("module", [_core, _peak], ids=["_core", "_peak"])
def test_extension_without_debug_info(module):
    if b"libasan" in Path(module.__file__).read_bytes():
        pytest.skip("a sanitizer build keeps its debug information")
    sections = _elf_sections(module.__file__)
    if sections is None:
        pytest.skip("not an ELF shared object")
    assert ".text" in sections
    assert not {s for s in sections if s.startswith(".debug")}


@needs_sources
def test_wheel_holds_modules_stubs_and_marker_only(tmp_path):
    # build_py lays out the pure part of the wheel (bdist_wheel adds the .so)
    src = _copy_sources(tmp_path / "src")
    for generated in ("fastattn/_core.c", "fastattn/bench/_stub_check.pyi", "fastattn/_check.pyi"):
        (src / generated).write_text("")  # a stale .c, and stubs the wheel must carry
    result = _setup_py(src, "build_py", "--build-lib", str(tmp_path / "lib"))
    assert result.returncode == 0, result.stderr
    files = {p.relative_to(tmp_path / "lib").as_posix()
             for p in (tmp_path / "lib").rglob("*") if p.is_file()}
    assert {"fastattn/py.typed", "fastattn/_check.pyi", "fastattn/bench/_stub_check.pyi",
            "fastattn/__init__.py", "fastattn/bench/__init__.py"} <= files
    assert {f for f in files if not f.endswith((".py", ".pyi", "py.typed"))} == set()


@needs_sources
def test_sdist_holds_the_sources(tmp_path):
    src = _copy_sources(tmp_path / "src")
    (src / "fastattn/_core.c").write_text("")  # left by an in-place build
    result = _setup_py(src, "sdist", "--dist-dir", str(tmp_path / "dist"))
    assert result.returncode == 0, result.stderr
    with tarfile.open(next((tmp_path / "dist").glob("fastattn-*.tar.gz"))) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    expected = {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "setup.py",
                "fastattn/py.typed", "fastattn/_core.pyx", "fastattn/_peak.pyx",
                "docs/conf.py", "docs/index.md", "docs/guide/serving.md"}
    expected |= {"csrc/" + p.name for p in (REPO / "csrc").iterdir()}
    assert expected <= names, expected - names
    assert "fastattn/_core.c" not in names  # Cython, a build requirement, writes it


def _last_line(result):
    return (result.stdout + result.stderr).strip().splitlines()[-1]


@needs_sources
@needs_unix_cc
def test_missing_compiler_is_one_clear_error(tmp_path):
    src = _copy_sources(tmp_path / "src")
    result = _setup_py(src, "build_ext", CC=str(tmp_path / "no-such-cc"))
    assert result.returncode != 0
    line = _last_line(result)
    assert line.startswith("error: fastattn needs a C compiler, and ")
    assert "no-such-cc" in line and "apt-get install gcc python3-dev" in line
    assert "xcode-select --install" in line
    assert "OpenMP" not in result.stdout + result.stderr  # the compiler is probed first


@needs_sources
@needs_unix_cc
def test_missing_python_headers_is_one_clear_error(tmp_path):
    # a compiler that works but is not shown the directory of Python.h, as
    # on a system without python3-dev
    real_cc = shutil.which(sysconfig.get_config_var("CC").split()[0])
    if real_cc is None:
        pytest.skip("Python's C compiler is not installed")
    cc = tmp_path / "cc-without-python-h"
    cc.write_text(f"#!{sys.executable}\n"
                  "import os, sys\n"
                  "args = [a for a in sys.argv[1:] if not (a.startswith('-I') and "
                  "os.path.exists(os.path.join(a[2:], 'Python.h')))]\n"
                  f"os.execv({real_cc!r}, [{real_cc!r}] + args)\n")
    cc.chmod(0o755)
    src = _copy_sources(tmp_path / "src")
    result = _setup_py(src, "build_ext", CC=str(cc))
    assert result.returncode != 0
    line = _last_line(result)
    assert line.startswith("error: fastattn needs the Python development headers (Python.h)")
    assert "apt-get install gcc python3-dev" in line
    assert "OpenMP" not in result.stdout + result.stderr
