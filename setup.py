"""Build of the optional native kernels (``deltastore._native``) and of the bundled
documentation; everything else is in pyproject.toml.

The extension is ``optional``: on a machine without a working C compiler ``pip install`` still
succeeds and deltastore runs its numpy path (same bytes, slower; one WARNING says so, see
deltastore/_util/kernels.py). The sources need only Python's headers (buffers come in through
the buffer protocol, so numpy is not a build dependency).

Sanitizer build (see docs/design/006-native-kernels.md)::

    CFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -O1" \
    LDFLAGS="-fsanitize=address,undefined" python setup.py build_ext --inplace --force
"""

import glob
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = "deltastore/_native"

# -O3: the kernels are tight loops over elements that gcc/clang vectorize only at -O3.
OPT = ["/O2"] if os.name == "nt" else ["-O3"]

native = Extension(
    "deltastore._native",
    sources=sorted(glob.glob(f"{SRC}/*.c", root_dir=HERE)),
    depends=sorted(glob.glob(f"{SRC}/*.h", root_dir=HERE)),
    include_dirs=[SRC],
    extra_compile_args=OPT,
    # zstd.c loads the system's libzstd at run time (dlopen: in libc since glibc 2.34, in libdl
    # before; nothing to build against)
    libraries=["dl"] if sys.platform.startswith("linux") else [],
    optional=True,  # no compiler, or it fails: install anyway, the numpy path runs
)


class BuildExtSideBySide(build_ext):
    """Compile the extension's sources side by side, one compiler process per core: setuptools
    compiles the sources of one extension one after another (its ``parallel`` option spreads
    extensions over processes, and there is one), and the kernels at -O3 take seconds each."""

    def build_extension(self, ext: Extension) -> None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if self.compiler.compiler_type != "unix" or cores < 2 or len(ext.sources) < 2:
            super().build_extension(ext)
            return
        compile_each = self.compiler.compile

        def compile_all(sources, *args, **kwargs):
            with ThreadPoolExecutor(min(cores, len(sources))) as pool:
                return [obj for objs in pool.map(lambda src: compile_each([src], *args, **kwargs), sources)
                        for obj in objs]

        self.compiler.compile = compile_all
        try:
            super().build_extension(ext)
        finally:
            del self.compiler.compile  # the instance's stand-in: the class's method again


class BuildWithDocs(build_py):
    """Copy the user documentation (docs/*.md, docs/design/*.md) into the package as
    ``deltastore/_docs/``, so that ``deltastore docs`` and the ``--help`` pointers work where
    only the wheel is installed (an editable install reads the checkout's docs/ instead)."""

    def run(self) -> None:
        super().run()
        for src in sorted(glob.glob("docs/*.md", root_dir=HERE) + glob.glob("docs/design/*.md", root_dir=HERE)):
            dst = os.path.join(self.build_lib, "deltastore", "_docs", os.path.relpath(src, "docs"))
            self.mkpath(os.path.dirname(dst))
            self.copy_file(os.path.join(HERE, src), dst)


setup(ext_modules=[native], cmdclass={"build_ext": BuildExtSideBySide, "build_py": BuildWithDocs})
