"""Builds the package's one compiled part; everything else is in pyproject.toml.

The host executor's block copy (``jaxreshard/_src/exec/_blockcopy.c``) is a plain
C library loaded through ctypes. It is optional: where no C compiler is found
the install goes on without it, and the host executor copies with numpy alone.
"""

from setuptools import Extension, setup

setup(
  ext_modules=[
    Extension(
      "jaxreshard._src.exec._blockcopy",
      sources=["jaxreshard/_src/exec/_blockcopy.c"],
      optional=True,
    )
  ]
)
