"""What the suite expects of each peer, per library build and ISA path: one table
(:data:`ROWS`, written up in ``docs/findings.md``), and :func:`expect`, which holds an
observation to it.

A row is keyed by (``impl``, ``version``, ``build``, ``isa``, ``probe``); ``"*"`` in a field
matches any value (a fault whose cause is in code every build runs, or "every other probe"
of a combination), and the most specific matching row wins. ``outcome`` is what the probe
gives there: ``"pass"``, ``"fault"`` (a known fault, with its ``smallest_case`` and
``cause``) or a measured property (``"nearest"``, ``"truncate"``).

:func:`observe` runs a probe, :func:`expect` holds its outcome to the table
(:func:`check_conformance` does both for a conformance check):

- a row matches: strict. A known fault that shows is an xfail, one that no longer shows
  fails (the row must go); any other outcome than the row's fails, so a regression of our
  adapter on a known combination fails;
- the implementation has rows, but none matches this combination (a build, an ISA or a
  version the suite never ran on): the observation is appended to
  :data:`OBSERVATIONS_FILE` as a row ready to paste into the table, and a deviation from
  the ideal outcome is a non-strict xfail naming it;
- the implementation has no row (this project's own kernels, the torch references): the
  probe asserts as it always did.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from pagedbench.adapters import Adapter
from pagedbench.harness.run import replay
from pagedbench.harness.verdict import conformance
from pagedbench.harness.verdict.conformance import inputs_for
from pagedbench.harness.verdict.judging import Verdict
from pagedbench.reference import PagedCase

#: Where observations on combinations the table does not name go, one JSON row a line,
#: under the pytest root's build folder (hermetic: never $HOME).
OBSERVATIONS_FILE = Path("build") / "peer-observations.jsonl"
ANY = "*"
#: Observations this process has written already.
_written: set = set()
KEY_FIELDS = ("impl", "version", "build", "isa", "probe")


@dataclass(frozen=True)
class Finding:
    """One row of the table (see the module docstring)."""

    impl: str
    version: str
    build: str
    isa: str
    probe: str
    outcome: str
    smallest_case: str = ""
    cause: str = ""

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(getattr(self, name) for name in KEY_FIELDS)


def each_isa(isas: tuple[str, ...], row: dict[str, str]) -> list[dict[str, str]]:
    """``row`` once for each ISA path in ``isas`` (rows of one finding on several paths)."""
    return [{**row, "isa": isa} for isa in isas]


#: The cause of the AVX-512 builds' soft-cap NaN (both ISA paths' rows).
FAST_EXP_TANH = (
    "the soft cap computes tanh(x), x = logit / cap, as (e^x - e^-x) / (e^x + e^-x) with "
    "vLLM's fast_exp (apply_softcap in csrc/cpu/cpu_attn_impl.hpp; DEFINE_FAST_EXP in "
    "csrc/cpu/cpu_attn_macros.h, AVX-512 builds only): for x < -86.99 e^x underflows to 0 "
    "and 1/0 = inf, for x > 88.72 (ln FLT_MAX) e^x overflows to inf; inf / inf = NaN, and "
    "the NaN logit turns its whole row NaN. Builds without AVX-512 (_C_AVX2) call "
    "std::tanh. Declared wherever reference.logit_bound / cap passes 86.98 "
    "(soft_cap_fast_exp in adapters/vllm_cpu.py), so the edge probes soft-cap-below-logits "
    "(-mha: cap 0.05, qk_magnitude 30) are unsupported on these builds")

#: The table: one JSON object a row (each line of :data:`OBSERVATIONS_FILE` pastes in
#: as it is). Smallest cases and causes are also written up in docs/findings.md.
ROWS = [
    *each_isa(("vec", "vec16"), {
        "impl": "vllm-cpu",
        "version": "0.32.0",
        "build": "_C",
        "probe": "*",
        "outcome": "pass",
        "smallest_case": "",
        "cause": "every probe not listed passes (AMD EPYC, AVX-512 with AVX512_BF16, no AMX)",
    }),
    *each_isa(("vec", "vec16"), {
        "impl": "vllm-cpu",
        "version": "0.32.0",
        "build": "_C_AVX2",
        "probe": "*",
        "outcome": "pass",
        "smallest_case": "",
        "cause": "every probe not listed passes (AMD EPYC, AVX2)",
    }),
    {
        "impl": "vllm-cpu",
        "version": "0.32.0",
        "build": "*",
        "isa": "*",
        "probe": "nan-tail",
        "outcome": "fault",
        "smallest_case": "kv_lens (block_size + 1, 5), float32, NaN in the unused V slots of the last block: sequence 0's rows NaN",
        "cause": "multiplies the V rows past kv_len in a sequence's last block by a zero weight (P.V over the whole block), so NaN there makes the row NaN (0 * NaN); stale finite values, as a real cache holds, cancel exactly; declared: nan_safe_tail=False",
    },
    {
        "impl": "vllm-cpu",
        "version": "0.32.0",
        "build": "*",
        "isa": "*",
        "probe": "kv-len-0",
        "outcome": "fault",
        "smallest_case": "kv_lens (0, 1), 1/1 heads, head_dim 32, block 16, float32: sequence 0's row NaN, not 0",
        "cause": "a row that sees no key divides 0 by a zero sum; declared: no empty_kv",
    },
    {
        "impl": "vllm-cpu",
        "version": "0.32.0",
        "build": "*",
        "isa": "*",
        "probe": "row-before-position-0",
        "outcome": "fault",
        "smallest_case": "kv_lens (1,), q_lens (2,): row 0 (before position 0, sees no key) NaN, not 0",
        "cause": "as kv-len-0; declared: no unseen_rows",
    },
    {
        "impl": "vllm-cpu",
        "version": "0.32.0",
        "build": "*",
        "isa": "*",
        "probe": "strided-output",
        "outcome": "fault",
        "smallest_case": "kv_lens (1, 1), output rows strided: row 1 left unwritten (NaN)",
        "cause": "the op writes row i at i * num_q_heads * head_dim, ignoring the output's strides; declared: no strided_out layout",
    },
    {
        "impl": "vllm-cpu",
        "version": "0.32.0",
        "build": "_C",
        "isa": "vec",
        "probe": "soft-cap-tanh-range",
        "outcome": "fault",
        "smallest_case": "kv_lens (1,), 1/1 heads, head_dim 64, block 32, float32, logits_soft_cap 1.0, one logit of -87 (or +89): every output NaN; -86.98 and +88.72 are finite",
        "cause": FAST_EXP_TANH,
    },
    *each_isa(("vec", "vec16"), {
        "impl": "vllm-cpu",
        "version": "0.32.0",
        "build": "_C",
        "probe": "bf16-output-rounding",
        "outcome": "nearest",
        "smallest_case": "",
        "cause": "_mm512_cvtneps_pbh (AVX512_BF16): round to nearest even, mean signed error about 0 ulp",
    }),
    *each_isa(("vec", "vec16"), {
        "impl": "vllm-cpu",
        "version": "0.32.0",
        "build": "_C_AVX2",
        "probe": "bf16-output-rounding",
        "outcome": "truncate",
        "smallest_case": "",
        "cause": "BF16Vec16(const FP32Vec16&) without AVX512_BF16 drops the low 16 bits: mean signed error about -0.3 ulp, at most 1 ulp; within the policy",
    }),
    {
        "impl": "vllm-cpu",
        "version": "0.32.0",
        "build": "_C",
        "isa": "vec16",
        "probe": "soft-cap-tanh-range",
        "outcome": "fault",
        "smallest_case": "kv_lens (1,), 1/1 heads, head_dim 80, block 16, float32, logits_soft_cap 1.0, one logit of -87 (or +89): every output NaN; -86.98 and +88.72 are finite",
        "cause": FAST_EXP_TANH,
    },
    {
        "impl": "vllm-cpu-mla",
        "version": "0.32.0",
        "build": "_C",
        "isa": "vec",
        "probe": "*",
        "outcome": "pass",
        "smallest_case": "",
        "cause": "every probe it takes passes (AMD EPYC, AVX-512 with AVX512_BF16, no AMX)",
    },
    *({
        "impl": impl,
        "version": "0.32.0",
        "build": "_C",
        "isa": "avx512",
        "probe": "*",
        "outcome": "pass",
        "smallest_case": "",
        "cause": "every probe it takes passes (AMD EPYC, AVX-512 with AVX512_BF16, no AMX "
                 "and no AMX-FP16: float16 on the brgemm paths declared unsupported)",
    } for impl in ("vllm-cpu-mla-decode", "vllm-cpu-mla-extend")),
    {
        "impl": "vllm-chunked-prefill",
        "version": "0.32.0",
        "build": "*",
        "isa": "interpreter-avx512-bf16",
        "probe": "*",
        "outcome": "pass",
        "smallest_case": "",
        "cause": "every probe not listed passes",
    },
    {
        "impl": "vllm-chunked-prefill",
        "version": "0.32.0",
        "build": "*",
        "isa": "*",
        "probe": "window-1",
        "outcome": "fault",
        "smallest_case": "the edge probe window-1: fp16, sliding window 1, qk_magnitude 30, logit_offset -1e4",
        "cause": "decode rows mask the keys outside the sliding window with -10000, not -inf (kernel_paged_attention_2d in vllm/v1/attention/ops/chunked_prefill_paged_decode.py): with logits near -1e4 those keys get weight",
    },
    {
        "impl": "vllm-chunked-prefill",
        "version": "0.32.0",
        "build": "*",
        "isa": "*",
        "probe": "window-2",
        "outcome": "fault",
        "smallest_case": "the edge probe window-2: fp16, sliding window 2, qk_magnitude 30, logit_offset -1e4",
        "cause": "decode rows mask the keys outside the sliding window with -10000, not -inf (kernel_paged_attention_2d in vllm/v1/attention/ops/chunked_prefill_paged_decode.py): with logits near -1e4 those keys get weight",
    },
    {
        "impl": "vllm-chunked-prefill",
        "version": "0.32.0",
        "build": "*",
        "isa": "*",
        "probe": "window-bs-1",
        "outcome": "fault",
        "smallest_case": "the edge probe window-bs-1: fp16, sliding window bs-1, qk_magnitude 30, logit_offset -1e4",
        "cause": "decode rows mask the keys outside the sliding window with -10000, not -inf (kernel_paged_attention_2d in vllm/v1/attention/ops/chunked_prefill_paged_decode.py): with logits near -1e4 those keys get weight",
    },
    {
        "impl": "vllm-chunked-prefill",
        "version": "0.32.0",
        "build": "*",
        "isa": "*",
        "probe": "window-bs+1",
        "outcome": "fault",
        "smallest_case": "the edge probe window-bs+1: fp16, sliding window bs+1, qk_magnitude 30, logit_offset -1e4",
        "cause": "decode rows mask the keys outside the sliding window with -10000, not -inf (kernel_paged_attention_2d in vllm/v1/attention/ops/chunked_prefill_paged_decode.py): with logits near -1e4 those keys get weight",
    },
    *({
        "impl": "vllm-chunked-prefill",
        "version": "0.32.0",
        "build": "*",
        "isa": "*",
        "probe": f"window-{w}-mha",
        "outcome": "fault",
        "smallest_case": f"the edge probe window-{w}-mha: fp16, 2/2 heads, sliding window {w}, qk_magnitude 30, logit_offset -1e4 (window-bs-1-mha and window-bs+1-mha pass at ratio 1)",
        "cause": "as window-1 at ratio 2: decode rows mask the keys outside the sliding window with -10000, not -inf (kernel_paged_attention_2d in vllm/v1/attention/ops/chunked_prefill_paged_decode.py)",
    } for w in ("1", "2")),
    {
        "impl": "vllm-unified",
        "version": "0.32.0",
        "build": "*",
        "isa": "interpreter-avx512-bf16",
        "probe": "*",
        "outcome": "pass",
        "smallest_case": "",
        "cause": "every probe not listed passes (the shared-block probes and un-sharing included)",
    },
    *({
        "impl": "vllm-unified",
        "version": "0.32.0",
        "build": "*",
        "isa": "interpreter-avx512-bf16",
        "probe": f"prefill-window-2bs-below0-{heads}",
        "outcome": "fault",
        "smallest_case": f"kv_lens (65,), q_lens (17,), {q}/2 heads, head_dim 64, block 16, fp16, sliding window 32, qk_magnitude 30, logit_offset -1e4: row 15 (position 63, whose window is exactly blocks 2 and 3) NaN in every head",
        "cause": "not yet analysed; seen under Triton's interpreter on the CPU. The same row passes with logits near 0, with window 17, and as a decode row; the other prefill-window probes pass",
    } for heads, q in (("mha", 2), ("gqa", 4))),
]

#: LMDeploy's and transformers' findings (docs/findings.md: "LMDeploy 0.18.0",
#: "transformers 5.19.0"); the probes that show them are in suites/adapters/.
ROWS += [
    {
        "impl": "lmdeploy-decode",
        "version": "0.18.0",
        "build": "*",
        "isa": "interpreter-avx512-bf16",
        "probe": "*",
        "outcome": "pass",
        "smallest_case": "",
        "cause": "every probe it takes passes (interpreted on the CPU: float32 and float16)",
    },
    {
        "impl": "lmdeploy-decode",
        "version": "0.18.0",
        "build": "*",
        "isa": "*",
        "probe": "alibi-with-sinks",
        "outcome": "fault",
        "smallest_case": "kv_lens (1,), 2/1 heads, head_dim 64, block 16, float32, alibi, sinks: error 0.0279, 1840x its allowance",
        "cause": "the decode's ALiBi bias is -slope * (kv_len - j) (_fwd_grouped_split_kernel in pagedattention.py), one slope below the distance kv_len - 1 - j that its prefill (-|j - i| * slope, flashattention.py) and the reference use; softmax cancels a shift shared by every key, but the sink's logit does not share it; declared: alibi with sinks unsupported",
    },
    {
        "impl": "transformers-paged",
        "version": "5.19.0",
        "build": "*",
        "isa": "cpu-avx512-bf16",
        "probe": "*",
        "outcome": "pass",
        "smallest_case": "",
        "cause": "every probe it takes passes",
    },
    {
        "impl": "transformers-paged",
        "version": "5.19.0",
        "build": "*",
        "isa": "*",
        "probe": "packed-mask-overflow",
        "outcome": "fault",
        "smallest_case": "kv_lens (1, 1), 1/1 head, head_dim 16, block 16, float16, sm_scale 10: sequence 0's logit 0, its query against sequence 1's key 70000: row 0 returns sequence 1's V",
        "cause": "continuous batching packs every request into one SDPA call and masks with finfo(dtype).min added to the float32 logits (build_attention_mask in generation/continuous_batching/utils.py): a masked key (another request's, or a later one) whose logit exceeds a visible one by more than 65504 (float16) still wins; declared: float16 cases whose logits can spread that far unsupported",
    },
]

FINDINGS = [Finding(**row) for row in ROWS]


def lookup(key: tuple[str, ...], table: list[Finding]) -> Finding | None:
    """The most specific row of ``table`` matching ``key`` (``"*"`` matches anything): one
    naming the probe first, then the one with the fewest ``"*"``."""
    matching = [row for row in table
                if all(want in (ANY, have) for want, have in zip(row.key, key))]
    return min(matching, key=lambda row: (row.probe == ANY, row.key.count(ANY)), default=None)


def has_rows(impl: str, table: list[Finding] | None = None) -> bool:
    """Whether the table holds expectations about ``impl`` (a peer it knows)."""
    return any(row.impl == impl for row in (FINDINGS if table is None else table))


def host_simd() -> str:
    """The CPU's SIMD class as torch's kernels meet it: the capability torch dispatches on
    (``avx2``, ``avx512``, ``default``), then ``-bf16`` (AVX512_BF16) and ``-amx`` (AMX
    tiles), which pick other oneDNN paths at the same capability."""
    extra = [name for name, present in (("bf16", torch.cpu._is_avx512_bf16_supported()),
                                         ("amx", torch.cpu._is_amx_tile_supported()))
             if present]
    return "-".join([torch.backends.cpu.get_cpu_capability().lower(), *extra])


def combination(adapter: Adapter, device: str, isa: str | None = None,
                case: PagedCase | None = None) -> tuple[str, str, str, str]:
    """(impl, version, build, isa) of ``adapter`` here: ``build`` is the library it loaded
    (``impl_details.library``, ``"-"`` when it names none); ``isa`` the path ``case``
    takes (given, or ``Prepared.facts["isa"]`` of ``case`` for a peer the table knows;
    ``"unknown"`` when its ``prepare`` raises), else the device type, ``"interpreter"``
    for an interpreted adapter, suffixed on the CPU with :func:`host_simd`
    (``"cpu-avx512-bf16"``, ``"interpreter-avx2"``): the kernels that compute there
    (torch's, numpy's under the interpreter) differ by it, so a row observed on one host
    class is never held strictly on another."""
    availability = adapter.available(device)
    if isa is None and case is not None and has_rows(adapter.name):
        try:
            isa = adapter.describe(adapter.prepare(inputs_for(adapter, case, device))).get("isa")
        except Exception:  # noqa: BLE001  (the probe itself failed on it, and says why)
            isa = "unknown"
    if isa is None:
        isa = "interpreter" if adapter.is_interpreted(device) else device.split(":")[0]
        if device == "cpu":
            isa += f"-{host_simd()}"
    return (adapter.name, availability.version or "-",
            str(availability.details.get("library", "-")), str(isa))


def observe(probe: Callable[[], object]) -> tuple[str, AssertionError | None]:
    """Run ``probe``: its outcome (the string it returns; ``"pass"`` when it returns
    anything else; ``"fault"`` when it raises ``AssertionError``) and that error."""
    try:
        outcome = probe()
    except AssertionError as exc:
        return "fault", exc
    return outcome if isinstance(outcome, str) else "pass", None


def expect(key: tuple[str, ...], outcome: str, error: AssertionError | None, case_id: str,
           root: Path, *, ideal: str = "pass", table: list[Finding] | None = None) -> None:
    """Hold the ``outcome`` of probe ``key`` (:data:`KEY_FIELDS`) to the table (see the
    module docstring); ``error`` is what the probe raised, ``case_id`` its case, ``root``
    the folder that holds ``build/``.

    Raises
    ------
    AssertionError
        The outcome differs from the matching row's (a known fault that no longer shows
        included), or, for an implementation without rows, from ``ideal``.
    pytest.xfail.Exception
        A known fault that shows (strict), or a deviation on a combination the table
        does not name (non-strict: recorded, named).
    """
    table = FINDINGS if table is None else table
    row = lookup(key, table)
    described = f"{' / '.join(key)}: {outcome}" + (
        f" ({str(error).splitlines()[0]})" if error else "")
    if row is not None:
        if row.outcome == "fault" and outcome == "fault":
            pytest.xfail(f"known fault of {' / '.join(row.key)}: {row.cause}")
        if outcome != row.outcome:
            raise AssertionError(
                f"{described}; the table (suites/peer_findings.py) expects {row.outcome!r}"
                + (" (a known fault that no longer shows: remove its row)"
                   if row.outcome == "fault" else "")) from error
        return
    if not has_rows(key[0], table):
        if error is not None:
            raise error
        assert outcome == ideal, described
        return
    path = root / OBSERVATIONS_FILE
    observed = Finding(*key, outcome=outcome, smallest_case=case_id if outcome != ideal else "",
                       cause=str(error).splitlines()[0] if error else "")
    if (path, observed) not in _written:  # once per process (hypothesis probes many cases)
        _written.add((path, observed))
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(json.dumps(asdict(observed)) + "\n")
    if outcome != ideal:
        pytest.xfail(f"deviation on a combination suites/peer_findings.py does not name: "
                     f"{described}; observed in {path}")


def check_conformance(adapter: Adapter, case: PagedCase, device: str, impl: str, probe: str,
                      root: Path) -> None:
    """The conformance check of ``case`` (:func:`pagedbench.harness.run.replay.check`), held
    to the table as probe ``probe`` of ``adapter``'s combination (:func:`expect`)."""
    verdicts: list[Verdict] = []

    def checked() -> Verdict:
        try:
            verdicts.append(replay.check(adapter, case, device, impl))
        except conformance.Nonconforming as exc:
            verdicts.append(exc.verdict)
            raise
        return verdicts[0]

    outcome, error = observe(checked)
    # The ISA path the check's own prepare took (``describe()`` in its verdict); the case
    # is prepared once more only when the check ended before ``describe()``.
    described = verdicts[0].details if verdicts else {}
    key = combination(adapter, device, isa=described.get("isa"),
                      case=None if described else case) + (probe,)
    expect(key, outcome, error, case.case_id, root)
