"""The ``pagedbench`` command line (``main``, the console script).

``pagedbench run``      check and time implementations on cases (``--resume RUN_ID``
                        finishes an interrupted run).
``pagedbench bench``    the benchmark sweep: workloads x block sizes x dtypes, each point
                        checked, then timed (``harness.run.bench``).
``pagedbench loop``     a serving loop on one implementation: one pool, blocks reused,
                        prefix hits, forks, preemption, plans replayed (``harness.run.loop``).
``pagedbench list``     implementations, their availability (with reasons), version and build;
                        ``list NAME`` or ``--wide``: what each declares.
``pagedbench report``   the leaderboard of stored result files (Markdown, CSV or HTML).
``pagedbench gate``     current results against a baseline: exit 1 on a conformance
                        regression or a slowdown beyond noise
                        (:mod:`pagedbench.harness.gate.compare`).
``pagedbench schema``   the JSON Schema of a results-file line.
``pagedbench simulate`` KV capacity: contiguous reservation vs paged allocation on a trace.
``pagedbench tune``     the block size per workload, from measured kernel time and simulated
                        capacity together (:mod:`pagedbench.harness.capacity.tune`).
``pagedbench replay``   re-run one case (a failure's case file, a result line) and show
                        the verdict and its figures, or a serving loop's saved trace.
``pagedbench selftest`` run the conformance suite on the fault catalogue: which property
                        catches each fault.

Implementations are found without importing them and imported only in worker processes
(:func:`pagedbench.harness.run.protocol.worker_main`), so no plug-in can take a command down. Bad options and
input files are refused with the option, the value and what is allowed (exit 2); exit codes are
those of :class:`~pagedbench.harness.verdict.status.ExitCode`. Each command's options and body are
in the modules :data:`COMMANDS` names, imported only when that command is chosen: ``--help``
and a wrong command import none of them. The options (``*_options.py``, and the constants
they show) import nothing heavy, so a command's ``--help`` and its usage errors answer
without torch or pandas; its body imports what it needs once the arguments are parsed.
This module builds the parser and turns errors into exit codes.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path
from collections.abc import Iterable
from typing import NamedTuple, NoReturn

from pagedbench.harness.run.environment import (apply_environment, cache_environment,
                                                default_cache_dir, heavy_imports)
from pagedbench.harness.verdict.status import ExitCode, exit_codes_help


class Command(NamedTuple):
    """One command: ``module:function`` that adds its parser to the sub-parsers, the one
    that runs it on the parsed arguments (returns the exit code), and its line of help."""

    add_parser: str
    run: str
    help: str


CLI = "pagedbench.harness.cli"
COMMANDS = {
    "run": Command(f"{CLI}.run_options:add_parser", f"{CLI}.run:cmd_run",
                   "check and time implementations on model-preset cases"),
    "bench": Command(f"{CLI}.bench_options:add_parser", f"{CLI}.bench:cmd_bench",
                     "benchmark sweep: block size x batch x GQA layout x context x mode x dtype"),
    "loop": Command(f"{CLI}.loop_options:add_parser", f"{CLI}.loop:cmd_loop",
                    "a serving loop on one implementation: one pool, blocks reused, prefix "
                    "hits, forks, preemption, plans replayed"),
    "list": Command(f"{CLI}.listing_options:add_parser", f"{CLI}.listing:cmd_list",
                    "implementations: available here or why not, version, build; NAME or "
                    "--wide: what each declares"),
    "report": Command(f"{CLI}.results_options:add_report_parser", f"{CLI}.results:cmd_report",
                      "leaderboard from stored result files"),
    "schema": Command(f"{CLI}.results_options:add_schema_parser", f"{CLI}.results:cmd_schema",
                      "JSON Schema of a results-file line (docs/results.md)"),
    "simulate": Command(f"{CLI}.capacity_options:add_simulate_parser",
                        "pagedbench.harness.capacity.simulate:run",
                        "KV capacity: contiguous reservation vs paged allocation on a trace"),
    "tune": Command(f"{CLI}.capacity_options:add_tune_parser",
                    "pagedbench.harness.capacity.tune:run",
                    "block size per workload from measured kernel time and simulated capacity"),
    "replay": Command(f"{CLI}.replay_options:add_replay_parser", f"{CLI}.replay:cmd_replay",
                      "re-run one case through the conformance check, in a worker"),
    "selftest": Command(f"{CLI}.replay_options:add_selftest_parser",
                        f"{CLI}.replay:cmd_selftest",
                        "run the conformance suite on the fault catalogue"),
    "gate": Command(f"{CLI}.results_options:add_gate_parser", f"{CLI}.results:cmd_gate",
                    "current results against a baseline: exit 1 on a conformance regression "
                    "or a slowdown"),
}


def _function(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _parser(full: Iterable[str] = COMMANDS) -> argparse.ArgumentParser:
    """The parser of every command: those in ``full`` with their options (their modules
    imported; one without a description of its own shows its line of help), the others by
    name and help alone. ``main`` first parses with none in full, so that ``--help`` and a
    missing or unknown command answer before any command's module is imported."""
    parser = argparse.ArgumentParser(prog="pagedbench", description=__doc__.split("\n\n")[0],
                                     epilog=exit_codes_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        if name in full:
            _function(command.add_parser)(sub)
            sub.choices[name].description = sub.choices[name].description or command.help
        else:
            sub.add_parser(name, help=command.help, add_help=False)
    return parser


def _writable_outputs(args: argparse.Namespace) -> None:
    """Check every output folder a command was given, before it runs."""
    from pagedbench.harness.cli.options import writable_folder

    for dest, option in (("results_dir", "--results-dir"), ("cache_dir", "--cache-dir"),
                         ("output_dir", "--output-dir"), ("plots_dir", "--plots-dir")):
        if getattr(args, dest, None) is not None:
            writable_folder(getattr(args, dest), option)


#: Commands that write nothing unless given an output (``--output``, ``--plots-dir``,
#: ``--update-baseline``): they create no cache folder, so they work in a read-only folder.
READ_ONLY_COMMANDS = frozenset({"schema", "report", "gate"})
#: ``errno`` values of a write the machine refused (full disk or quota, I/O error, file
#: too large, read-only file system): exit :attr:`ExitCode.WRITE_ERROR`, not a bug.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS})


def main(argv: list[str] | None = None, *, console: bool = False) -> int:
    """Run the command ``argv`` names (default ``sys.argv[1:]``); returns the exit code
    (:class:`~pagedbench.harness.verdict.status.ExitCode`; ``128 + N`` when stopped by signal
    N). ``console``: this process exists for the command (:func:`console_main`), so it
    imports as such a process does (:func:`~pagedbench.harness.run.environment.heavy_imports`)
    and says its warnings as its own lines (:func:`_warnings_as_lines`)."""
    command = _parser(full=()).parse_known_args(argv)[0].command
    args = _parser(full=[command]).parse_args(argv)
    if console:
        _warnings_as_lines(command)
    importing = heavy_imports if console else contextlib.nullcontext
    with importing():  # once the arguments are parsed (the store imports torch)
        from pagedbench.reference import PagedInputError

        from pagedbench.harness.results.store import OutputError

    try:
        _writable_outputs(args)
        apply_environment(cache_environment(getattr(args, "cache_dir", default_cache_dir()),
                                            create=args.command not in READ_ONLY_COMMANDS))
        with importing():
            run = _function(COMMANDS[command].run)
        return run(args)
    except PagedInputError as exc:
        print(f"pagedbench {args.command}: error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE_ERROR)
    except BrokenPipeError:  # e.g. `pagedbench report ... | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OutputError as exc:
        print(f"pagedbench {args.command}: error: {exc}", file=sys.stderr)
        return int(ExitCode.WRITE_ERROR)
    except Exception as exc:  # a bug of pagedbench's: say so, with where it happened
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:  # a write elsewhere
            where = Path(exc.filename) if exc.filename else Path("an output file")
            print(f"pagedbench {args.command}: error: {OutputError.of(where, exc)}",
                  file=sys.stderr)
            return int(ExitCode.WRITE_ERROR)
        print(f"pagedbench {args.command}: internal error (a pagedbench bug; exit "
              f"{int(ExitCode.HARNESS_FAULT)}): {type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exc()
        return int(ExitCode.HARNESS_FAULT)


def _warnings_as_lines(command: str) -> None:
    """Show each warning of this process as ``pagedbench COMMAND: warning: TEXT`` on
    stderr, without Python's category and source line; like Python's own, dropped when
    stderr is closed or cannot be written."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if sys.stderr is not None:
            with contextlib.suppress(OSError):
                sys.stderr.write(f"pagedbench {command}: warning: {message}\n")

    warnings.showwarning = show


def console_main() -> NoReturn:
    """The ``pagedbench`` console script and ``python -m pagedbench``: :func:`main`, then
    exit with its code. A judge thread still in its torch work (left past a signal or its
    budget) would have torch torn down under it by the interpreter's exit, which aborts the
    process (``std::terminate``: exit 134, not the code the run recorded); the process then
    leaves at once, its output flushed (the results file is written record by record)."""
    code = main(console=True)
    runner = sys.modules.get("pagedbench.harness.run.runner")  # only a run starts judges
    if runner is not None and runner.judges_running():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
