"""Build the Cython twins. A compile failure fails the install: there is no silent pure-Python fallback.

``KVREF_PUREPYTHON=1 pip install .`` is the explicit way to install without compiling.
"""

import glob
import os

from setuptools import setup

ext_modules = []
if os.environ.get("KVREF_PUREPYTHON", "") not in ("1", "true", "yes"):
    import numpy
    from Cython.Build import cythonize
    from setuptools import Extension

    extensions = [
        Extension(
            path[:-4].replace(os.sep, "."),
            [path],
            include_dirs=[numpy.get_include()],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17"],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        )
        for path in sorted(glob.glob(os.path.join("kvref", "_*_c.pyx")))
    ]
    ext_modules = cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True, "initializedcheck": False},
    )

setup(ext_modules=ext_modules)
