"""Checks the CLI makes before any command does work: unknown options, URI stores, Beam's noise.

- Options a command does not define are an error naming the option (with the closest option of
  the command suggested), except for a command that forwards them to Beam (``build``): there an
  option is passed on only when the installed Beam's ``PipelineOptions`` (every registered
  option group, the chosen runner's included) defines it. Beam is imported only for that check,
  which only the commands that build run.
- A ``--store`` that looks like a URI (``scheme://...``) must be one of the object stores
  LanceDB reaches (storage.py), so that it is never taken for a relative local folder named
  ``scheme:``; ``--storage-option`` values must be ``KEY=VALUE``.
- Importing Beam logs "apitools not found ..." on the root logger (its BigQuery client module,
  imported by ``apache_beam.io``); :func:`quiet_beam_import` drops exactly that record.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import re

from specstore.runtime.errors import SpecstoreError

__all__ = ["check_beam_options", "check_store", "quiet_beam_import", "reject_unknown"]

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_APITOOLS = "apitools not found, and bigquery client libraries are not available"


def check_store(value: str | None, storage_options: list[str] | None = None) -> None:
    """Refuse a store URI of a scheme no store supports, and a storage option not KEY=VALUE."""
    from specstore.runtime.storage import parse_storage_options, split_uri

    if value and _URI.match(value):
        split_uri(value)
    parse_storage_options(storage_options)


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


def _closest(name: str, options: list[str]) -> str | None:
    """The option of ``options`` closest to ``name`` (``_`` and ``-`` compared alike), or None."""
    def plain(option: str) -> str:
        return option.lstrip("-").replace("_", "-")

    by_plain = {plain(o): o for o in options}
    match = difflib.get_close_matches(plain(name), list(by_plain), n=1, cutoff=0.6)
    return by_plain[match[0]] if match else None


def _unknown(command: str, arg: str, suggest_from: list[str], what: str) -> SpecstoreError:
    if not arg.startswith("-"):
        return SpecstoreError(f"unexpected argument {arg!r} for {command}")
    name = arg.split("=", 1)[0]
    hint = _closest(name, suggest_from)
    hint = f"; did you mean {hint}?" if hint else ""
    return SpecstoreError(f"unknown option {name} for {command} ({what}){hint}")


def reject_unknown(command: str, parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """For a command that forwards nothing: any leftover argument is an error."""
    if extra:
        first = next((a for a in extra if a.startswith("-")), extra[0])
        raise _unknown(command, first, _long_options(parser), f"see specstore {command} --help")


def quiet_beam_import() -> None:
    """Drop Beam's "apitools not found ... bigquery" warning (a root-logger record written while
    ``apache_beam`` is imported, harmless without BigQuery); every other record still passes.
    Call it before Beam is imported; calling it again adds nothing."""
    root = logging.getLogger()
    if not any(isinstance(f, _ApitoolsFilter) for f in root.filters):
        root.addFilter(_ApitoolsFilter())


class _ApitoolsFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and isinstance(record.msg, str) and record.msg.startswith(_APITOOLS))


def check_beam_options(command: str, parser: argparse.ArgumentParser, runner: str, extra: list[str]) -> None:
    """Accept ``extra`` only if every option in it is one of the installed Beam's pipeline options
    (values are parsed too, so a bad value fails here); raise a one-line SpecstoreError naming the
    first unknown option (suggesting the closest option of ``command``, else of Beam) otherwise.
    ``runner`` must name a runner Beam can create (its module registers its own option group)."""
    quiet_beam_import()
    from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions, _BeamArgumentParser
    from apache_beam.runners.runner import create_runner

    try:
        create_runner(runner)
    except ValueError:
        known = ", ".join(StandardOptions.KNOWN_RUNNER_NAMES)
        raise SpecstoreError(f"unknown Beam runner {runner!r} (--runner): choose one of {known} or a runner class path") from None
    except ImportError as exc:
        raise SpecstoreError(f"Beam runner {runner!r} is not available here: {exc}") from None

    class _Parser(_BeamArgumentParser):
        def error(self, message):  # a bad value of a known option: one line, not Beam's usage text
            raise SpecstoreError(f"Beam option: {message}")

    beam = _Parser(allow_abbrev=False, add_help=False, conflict_handler="resolve")
    seen: set[str] = set()
    stack = list(PipelineOptions.__subclasses__())
    while stack:  # every registered option group, subclasses of subclasses included
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if str(cls) not in seen:
            seen.add(str(cls))
            cls._add_argparse_args(beam)
    _, unknown = beam.parse_known_args(extra)
    if unknown:
        ours = _long_options(parser)
        first = next((a for a in unknown if a.startswith("-")), unknown[0])
        name = first.split("=", 1)[0]
        suggest = ours if _closest(name, ours) else _long_options(beam)
        raise _unknown(command, first, suggest, "neither a specstore option nor a Beam pipeline option")
