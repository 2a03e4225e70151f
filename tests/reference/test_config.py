"""The scheduling-mode enum and the one validation of sampling parameters (``reference/config.py``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from reference.config import SCHEDULER_MODES, GenerationConfig, SchedulerConfig, SchedulingMode, check_sampling


def test_modes_are_built_from_and_written_as_the_cli_strings():
    assert SCHEDULER_MODES == ("none", "fixed", "dsd", "threshold", "adaptive-sync", "adaptive", "oracle")
    for text in SCHEDULER_MODES:
        cfg = SchedulerConfig(mode=text)
        assert cfg.mode is SchedulingMode(text) and cfg.mode == text and f"{cfg.mode}" == str(cfg.mode) == text
        # A config written to JSON keeps the string, and reads back as the same enum member.
        dumped = json.loads(json.dumps(dataclasses.asdict(cfg)))
        assert dumped["mode"] == text and SchedulerConfig(**dumped).mode is cfg.mode
    assert SchedulerConfig(mode=SchedulingMode.DSD).mode is SchedulingMode.DSD
    with pytest.raises(ValueError, match="unknown scheduler mode 'adaptiv'"):
        SchedulerConfig(mode="adaptiv")


def test_mode_properties():
    M = SchedulingMode
    assert {m for m in M if not m.drafts} == {M.NONE}
    assert {m for m in M if m.needs_cost_table} == {M.ADAPTIVE, M.ADAPTIVE_SYNC}
    assert {m for m in M if m.synchronous} == {M.THRESHOLD, M.ADAPTIVE_SYNC}
    assert {m for m in M if m.reads_survivals} == {M.THRESHOLD, M.ADAPTIVE_SYNC, M.ADAPTIVE}
    assert {m for m in M if m.batch_coupled} == {M.DSD, M.ADAPTIVE_SYNC, M.ADAPTIVE}
    assert {m for m in M if m.has_draft_gate} == {M.ADAPTIVE}


@pytest.mark.parametrize("field,value,message", [("max_new_tokens", 0, "max_new_tokens"),
                                                 ("temperature", -1.0, "temperature"),
                                                 ("temperature", float("nan"), "temperature"),
                                                 ("temperature", float("inf"), "temperature"),
                                                 ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"),
                                                 ("top_k", -1, "top_k")])
def test_one_validation_of_sampling_parameters(field, value, message):
    """GenerationConfig and the engine's SamplingParams reject the same values with the same message."""
    from optimized.sequence import SamplingParams

    args = {"max_new_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 3, field: value}
    errors = []
    for build in (lambda: check_sampling(**args), lambda: GenerationConfig(**args), lambda: SamplingParams(**args)):
        with pytest.raises(ValueError, match=message) as info:
            build()
        errors.append(str(info.value))
    assert len(set(errors)) == 1
