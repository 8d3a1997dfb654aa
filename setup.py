"""Build of the fastattn extension.

The C99 kernels in csrc/ are compiled here, each with its own flags (the
AVX2 path with -mavx2 -mfma -mf16c, the AVX-512 path with -mavx512f, everything
else, the NEON path of aarch64 too, for the baseline of the target), and linked into the Cython modules
fastattn._core (the kernels) and fastattn._peak (the machine-peak loops of
the benchmarks).

Environment variables read at build time:
  FASTATTN_OPENMP=0         build without OpenMP even when the compiler has it
  FASTATTN_MARCH=<arch>     add -march=<arch> (for example native); off by default
  FASTATTN_SANITIZE=<list>  add -fsanitize=<list> (for example address,undefined)
                            and keep debug information (-g)
Release builds carry no debug information (-g0 overrides the -g of Python's
own build flags) unless CFLAGS asks for it.  setuptools' build_ext, which is
Cython's when Cython is installed, cythonizes the .pyx sources: commands that
compile nothing (sdist, egg_info) do not run Cython.
"""
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor

import Cython  # noqa: F401  (a clear error when the build requirement is missing)
import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, PlatformError

CSRC = "csrc"
PORTABLE_SOURCES = ["fa_api.c", "fa_inst_portable.c", "fa_peak.c", "fa_rotary.c"]
# x86-64 paths, each compiled for its instruction set and chosen at run time
SIMD_SOURCES = {"fa_inst_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
                "fa_inst_avx512.c": ["-mavx512f", "-mavx2", "-mfma", "-mf16c"],
                "fa_peak_avx2.c": ["-mavx2", "-mfma"],
                "fa_peak_avx512.c": ["-mavx512f", "-mavx2", "-mfma"]}
# aarch64 paths: Advanced SIMD (NEON) is in the ARMv8-A baseline, so the
# default target of any aarch64 compiler builds them; chosen at run time too
NEON_SOURCES = ["fa_inst_neon.c", "fa_peak_neon.c"]
OPENMP_PROBE = r"""
#include <omp.h>
#include <stdio.h>
int main(void) {
    int n = 0;
#pragma omp parallel reduction(+ : n)
    n += 1;
    printf("%d\n", n);
    return n > 0 ? 0 : 1;
}
"""

# The int8 mode's AVX-VNNI instruction as csrc/fa_idot.h writes it: an
# assembler older than binutils 2.36 does not know it.
AVX_VNNI_PROBE = r"""
#include <immintrin.h>
__attribute__((target("avx2,avxvnni"))) __m256i f(__m256i a, __m256i u, __m256i s) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(a) : "x"(u), "x"(s));
    return a;
}
"""


INSTALL_COMPILER = ("Debian/Ubuntu: apt-get install gcc python3-dev; "
                    "Fedora: dnf install gcc python3-devel; macOS: xcode-select --install; "
                    "Windows: Microsoft C++ Build Tools")


def _cpus():
    """The CPUs this process may run on (its affinity mask can allow fewer
    than the machine has)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _is_x86_64():
    return platform.machine().lower() in ("x86_64", "amd64")


def _is_aarch64():
    return platform.machine().lower() in ("aarch64", "arm64")


class BuildExt(build_ext):
    """Probes the compiler and OpenMP, compiles csrc/ with per-file flags, then builds the modules."""

    def _require_compiler(self):
        """Ends the build with one line when no C compiler or no Python.h is at hand.

        Without this a missing compiler shows first as a failed OpenMP probe,
        and its own error comes dozens of lines later.
        """
        name = getattr(self.compiler, "compiler_so", ["the C compiler"])[0]
        tmp = tempfile.mkdtemp()
        try:
            # Python.h: on the include path build_ext gave the compiler
            for what, code in ((f"fastattn needs a C compiler, and {name} cannot run", ""),
                               (f"fastattn needs the Python development headers (Python.h), "
                                f"and {name} cannot find them", "#include <Python.h>\n")):
                src = os.path.join(tmp, "probe.c")
                with open(src, "w") as f:
                    f.write(code + "int main(void) { return 0; }\n")
                try:
                    self.compiler.compile([src], output_dir=tmp)
                except (CCompilerError, ExecError, PlatformError) as exc:
                    # setuptools prints it as the build's last line, "error: ..."
                    raise CompileError(f"{what} ({exc}); to install a compiler and the headers: "
                                       f"{INSTALL_COMPILER}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _probe(self, source, flags=(), run=False):
        """Whether source compiles with flags (and, with run, links and runs)."""
        tmp = tempfile.mkdtemp()
        try:
            src = os.path.join(tmp, "probe.c")
            with open(src, "w") as f:
                f.write(source)
            objs = self.compiler.compile([src], output_dir=tmp, extra_postargs=list(flags))
            if run:
                exe = os.path.join(tmp, "probe")
                self.compiler.link_executable(objs, "probe", output_dir=tmp,
                                              extra_postargs=list(flags))
                subprocess.run([exe], check=True, capture_output=True, timeout=60)
            return True
        except Exception:
            return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def build_extensions(self):
        self._require_compiler()
        unix = self.compiler.compiler_type == "unix"
        # Functions start on 64-byte lines, so that the placement of a hot
        # loop does not move with the size of the code linked before it
        # (docs/guide/threads-and-speed.md, "Code placement").
        common = ["-O3", "-falign-functions=64"] if unix else ["/O2"]
        link = []
        march = os.environ.get("FASTATTN_MARCH")
        if march and unix:
            common.append("-march=" + march)
        sanitize = os.environ.get("FASTATTN_SANITIZE")
        if sanitize and unix:
            # any report is fatal, so that a test run fails on the first one
            flags = ["-fsanitize=" + sanitize, "-fno-sanitize-recover=all",
                     "-fno-omit-frame-pointer", "-g"]
            common += flags
            link += ["-fsanitize=" + sanitize]
        elif unix and not any(f.startswith("-g") for f in os.environ.get("CFLAGS", "").split()):
            common.append("-g0")  # Python's CFLAGS carry -g: 5.3 of the 6.5 MB of the modules

        omp_flag = "-fopenmp" if unix else "/openmp"
        use_omp = os.environ.get("FASTATTN_OPENMP", "1") != "0"
        if use_omp and not self._probe(OPENMP_PROBE, [omp_flag], run=True):
            warnings.warn("fastattn: the compiler cannot build and run an OpenMP program; "
                          "building a serial extension")
            use_omp = False
        if use_omp:
            common.append(omp_flag)
            link.append(omp_flag)
        if unix and _is_x86_64() and not self._probe(AVX_VNNI_PROBE):
            common.append("-DFA_NO_AVX_VNNI")  # the int8 mode sums as on a CPU without it
        print(f"fastattn build: openmp={'yes' if use_omp else 'no'} flags={' '.join(common)}")

        # -fno-trapping-math: floating-point exceptions are never unmasked, so
        # gcc may turn the branch-free selects of the exp into vector code; no
        # result changes (unlike -ffast-math, NaN and inf keep their meaning).
        c99 = ["-std=c99", "-Wall", "-Wextra", "-fno-trapping-math"] if unix else []
        build_tmp = os.path.join(self.build_temp, "csrc")
        baseline = PORTABLE_SOURCES + (NEON_SOURCES if _is_aarch64() else [])
        jobs = [(source, []) for source in baseline]
        if _is_x86_64():
            for source, flags in SIMD_SOURCES.items():
                if not unix:  # MSVC spells them /arch:AVX2, /arch:AVX512
                    flags = ["/arch:AVX512" if "avx512" in source else "/arch:AVX2"]
                jobs.append((source, flags))
        # a compiler process per file, as many at once as there are CPUs to
        # run them (each file instantiates kernels for two element types: the
        # build is most of an install's time)
        workers = _cpus()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            compiled = pool.map(lambda job: self.compiler.compile(
                [os.path.join(CSRC, job[0])], output_dir=build_tmp,
                extra_postargs=common + c99 + job[1]), jobs)
            objects = [obj for objs in compiled for obj in objs]
        if self.parallel is None:  # _core and _peak at once too
            self.parallel = workers
        for ext in self.extensions:  # each module links only its own objects
            own = [obj for obj in objects
                   if ("fa_peak" in os.path.basename(obj)) == (ext.name == "fastattn._peak")]
            ext.extra_objects = own + list(ext.extra_objects or [])
            ext.extra_compile_args = common + list(ext.extra_compile_args or [])
            ext.extra_link_args = link + list(ext.extra_link_args or [])
            if unix:
                ext.libraries = list(ext.libraries or []) + ["m"]
        super().build_extensions()


extensions = [
    Extension(
        name,
        sources=[f"fastattn/{name.split('.')[-1]}.pyx"],
        include_dirs=[CSRC, numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        depends=[os.path.join(CSRC, f) for f in os.listdir(CSRC)],
    )
    for name in ("fastattn._core", "fastattn._peak")
]

setup(
    ext_modules=extensions,  # cythonized by build_ext; directives: first line of each .pyx
    cmdclass={"build_ext": BuildExt},
)
