"""Build the Cython twins and ship the conformance goldens inside the package.

A compile failure fails the install: there is no silent pure-Python fallback. ``KVREF_PUREPYTHON=1 pip install .``
is the explicit way to install without compiling; it leaves a ``PUREPYTHON`` marker in the package so that kvref
knows the Python twins were chosen (see ``kvref/_backend.py``).

The wheel carries ``conformance/`` (goldens, invalid inputs, tiny models, manifests; not the generator scripts) as
``kvref/conformance_data/``, so ``kvref conformance`` runs from any directory. An editable install reads them
from the checkout instead.
"""

import glob
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PUREPYTHON = os.environ.get("KVREF_PUREPYTHON", "") in ("1", "true", "yes")
# what `kvref conformance` reads; the generator scripts (which need llama-cpp-python) stay in the sdist only
CONFORMANCE_DATA = ("golden", "invalid", "models", "case.schema.json", "expected_failures.json")


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        pkg = Path(self.build_lib) / "kvref"
        if PUREPYTHON:
            (pkg / "PUREPYTHON").write_text("installed with KVREF_PUREPYTHON=1: the Python twins only\n")
        dest = pkg / "conformance_data"
        shutil.rmtree(dest, ignore_errors=True)
        for name in CONFORMANCE_DATA:
            src = Path("conformance") / name
            if src.is_dir():
                shutil.copytree(src, dest / name)
            elif src.exists():
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)


ext_modules = []
if not PUREPYTHON:
    import numpy
    from Cython.Build import cythonize
    from setuptools import Extension

    extensions = [
        Extension(
            path[:-4].replace(os.sep, "."),
            [path],
            include_dirs=[numpy.get_include()],
            language="c++",
            # -g0: no debug info (it would make the wheel 4x larger)
            extra_compile_args=["-O3", "-g0", "-std=c++17"],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        )
        for path in sorted(glob.glob(os.path.join("kvref", "**", "_*_c.pyx"), recursive=True))
    ]
    ext_modules = cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True, "initializedcheck": False},
    )

setup(ext_modules=ext_modules, cmdclass={"build_py": BuildPy})
