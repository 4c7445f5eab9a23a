"""``WAM_RAY_OBJECT_STORE_GB``: the object-store cap each Ray runtime of a training asks for."""

import pytest

from verl_omni.trainer.ray_cluster import object_store_bytes


def test_unset_or_blank_keeps_rays_default():
    assert object_store_bytes("") is None
    assert object_store_bytes("   ") is None


@pytest.mark.parametrize(("value", "expected"), [("4", 4 * 1024**3), ("0.5", 512 * 1024**2), (" 2 ", 2 * 1024**3)])
def test_gibibytes_to_bytes_by_hand(value, expected):
    assert object_store_bytes(value) == expected


@pytest.mark.parametrize("value", ["four", "0", "-1", "inf", "nan"])
def test_a_bad_size_names_the_variable(value):
    with pytest.raises(ValueError, match="WAM_RAY_OBJECT_STORE_GB"):
        object_store_bytes(value)
