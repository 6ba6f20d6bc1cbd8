"""The pytest plugin of attnproof (registered through the `pytest11` entry point): the `attention_check` fixture.

    def test_my_kernel(attention_check):
        o, lse = my_kernel(q, k, v, causal=True)
        attention_check(q, k, v, o, lse, causal=True)

The fixture is `attnproof.assert_attention_close`; a failure raises with the report, and the reports of the
checks that passed are printed when the test ends (pytest shows them with `-s` or when the test fails later).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List

import pytest

from . import Report, assert_attention_close


@pytest.fixture
def attention_check() -> Iterator[Callable[..., Report]]:
    """`attnproof.assert_attention_close`, recording each report so that a failing test shows them all."""
    reports: List[Report] = []

    def check(*args: Any, **kwargs: Any) -> Report:
        report = assert_attention_close(*args, **kwargs)
        reports.append(report)
        return report

    yield check
    for report in reports:
        print(report.text)
