"""JUnit XML of verdicts, so that CI systems (GitHub Actions reporters, GitLab, Jenkins)
show one test per (implementation, case).

One ``<testsuite>`` per call, one ``<testcase classname=IMPL name=CASE_ID>`` per result
(the last of each pair), its ``time`` the result's wall time in seconds. ``fail`` is a ``<failure>``; ``error``, ``crash``, ``timeout``
and ``harness-error`` are ``<error>`` (with the status as its ``type``);
``unsupported`` and ``unavailable`` are ``<skipped>``; the reason is the message, and a
failure's or error's text adds the step and the tolerance figures (errors, allowance,
worst element: docs/results.md). Each
testcase carries ``status``, ``device`` and, when timed, ``time_ms_median`` as
properties. The layout is the one pytest's ``--junit-xml`` writes (Jenkins' JUnit
schema); characters XML 1.0 cannot hold (control characters from a plug-in's message)
are written as ``\\xNN``.
"""

from __future__ import annotations

import re
import socket
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

from pagedbench.harness.results.record import COMPARISON_FIELDS, ResultRecord, now
from pagedbench.harness.results.store import write_output
from pagedbench.harness.verdict.status import Status

#: Characters outside XML 1.0's ``Char`` production.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(text: str) -> str:
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _element(status: Status) -> str | None:
    if status is Status.PASS:
        return None
    if status is Status.FAIL:
        return "failure"
    if status in (Status.UNSUPPORTED, Status.UNAVAILABLE):
        return "skipped"
    return "error"


def _figures(record: ResultRecord) -> str:
    """The comparison's figures that are known, one ``name = value`` a line."""
    return "\n".join(f"{name} = {getattr(record, name)}" for name in COMPARISON_FIELDS
                     if getattr(record, name) is not None)


def junit_xml(records: Iterable[ResultRecord], suite: str,
              seconds: Mapping[tuple[str, str], float] | None = None) -> str:
    """The JUnit XML document of ``records`` as one test suite named ``suite``; each
    testcase's ``time`` is its wall time from ``seconds`` (by implementation and case
    id, :attr:`pagedbench.harness.run.progress.RunProgress.seconds`; 0 for a result without one,
    such as one a resumed run already had), the suite's their sum."""
    seconds = seconds or {}
    latest: dict[tuple[str, str], ResultRecord] = {}
    for record in records:
        latest.pop((record.impl, record.case_id), None)
        latest[(record.impl, record.case_id)] = record
    kinds = Counter(_element(r.status) for r in latest.values())
    took = {key: seconds.get(key, 0.0) for key in latest}
    root = ET.Element("testsuites")
    tree = ET.SubElement(root, "testsuite", {
        "name": _xml_text(suite), "tests": str(len(latest)),
        "failures": str(kinds["failure"]), "errors": str(kinds["error"]),
        "skipped": str(kinds["skipped"]), "time": f"{sum(took.values()):.3f}",
        "timestamp": now().isoformat(), "hostname": _xml_text(socket.gethostname())})
    for key, record in latest.items():
        case = ET.SubElement(tree, "testcase", {"classname": _xml_text(record.impl),
                                                "name": _xml_text(record.case_id),
                                                "time": f"{took[key]:.3f}"})
        properties = ET.SubElement(case, "properties")
        values = {"status": str(record.status), "device": record.env.device}
        if record.time_ms is not None:
            values["time_ms_median"] = f"{record.time_ms.median:.6g}"
        for name, value in values.items():
            ET.SubElement(properties, "property", {"name": name, "value": _xml_text(value)})
        kind = _element(record.status)
        if kind is not None:
            reason = _xml_text(record.reason or str(record.status))
            outcome = ET.SubElement(case, kind, {"message": reason, "type": str(record.status)})
            if kind != "skipped":
                outcome.text = _xml_text(
                    f"{record.impl} on {record.case_id}: {record.status} at step "
                    f"{record.step or '?'}: {record.reason}\n{_figures(record)}")
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit_xml(records: Iterable[ResultRecord], path: Path, suite: str,
                    seconds: Mapping[tuple[str, str], float] | None = None) -> None:
    """Write :func:`junit_xml` to ``path`` atomically (:func:`~.store.write_output`: a
    link refused, a failed write an ``OutputError``)."""
    write_output(Path(path), junit_xml(records, suite, seconds))


__all__ = ["junit_xml", "write_junit_xml"]
