"""Capability: parsing, ordering, integer form, family and compiler target name."""

import pytest

from archserve.platform.capability import (
    SM70,
    SM75,
    SM80,
    SM86,
    SM89,
    SM90,
    SM100,
    SM103,
    SM120,
    SM121,
    Capability,
)


def test_ordering_follows_major_then_minor():
    ordered = [SM70, SM75, SM80, SM86, SM89, SM90, SM100, SM103, SM120, SM121]
    assert sorted(reversed(ordered)) == ordered
    assert SM89 < SM90 < SM100
    assert Capability(9, 0) >= Capability(8, 0)
    assert not SM121 <= SM120
    assert max(ordered) == SM121


@pytest.mark.parametrize("text, expected", [
    ("9.0", SM90), ("90", SM90), (90, SM90), ("sm_90", SM90), ("sm90a", SM90),
    ((12, 1), SM121), ("12.1", SM121), ("sm_100f", SM100), ("103", SM103), ("SM_75", SM75),
])
def test_parse_accepts_the_usual_spellings(text, expected):
    assert Capability.parse(text) == expected


@pytest.mark.parametrize("bad", ["", "x", "9", "sm_"])
def test_parse_rejects_non_capabilities(bad):
    with pytest.raises(ValueError):
        Capability.parse(bad)


def test_to_int_and_arch():
    assert Capability(12, 1).to_int() == 121
    assert SM90.to_int() == 90
    assert SM103.to_int() == 103
    assert SM90.arch == "sm_90"
    assert SM121.arch == "sm_121"
    assert str(SM86) == "SM86"


def test_family_groups_minor_versions_and_separates_sm100_from_sm120():
    assert Capability(10, 3).family == 100
    assert Capability(12, 1).family == 120
    assert SM90.family == 90
    assert SM100.family != SM120.family
    assert SM103.family == SM100.family
    assert SM121.family == SM120.family
