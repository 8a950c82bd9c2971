"""Whether a pinned case can tell that a kernel applies a feature (not collected).

A case checks a feature only if turning the feature off (or changing it) moves the
float64 truth by more than :data:`FEATURE_EFFECT` times the allowed error: a kernel that
ignored the change, and was otherwise within the allowance, is then off by more than the
allowance, and fails.
"""

from __future__ import annotations

from pagedbench.reference import PagedCase, materialize, reference_attention

#: Effect over allowance that makes a feature visible: the ignored feature's error
#: (``effect``) minus the kernel's own error (at most one allowance) still exceeds one.
FEATURE_EFFECT = 2.0


def assert_feature_matters(case: PagedCase, change: dict, allowed_abs_err: float) -> None:
    """Assert that ``case.with_(**change)`` moves the truth by more than
    ``FEATURE_EFFECT * allowed_abs_err`` (absolute, in the output's units).

    Raises
    ------
    AssertionError
        Naming the case, the change and the effect, when the case cannot tell.
    """
    truth = reference_attention(materialize(case, "cpu"))
    changed = reference_attention(materialize(case.with_(**change), "cpu"))
    effect = float((changed - truth).abs().max())
    assert effect > FEATURE_EFFECT * allowed_abs_err, (
        f"{case.case_id}: changing {change} moves the truth by only {effect:.3g} "
        f"(allowance {allowed_abs_err:.3g}); the case cannot tell whether the kernel applies it")
