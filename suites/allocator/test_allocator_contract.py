"""The allocator contract (``suites/allocator/contract_machine.py`` says what is checked)
on the reference, SGLang's ``RadixCache`` and transformers' ``PagedAttentionCache``
(vLLM's ``KVCacheManager``: ``test_allocator_matches_vllm.py``), and two faults planted in
the reference's adapter that the machine must catch."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from pagedbench.adapters.allocator_base import Step
from pagedbench.suites.allocator.contract_machine import STEPS, ContractMachine, check_contract


@pytest.mark.parametrize("pool", ["ample", "tight"])
@pytest.mark.parametrize("name", ["reference", "sglang-radix", "transformers"])
def test_allocator_keeps_its_contract(name: str, pool: str) -> None:
    check_contract(name, pool)


def _planted(fault: str) -> type[ContractMachine]:
    """The reference under the machine, with one fault planted in its adapter."""
    from pagedbench.adapters.allocator_reference import ReferenceAllocator

    class Faulty(ReferenceAllocator):
        def lookup(self, token_ids):  # one block too many where anything hits
            hit = super().lookup(token_ids)
            return hit + self.allocator.block_size if fault == "hit" and hit else hit

        def admit(self, seq_id, token_ids):
            step = super().admit(seq_id, token_ids)
            return Step(step.ok, step.hit + self.allocator.block_size, step.copies) \
                if fault == "hit" and step.hit else step

        def append(self, seq_id, token_ids):  # the copy-on-write copy not reported
            step = super().append(seq_id, token_ids)
            return Step(step.ok, step.hit) if fault == "copy" else step

    return type(f"Planted{fault}", (ContractMachine,), {"ALLOCATOR": Faulty(), "AMPLE": True})


@pytest.mark.parametrize("fault", ["hit", "copy"])
def test_contract_catches_a_planted_fault(fault: str) -> None:
    """A prefix hit one block too long, and a copy-on-write copy the caller is not told
    of (the child reads the stale block), each fail the machine."""
    with pytest.raises(AssertionError):
        run_state_machine_as_test(_planted(fault), settings=settings(
            max_examples=200, stateful_step_count=STEPS, deadline=None, derandomize=True,
            phases=[Phase.generate], report_multiple_bugs=False))
