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
in one module of this package (:mod:`.run`, :mod:`.bench`, :mod:`.listing`, :mod:`.results`,
:mod:`.replay`;
``simulate``'s in :mod:`pagedbench.harness.capacity.simulate`); this one builds the parser and
turns errors into exit codes.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import traceback
from pathlib import Path

from pagedbench.reference import PagedInputError

from pagedbench.harness.capacity import simulate, tune
from pagedbench.harness.cli import bench, listing, loop, replay, results, run
from pagedbench.harness.cli.options import cache_dir_argument, writable_folder
from pagedbench.harness.results.store import OutputError
from pagedbench.harness.run.environment import (apply_environment, cache_environment,
                                                default_cache_dir)
from pagedbench.harness.verdict.status import ExitCode, exit_codes_help


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedbench", description=__doc__.split("\n\n")[0],
                                     epilog=exit_codes_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run.add_parser(sub)
    bench.add_parser(sub)
    loop.add_parser(sub)
    listing.add_parser(sub)
    results.add_parsers(sub)
    simulate.add_arguments(sub.add_parser(
        "simulate", help="KV capacity: contiguous reservation vs paged allocation on a trace"))
    tune_parser = sub.add_parser(
        "tune", help="block size per workload from measured kernel time and simulated capacity",
        description=tune.__doc__.split("\n\n")[0], epilog=exit_codes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    tune.add_arguments(tune_parser)
    cache_dir_argument(tune_parser)
    replay.add_replay_parser(sub)
    replay.add_selftest_parser(sub)
    return parser


def _writable_outputs(args: argparse.Namespace) -> None:
    """Check every output folder a command was given, before it runs."""
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pagedbench`` console script; returns the exit code
    (:class:`~pagedbench.harness.verdict.status.ExitCode`; ``128 + N`` when stopped by signal
    N)."""
    args = _parser().parse_args(argv)
    commands = {"run": run.cmd_run, "bench": bench.cmd_bench, "loop": loop.cmd_loop,
                "list": listing.cmd_list,
                "report": results.cmd_report, "schema": results.cmd_schema,
                "simulate": simulate.run, "tune": tune.run, "replay": replay.cmd_replay,
                "selftest": replay.cmd_selftest, "gate": results.cmd_gate}
    try:
        _writable_outputs(args)
        apply_environment(cache_environment(getattr(args, "cache_dir", default_cache_dir()),
                                            create=args.command not in READ_ONLY_COMMANDS))
        return commands[args.command](args)
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


if __name__ == "__main__":
    sys.exit(main())
