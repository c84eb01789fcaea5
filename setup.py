"""Package discovery only (metadata and dependencies are in pyproject.toml).

The folders ``schemas``, ``runtime`` and ``pipelines`` install as ``specstore.schemas``,
``specstore.runtime`` and ``specstore.pipelines``, every subpackage included: the packages are
found on disk, so a new subpackage cannot be left out of the wheel. No bare top-level
``runtime`` or ``schemas`` package is ever installed.
"""

from setuptools import find_packages, setup

TOP = ("schemas", "runtime", "pipelines")

setup(
    packages=[f"specstore.{name}" for name in find_packages(include=[*TOP, *(f"{top}.*" for top in TOP)])],
    package_dir={f"specstore.{top}": top for top in TOP},
    # the CPU kernel's C source, compiled on first use on the user's machine (runtime/gemm.py)
    package_data={"specstore.runtime": ["csrc/*.c"]},
)
