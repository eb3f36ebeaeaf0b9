"""find_split against hand-computed splits, its errors, and the life of ``parallel_state.cp_size_t``."""

from __future__ import annotations

import pytest

import parallel_state as ps

# shape [B, C, T, H, W], cp_size, patch_values, view_factor -> torch.Size([T', H', W]), cp_size_t.
# Worked by hand: Tp = T // view_factor // pT, t = gcd(Tp, cp), h = gcd(H // pH, cp // t).
SPLITS = [
    # temporal only
    ((1, 16, 16, 88, 160), 1, (1, 2, 2), 1, (16, 88, 160), 1),    # nothing to split
    ((1, 16, 16, 88, 160), 2, (1, 2, 2), 1, (8, 88, 160), 2),     # gcd(16, 2) = 2
    ((1, 16, 16, 88, 160), 8, (1, 2, 2), 1, (2, 88, 160), 8),     # gcd(16, 8) = 8
    ((1, 16, 16, 88, 160), 16, (1, 2, 2), 1, (1, 88, 160), 16),   # one latent frame per rank
    ((2, 16, 9, 48, 80), 3, (1, 2, 2), 1, (3, 48, 80), 3),        # gcd(9, 3) = 3
    ((1, 16, 16, 64, 64), 4, (4, 1, 1), 1, (4, 64, 64), 4),       # Tp = 4, gcd(4, 4) = 4; T' = 16 / 4
    # temporal + height
    ((2, 16, 4, 64, 64), 8, (1, 2, 2), 1, (1, 32, 64), 4),        # t = gcd(4, 8) = 4, h = gcd(32, 2) = 2
    ((1, 16, 6, 88, 160), 4, (1, 2, 2), 1, (3, 44, 160), 2),      # t = gcd(6, 4) = 2, h = gcd(44, 2) = 2
    ((1, 16, 9, 48, 80), 6, (1, 2, 2), 1, (3, 24, 80), 3),        # t = gcd(9, 6) = 3, h = gcd(24, 2) = 2
    ((1, 16, 16, 88, 160), 32, (1, 2, 2), 1, (1, 44, 160), 16),   # t = 16, h = gcd(44, 2) = 2
    ((1, 16, 16, 64, 64), 16, (2, 2, 2), 1, (2, 32, 64), 8),      # Tp = 8: t = 8, h = gcd(32, 2) = 2
    # height only: an image latent (T = 1)
    ((1, 16, 1, 88, 160), 4, (1, 2, 2), 1, (1, 22, 160), 1),      # t = 1, h = gcd(44, 4) = 4
    # multi-view: T holds view_factor views; T' is per view
    ((1, 16, 24, 88, 160), 4, (1, 2, 2), 3, (2, 88, 160), 4),     # T/3 = 8, t = gcd(8, 4) = 4
    ((1, 16, 12, 88, 160), 8, (1, 2, 2), 3, (1, 44, 160), 4),     # T/3 = 4, t = 4, h = gcd(44, 2) = 2
    ((1, 16, 12, 88, 160), 2, (2, 2, 2), 2, (6, 44, 160), 1),     # T/2 = 6, Tp = 3, t = 1, h = 2
]


@pytest.mark.parametrize("shape, cp, patch, views, expected, cp_t", SPLITS, ids=lambda v: str(v))
def test_split_table(shape, cp, patch, views, expected, cp_t):
    import torch

    got = ps.find_split(shape, cp, patch_values=patch, view_factor=views)
    assert isinstance(got, torch.Size) and tuple(got) == expected
    assert ps.cp_size_t == cp_t
    # the split covers the latent exactly: t * h ranks, each holding T' x H'
    t, h = shape[2] // views // got[0], shape[3] // got[1]
    assert t == cp_t and t * h == cp and got[2] == shape[4]
    ps.destroy_model_parallel()


def test_split_accepts_torch_size_and_positional_arguments():
    import torch

    assert ps.find_split(torch.Size([1, 16, 24, 88, 160]), 4, (1, 2, 2), 3) == torch.Size([2, 88, 160])
    ps.destroy_model_parallel()


# The width error names the numbers and the cp sizes that would work: products of a divisor of
# the patched T and a divisor of the patched H, the six largest below cp_size and three above.
WIDTH_ERRORS = [
    # Tp = 16 (divisors 1 2 4 8 16), Hp = 44 (1 2 4 11 22 44): 3 divides neither
    ((1, 16, 16, 88, 160), 3, (1, 2, 2), 1, "leaving 3", "[1, 2, 4, 8, 11]"),
    # t = 16 and h = gcd(44, 8) = 4 of 128, leaving 2; working sizes 1 2 4 8 11 16 22 32 44 64 88 176 352 704
    ((1, 16, 16, 88, 160), 128, (1, 2, 2), 1, "leaving 2", "[16, 22, 32, 44, 64, 88, 176, 352, 704]"),
    # Tp = 5 takes 5 of 10, Hp = 15 cannot take the 2 left; working sizes 1 3 5 15 25 75
    ((1, 16, 5, 30, 40), 10, (1, 2, 2), 1, "leaving 2", "[1, 3, 5, 15, 25, 75]"),
    # multi-view: T/3 = 2 takes 2 of 4, Hp = 3 cannot take the 2 left; working sizes 1 2 3 6
    ((1, 16, 6, 6, 8), 4, (1, 2, 2), 3, "leaving 2", "[1, 2, 3, 6]"),
]


@pytest.mark.parametrize("shape, cp, patch, views, leaving, working", WIDTH_ERRORS, ids=lambda v: str(v))
def test_width_error_names_numbers_and_working_cp_sizes(shape, cp, patch, views, leaving, working):
    ps.destroy_model_parallel()
    with pytest.raises(ValueError) as info:
        ps.find_split(shape, cp, patch_values=patch, view_factor=views)
    msg = str(info.value)
    assert f"cp_size={cp}" in msg and "width" in msg and leaving in msg
    assert msg.endswith(working), msg
    assert not hasattr(ps, "cp_size_t")  # an error records nothing


BAD_INPUTS = [  # args, kwargs, exception type, what the message must say
    (((1, 16, 88, 160), 2), {}, ValueError, "5-D"),
    (((1, 1, 16, 16, 88, 160), 2), {}, ValueError, "got 6-D"),
    (((1, 16, 10, 88, 160), 2), {"view_factor": 3}, ValueError, "T=10 is not divisible by view_factor=3"),
    (((1, 16, 16, 88, 160), 0), {}, ValueError, "cp_size must be >= 1, got 0"),
    (((1, 16, 16, 88, 160), -2), {}, ValueError, "cp_size must be >= 1, got -2"),
    (((1, 16, 16, 88, 160), 2), {"view_factor": 0}, ValueError, "view_factor must be >= 1, got 0"),
    (((1, 16, 5, 88, 160), 2), {"patch_values": (2, 2, 2)}, ValueError, "T/view_factor=5 by pT=2"),
    (((1, 16, 4, 87, 160), 2), {}, ValueError, "H=87 by pH=2"),
    (((1, 16, 4, 88, 160), 2), {"patch_values": (1, 2)}, ValueError, "patch_values must be three ints"),
    (((1, 16, 0, 88, 160), 2), {}, ValueError, ">= 1, got (1, 16, 0, 88, 160)"),
    (((1, 16, 16, 88, 160), 2.0), {}, TypeError, "cp_size must be an int, got 2.0"),
    (((1, 16, 16, 88, 160), True), {}, TypeError, "cp_size must be an int"),
    (((1, 16, 16.0, 88, 160), 2), {}, TypeError, "shape[2] must be an int"),
    ((16, 2), {}, TypeError, "shape must be a sequence of 5 ints"),
]


@pytest.mark.parametrize("args, kwargs, exc, says", BAD_INPUTS, ids=lambda v: str(v))
def test_bad_input_is_explained_and_records_nothing(args, kwargs, exc, says):
    ps.find_split((1, 16, 16, 88, 160), 4)
    with pytest.raises(exc) as info:
        ps.find_split(*args, **kwargs)
    assert says in str(info.value), str(info.value)
    assert ps.cp_size_t == 4  # the earlier value survives the failed call
    ps.destroy_model_parallel()


def test_a_tensor_instead_of_its_shape_is_refused():
    import torch

    with pytest.raises(TypeError, match=r"x\.shape"):
        ps.find_split(torch.zeros(1, 1, 2, 2, 2), 2)


def test_cp_size_t_lives_until_destroy_without_process_groups():
    ps.destroy_model_parallel()
    assert not hasattr(ps, "cp_size_t")
    ps.find_split((1, 16, 8, 64, 64), 4)
    assert ps.cp_size_t == 4
    ps.find_split((1, 16, 1, 64, 64), 4)  # a later call replaces it
    assert ps.cp_size_t == 1
    ps.destroy_model_parallel()
    assert not hasattr(ps, "cp_size_t") and "cp_size_t" not in vars(ps)
    ps.destroy_model_parallel()  # idempotent


def case_cp_size_t_across_initialize_and_destroy():
    """cp_size_t on real ranks: absent after every destroy, kept by initialize, set by find_split."""
    seen = []
    ps.initialize_model_parallel(context_parallel_size=2)
    seen.append(hasattr(ps, "cp_size_t"))
    # the temporal dimension has 3 latent frames: cp=2 splits the height instead
    seen.append(tuple(ps.find_split((1, 16, 3, 64, 64), ps.get_context_parallel_world_size())))
    seen.append(ps.cp_size_t)
    ps.destroy_model_parallel()
    seen.append(hasattr(ps, "cp_size_t"))
    ps.find_split((1, 16, 4, 64, 64), 2)  # before initialize: kept through it
    ps.initialize_model_parallel(context_parallel_size=2)
    seen.append(ps.cp_size_t)
    ps.destroy_model_parallel()
    seen.append(hasattr(ps, "cp_size_t"))
    ps.initialize_model_parallel(context_parallel_size=2)
    seen.append(hasattr(ps, "cp_size_t"))  # a rebuilt topology never reads a stale value
    return seen


def test_cp_size_t_across_initialize_and_destroy(pools):
    assert pools(2).run(case_cp_size_t_across_initialize_and_destroy) == [
        [False, (3, 32, 64), 1, False, 2, False, False]] * 2


def test_shard_sizes_follow_tensor_split():
    import torch

    import cp

    for length in range(1, 40):
        for n in range(1, length + 1):
            assert cp.shard_sizes(length, n) == tuple(t.numel() for t in torch.arange(length).tensor_split(n))
    with pytest.raises(ValueError, match="cannot split 3 elements into 4 shards"):
        cp.shard_sizes(3, 4)
