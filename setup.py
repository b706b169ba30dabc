"""Build of the C++ post stage extension (service/post/_post.cpp); metadata: pyproject.toml.

`pip install -e ".[dev]"` (what `make install` runs) compiles it; pybind11 comes from the
build requirements in pyproject.toml. Needs a C++17 compiler.
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "service.post._post",
            ["service/post/_post.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ]
)
