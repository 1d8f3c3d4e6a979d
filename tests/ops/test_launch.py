"""The plain-int launch arithmetic of the Triton wrappers gives Triton's own answers."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from atom_core.ops.triton.launch import cdiv, next_power_of_2

triton = pytest.importorskip("triton")


@given(st.integers(1, 2**40))
def test_next_power_of_2_equals_triton_for_positive_ints(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)


@given(st.integers(0, 2**40), st.integers(1, 2**20))
def test_cdiv_equals_triton(a, b):
    assert cdiv(a, b) == triton.cdiv(a, b)


def test_next_power_of_2_at_and_around_powers_of_two():
    assert [next_power_of_2(n) for n in (1, 2, 3, 4, 5, 1023, 1024, 1025)] == [1, 2, 4, 4, 8, 1024, 1024, 2048]
