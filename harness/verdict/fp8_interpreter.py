"""fp8 under Triton's interpreter: which verdicts its fp8 decode changes, their mark, and
the command that writes the code-by-code table.

    python -m pagedbench.harness.verdict.fp8_interpreter [--output results/fp8-interpreter]

The table (:mod:`pagedbench.kernels.fp8_decode`: a one-program kernel's ``.to()`` of all
256 codes of E4M3 "fn" and E5M2, to float32, float16 and bfloat16, against torch's;
``results/fp8-interpreter/``, Triton 3.9.0) shows that the interpreter's decode (numpy
arithmetic on the bits) reads every NaN and Inf code as a finite number: 0x7F, the fp8
NaN pagedbench poisons unused slots with, is 480 in E4M3 and 114688 in E5M2, and E5M2's
+-Inf (0x7C, 0xFC) is +-65536; only E5M2 to float16, whose exponents are as wide, keeps
them, and there it gets E5M2's subnormals wrong instead (0x01 and 0x02 read as 0, 0x03
as 2**-15: off by at most 2**-15). Every other finite code agrees. So an interpreted
kernel judged on an fp8 case whose poison is NaN or Inf may see a large finite poison: a
read past ``kv_len`` still moves the output, but a fault that multiplies poisoned V by a
zero weight (``0 * NaN``) shows only on a GPU. Such verdicts are marked
:data:`FP8_POISON_MARK` (:func:`poison_reads_finite`) in reports; docs/edges.md has the
details.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from pagedbench.reference import PagedCase

#: Marks a pass of an interpreted kernel on an fp8 case whose NaN or Inf poison the
#: interpreter's fp8 decode reads as a finite number (module docstring).
FP8_POISON_MARK = "§"
#: Where the table is written by default (relative to the working directory).
DEFAULT_OUTPUT = Path("results") / "fp8-interpreter"
TABLE_JSON, TABLE_MARKDOWN = "fp8-decode.json", "fp8-decode.md"


def poison_reads_finite(case: PagedCase, interpreted: bool | None) -> bool:
    """Whether an implementation that ran ``case`` (interpreted, or not) read the case's
    fp8 poison as a finite number: an fp8 ``kv_cache_dtype`` whose poison is NaN or Inf
    (E4M3 has no Inf: its ``"inf"`` poison is the largest finite value, 448) under
    Triton's interpreter."""
    if not interpreted or case.kv_cache_dtype == "auto":
        return False
    from pagedbench.reference.inputs import poison_value  # torch: a report needs it only here

    return not math.isfinite(poison_value(case.poison, case.kv_torch_dtype))


def _text(value: float) -> str:
    return repr(float(value))


def tables(device: str = "cpu") -> dict[str, dict[str, list]]:
    """``{kv_cache_dtype: {target: [Code, ...]}}`` from :mod:`pagedbench.kernels.fp8_decode`
    on ``device`` (the interpreter must be on for ``"cpu"``)."""
    from pagedbench.kernels import fp8_decode

    return {name: {target: fp8_decode.decode_table(fp8, dtype, device)
                   for target, dtype in fp8_decode.TARGETS.items()}
            for name, fp8 in fp8_decode.FP8_TYPES.items()}


def write_table(output: Path, device: str, command: str) -> list[Path]:
    """Write :data:`TABLE_JSON` (every code's two values, as Python reprs) and
    :data:`TABLE_MARKDOWN` (the summary, the codes that differ, the float32 table) into
    ``output``; the paths."""
    import numpy
    import torch
    import triton

    from pagedbench.kernels import fp8_decode

    found = tables(device)
    where = "Triton's interpreter" if fp8_decode.is_interpreted() else f"Triton on {device}"
    versions = {"triton": triton.__version__, "torch": torch.__version__,
                "numpy": numpy.__version__, "python": sys.version.split()[0]}
    data = {
        "command": command, "decoded_by": where, "versions": versions,
        "codes": {name: {target: [[c.code, _text(c.torch_value), _text(c.triton_value)]
                                  for c in codes] for target, codes in by_target.items()}
                  for name, by_target in found.items()},
        "differ": {name: {target: [f"0x{c.code:02x}" for c in codes if not c.agrees]
                          for target, codes in by_target.items()}
                   for name, by_target in found.items()},
    }
    output.mkdir(parents=True, exist_ok=True)
    json_path, md_path = output / TABLE_JSON, output / TABLE_MARKDOWN
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    md_path.write_text(_markdown(found, where, versions, command))
    return [json_path, md_path]


def _markdown(found, where: str, versions: dict[str, str], command: str) -> str:
    lines = [f"# fp8 decode: {where} against torch, code by code", "",
             f"Written by `{command}`; " + ", ".join(f"{k} {v}" for k, v in versions.items())
             + ". A code agrees when both give the same value and sign, or NaN. Each "
             "decode is `.to()` of the code as an fp8 value, the conversion the paged "
             "kernels apply to an fp8 KV tile.", "",
             "| fp8 type | to | codes that agree | codes that differ (torch -> Triton) |",
             "|---|---|---|---|"]
    for name, by_target in found.items():
        for target, codes in by_target.items():
            bad = [c for c in codes if not c.agrees]
            shown = ", ".join(f"0x{c.code:02x} ({c.torch_value:g} -> {c.triton_value:g})"
                              for c in bad) or "none"
            lines.append(f"| {name} | {target} | {len(codes) - len(bad)} of {len(codes)} "
                         f"| {shown} |")
    lines += ["", "## Every code to float32", "",
              "| code | " + " | ".join(f"{n} torch | {n} Triton" for n in found) + " |",
              "|---|" + "---|---|" * len(found)]
    columns = [by_target["float32"] for by_target in found.values()]
    for row in zip(*columns):
        cells = " | ".join(f"{c.torch_value:.9g} | {c.triton_value:.9g}"
                           + ("" if c.agrees else " **differs**") for c in row)
        lines.append(f"| 0x{row[0].code:02x} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.harness.verdict.fp8_interpreter",
                                     description="Write the code-by-code table of Triton's "
                                                 "fp8 decode against torch's.")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="DIR",
                        help=f"folder of the two files (default: {DEFAULT_OUTPUT})")
    parser.add_argument("--device", default="cpu", metavar="DEVICE",
                        help="cpu (Triton's interpreter, the default) or cuda (the GPU's "
                             "conversion)")
    args = parser.parse_args(argv)
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: choose cpu or cuda")
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
    command = " ".join(["python -m pagedbench.harness.verdict.fp8_interpreter",
                        *(argv if argv is not None else sys.argv[1:])])
    for path in write_table(args.output, args.device, command):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
