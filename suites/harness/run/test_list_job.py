"""The parent's side of a list job keeps one row per implementation, in order, whatever its
worker sends: a message that is not a listing, or a listing that is not valid, becomes that
implementation's ``error`` row and the next implementation's row is still the worker's."""

from __future__ import annotations

from pagedbench.adapters import Entry
from pagedbench.harness.results.record import ListingRow
from pagedbench.harness.run import list_job
from pagedbench.harness.verdict.messages import Data, Fatal

FOUND = [Entry("a", "m:A", False), Entry("b", "m:B", False), Entry("c", "m:C", False)]


def test_what_is_not_a_valid_listing_is_its_implementations_error(monkeypatch, tmp_path):
    good = ListingRow.error("c", "m:C", "error", "x").model_dump(mode="json") | {
        "status": "available", "available": True, "reason": "", "version": "1.0"}
    sent = [Fatal(status="error", step="available", reason="no"), Data(data={"name": "b"}),
            Data(data=good)]

    class Worker:
        def __init__(self, job, env, budgets, steps) -> None:
            assert job["kind"] == "list" and job["start"] == 0, job

        def run(self, on_message):
            for message in sent:
                on_message(message)
            return None

    monkeypatch.setattr(list_job, "Supervisor", Worker)
    rows = list_job.list_adapters(FOUND, "cpu", tmp_path)
    assert [(r.name, r.status) for r in rows] == [("a", "error"), ("b", "error"),
                                                   ("c", "available")]
    assert rows[0].reason == ("the worker sent an invalid listing (a 'fatal' message in a "
                              "list job)")
    assert rows[1].reason.startswith("the worker sent an invalid listing (") \
        and "validation error" in rows[1].reason, rows[1].reason
    assert rows[2].available and rows[2].version == "1.0"
