"""Every name of vLLM 0.33's engine-facing distributed API exists here with vLLM's
parameters (or says it is not supported), and docs/vllm_compat.md says so."""

from __future__ import annotations

from vllm_contract import KNOWN_GAPS, TABLE, check_all, render_table


def test_no_contract_name_is_missing_or_different_beyond_the_listed_gaps():
    rows = check_all()
    broken = [
        f"{e.label}: {status}: {note}"
        for e, status, note in rows
        if status in ("missing", "differs")
    ]
    assert broken == [], "\n".join(broken)


def test_the_open_gap_list_only_names_gaps_that_still_exist():
    still_open = {e.label for e, status, _ in check_all() if status == "open gap"}
    fixed = sorted(KNOWN_GAPS - still_open)
    assert fixed == [], f"fixed, remove from tests/data/vllm_0_33_open_gaps.txt: {fixed}"


def test_the_compatibility_table_is_current():
    with open(TABLE, encoding="utf-8") as f:
        assert f.read() == render_table(check_all()), (
            "docs/vllm_compat.md is stale: run python tests/vllm_contract.py --write"
        )


def test_positional_vllm_calls_never_bind_to_our_additions():
    """A listed 'extension' adds keyword-only parameters only (checked by classify);
    the two silent cases the issue found are now extensions or same."""
    status = {e.label: s for e, s, _ in check_all()}
    assert status["parallel_state.initialize_model_parallel"] == "extension"
    assert status["parallel_state.GroupCoordinator.dispatch"] == "same"
