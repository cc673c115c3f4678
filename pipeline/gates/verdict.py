"""A gate's verdict: pass, fail or inconclusive (a perf interval that straddles the threshold).

A str Enum: a verdict is its value wherever a string is (JSON, f-strings, comparisons), so the
reports read and write the strings the gate_report schema names. A gate whose worker ended
before its verdict is not a verdict of its own: its report says fail, with an `aborted` section
(pipeline/gates/report_types.py: Aborted).
"""
from __future__ import annotations

from enum import StrEnum


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
