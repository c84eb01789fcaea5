"""Check the specstore wheel as a user installs it: run by ``make check-wheel`` with the python of
a fresh virtualenv holding the wheel (not editable), from outside the source tree.

Usage: python check_wheel.py SOURCE_TREE

- the installed package is the wheel's (inside this virtualenv), not the source tree;
- every module of the source folders (schemas, runtime, pipelines) is in it, under specstore.*;
- every module imports, and the runtime and schemas import without Beam;
- ``specstore --help`` and each command's ``--help`` run from the console script, stderr empty;
- the CPU kernel's C source (package data, compiled on the user's machine) is in it.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

TOP = ("schemas", "runtime", "pipelines")


def fail(message: str) -> None:
    print(f"check-wheel: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def main() -> None:
    source = Path(sys.argv[1]).resolve()
    import specstore.runtime

    installed = Path(specstore.runtime.__file__).resolve().parent.parent
    if not installed.is_relative_to(Path(sys.prefix).resolve()):
        fail(f"specstore is imported from {installed}, not from this virtualenv ({sys.prefix})")
    for top in TOP:
        want = {p.relative_to(source / top) for p in (source / top).rglob("*.py") if "__pycache__" not in p.parts}
        have = {p.relative_to(installed / top) for p in (installed / top).rglob("*.py")} if (installed / top).is_dir() else set()
        if want - have:
            fail(f"the wheel lacks {', '.join(sorted(f'{top}/{p}' for p in want - have))}")

    kernel = installed / "runtime" / "csrc" / "small_gemm.c"
    if not kernel.is_file():
        fail("the wheel lacks runtime/csrc/small_gemm.c (the CPU kernel's source, package data)")
    from specstore.runtime import gemm

    if gemm.SOURCE.resolve() != kernel.resolve():
        fail(f"the CPU kernel's source is read from {gemm.SOURCE}, not from the wheel")
    if (source / "runtime" / "csrc" / "small_gemm.c").read_bytes() != kernel.read_bytes():
        fail("the wheel's runtime/csrc/small_gemm.c differs from the source tree's")

    modules = []
    for top in TOP:  # schemas and runtime first: they must import without Beam
        package = importlib.import_module(f"specstore.{top}")
        modules.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            importlib.import_module(info.name)
            modules.append(info.name)
        if top == "runtime" and any(m.split(".")[0] == "apache_beam" for m in sys.modules):
            fail("importing specstore.runtime imported apache_beam")
        if top == "runtime":
            from specstore.runtime.cli_options import quiet_beam_import

            quiet_beam_import()  # before the pipelines import Beam

    from specstore.runtime.cli import _build_parser

    parser = _build_parser()
    commands = next(a for a in parser._actions if a.choices and a.dest == "command").choices
    script = Path(sys.executable).parent / "specstore"
    for argv in [["--help"], *([name, "--help"] for name in commands)]:
        done = subprocess.run([str(script), *argv], capture_output=True, text=True)
        if done.returncode != 0 or not done.stdout.startswith("usage: specstore") or done.stderr:
            fail(f"specstore {' '.join(argv)}: exit {done.returncode}, stderr {done.stderr.strip()[-500:]!r}")
    print(f"check-wheel: {len(modules)} modules import from {installed}; specstore --help and {len(commands)} "
          f"commands' --help run ({', '.join(commands)})")


if __name__ == "__main__":
    main()
