"""Admission's context check (deployments/replica/admission.py) without a model."""

from __future__ import annotations

import doctest

import pytest

from specray.deployments.replica import admission
from specray.deployments.replica.admission import fit_prompt
from specray.deployments.replica.errors import BadRequest


def test_doctests():
    failed, attempted = doctest.testmod(admission)
    assert attempted >= 2 and failed == 0


def test_fit_prompt_names_the_limit_it_broke():
    assert fit_prompt(445, 50, 512, 16, truncate=False) == 0  # exactly fits: 445 + 50 + 16 + 1 = 512
    with pytest.raises(BadRequest) as e:
        fit_prompt(446, 50, 512, 16, truncate=False)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(BadRequest) as e:
        fit_prompt(10, 512, 512, 0, truncate=True)  # max_tokens alone fills the context: nothing to drop
    assert e.value.param == "max_tokens"
    assert fit_prompt(1000, 50, 512, 0, truncate=True) == 1000 - (512 - 50 - 1)
