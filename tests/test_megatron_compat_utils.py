"""megatron-core 0.16's helper API (rank_generator, nccl, process_groups, memory) against megatron-core itself.

The rank arithmetic is compared with megatron-core's own functions; the group builders with
the rank lists megatron-core's would create (its ``create_group`` replaced, inside this test
process, by a recorder: that observes the oracle, our code runs unchanged); group creation
and timeouts on real gloo ranks.
"""

from __future__ import annotations

import datetime
import itertools
import math
import warnings

import numpy as np
import pytest

from parallel_state.errors import ParallelStateAssertionError, ParallelStateError, ParallelStateTypeError
from parallel_state.groups.nccl import get_nccl_options, load_nccl_comm_cfgs, overwrite_nccl_comm_cfgs
from parallel_state.groups.process_groups import create_group, is_torch_min_version, update_pg_timeout
from parallel_state.megatron.memory import (
    GlobalMemoryBuffer,
    GlobalSymmetricMemoryBuffer,
    SymmetricMemoryManager,
    destroy_global_memory_buffer,
    get_global_memory_buffer,
    get_global_symmetric_memory_buffer,
    set_global_memory_buffer,
)
from parallel_state.topology.rank_generator import (
    RankGenerator,
    default_embedding_ranks,
    default_position_embedding_ranks,
    generate_masked_orthogonal_rank_groups,
    hierarchical_rank_groups,
    hybrid_rank_groups,
)


@pytest.fixture(scope="module")
def mc():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

    return parallel_state


# --- RankGenerator ------------------------------------------------------------------------------

ORDERS = ["tp-cp-ep-dp-pp", "tp-pp-dp", "TP-PP-DP", "pp-dp-tp-cp-ep", "ep-tp-pp-dp", "tp-ep-dp-pp", "dp-cp"]
TOKENS = ["tp", "cp", "ep", "dp", "pp", "tp-pp", "dp-cp", "tp-ep", "tp-ep-pp", "tp-dp-cp", "tp-dp", "tp-cp",
          "ep-dp", "pp-tp", "tp-tp", "tp-cp-ep-dp-pp", "xx", ""]


def test_rank_generator_matches_megatron(mc):
    checked = errors = 0
    for (tp, ep, dp, pp, cp), order, offset in itertools.product(
        itertools.product((1, 2, 3), (1, 2), (1, 2, 3), (1, 2), (1, 2)), ORDERS, (0, 4)
    ):
        args = dict(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order, rank_offset=offset)
        try:
            ref = mc.RankGenerator(**args)
        except (AssertionError, RuntimeError) as exc:
            # Both of megatron-core's errors, with their types kept, and ours says more.
            with pytest.raises(type(exc)) as ours:
                RankGenerator(**args)
            assert isinstance(ours.value, ParallelStateError)
            errors += 1
            continue
        gen = RankGenerator(**args)
        for attr in ("tp", "ep", "dp", "pp", "cp", "rank_offset", "world_size", "name_to_size", "order",
                     "ordered_size"):
            assert getattr(gen, attr) == getattr(ref, attr), (args, attr)
        assert list(gen.name_to_size) == list(ref.name_to_size)
        for token in gen.order.split("-"):
            assert gen.get_mask(gen.order, token) == ref.get_mask(ref.order, token)
        for token in TOKENS:
            try:
                expected = ref.get_ranks(token)
            except ValueError:
                with pytest.raises(ValueError):
                    gen.get_ranks(token)
                continue
            assert gen.get_ranks(token) == expected, (args, token)
            checked += 1
    assert checked > 3000 and errors > 100


def test_rank_generator_errors_say_what_to_do():
    with pytest.raises(AssertionError, match="ep=2 and cp=2"):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    with pytest.raises(ParallelStateError, match="does not name 'cp'; add it"):
        RankGenerator(tp=1, ep=1, dp=2, pp=1, cp=2, order="tp-pp-dp")
    with pytest.raises(ParallelStateError, match="unknown token"):
        RankGenerator(tp=1, ep=1, dp=2, pp=1, cp=1, order="tp-xx-dp")
    with pytest.raises(ParallelStateTypeError, match="tp size"):
        RankGenerator(tp=1.0, ep=1, dp=2, pp=1, cp=1, order="tp-dp")
    # megatron-core silently ignores a negative offset.
    with pytest.raises(ParallelStateError, match="rank_offset must be >= 0"):
        RankGenerator(tp=1, ep=1, dp=2, pp=1, cp=1, order="tp-dp", rank_offset=-1)
    with pytest.raises(ValueError, match="'ep', which order 'tp-pp-dp'"):
        RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-pp-dp").get_mask("tp-pp-dp", "ep")


def _parallel_sizes():
    for n in (1, 2, 3, 4):
        yield from (list(p) for p in itertools.product((1, 2, 3), repeat=n))
    yield [4, 1, 2, 5]


def test_masked_orthogonal_groups_match_megatron(mc):
    checked = 0
    for sizes in _parallel_sizes():
        total = math.prod(sizes)
        for mask in itertools.product((False, True), repeat=len(sizes)):
            group = math.prod(s for s, m in zip(sizes, mask, strict=True) if m)
            # megatron-core also takes a smaller world (a prefix of the groups) and a slightly larger one.
            for world in {total, max(1, total // 2), total + group - 1, total + group}:
                try:
                    expected = mc.generate_masked_orthogonal_rank_groups(world, sizes, list(mask))
                except AssertionError:
                    with pytest.raises(ParallelStateAssertionError, match="lays out only"):
                        generate_masked_orthogonal_rank_groups(world, sizes, list(mask))
                    continue
                assert generate_masked_orthogonal_rank_groups(world, sizes, list(mask)) == expected, (world, sizes, mask)
                checked += 1
    assert checked > 1000
    with pytest.raises(ParallelStateError, match="one bool per dimension"):
        generate_masked_orthogonal_rank_groups(4, [2, 2], [True])
    with pytest.raises(ParallelStateTypeError, match="mask\\[0\\] must be True or False"):
        generate_masked_orthogonal_rank_groups(4, [2, 2], ["yes", False])


def test_default_embedding_ranks_match_megatron(mc):
    for pp_ranks in ([5], [0, 4], [1, 3, 5], [7, 2, 9, 4]):
        assert default_embedding_ranks(pp_ranks) == mc.default_embedding_ranks(pp_ranks)
        assert default_position_embedding_ranks(pp_ranks) == mc.default_position_embedding_ranks(pp_ranks)
    with pytest.raises(ParallelStateError, match="pp_ranks is empty"):
        default_embedding_ranks([])


# --- hierarchical and hybrid groups against what megatron-core would create ----------------------

class _EinopsRearrange:
    """einops.rearrange for the one pattern megatron-core uses, ``(l s u) -> (l u) s``, by its definition.

    Used only when einops is not installed (it is not a dependency): position ``l*S*U + s*U + u``
    of the input goes to row ``l*U + u``, column ``s``.
    """

    @staticmethod
    def rearrange(array, pattern, *, l, s, u):  # noqa: E741  (einops' axis names)
        assert pattern == "(l s u) -> (l u) s", pattern
        return np.asarray(array).reshape(l, s, u).transpose(0, 2, 1).reshape(l * u, s)


def _recording_megatron(mc, monkeypatch):
    """megatron-core's module with create_group replaced by a recorder of (ranks, keyword arguments)."""
    made = []

    def record(ranks, **kwargs):
        made.append((list(ranks), kwargs))
        return ("group", tuple(ranks), kwargs.get("backend"))

    monkeypatch.setattr(mc, "create_group", record)
    try:
        import einops  # noqa: F401
    except ImportError:
        monkeypatch.setattr(mc, "einops", _EinopsRearrange, raising=False)
        monkeypatch.setattr(mc, "HAVE_EINOPS", True)
    return made


HIERARCHIES = [([2], 2), ([4], 4), ([2, 2], 4), ([2, 3], 6), ([3, 2], 6), ([2, 2, 4], 16), ([1, 4], 4),
               ([4, 1], 4), ([2, 1, 3], 6), ([3, 2, 2], 12)]


def test_hierarchical_rank_groups_match_megatron(mc, monkeypatch):
    made = _recording_megatron(mc, monkeypatch)
    for sizes, n in HIERARCHIES:
        ranks = [3 * r + 1 for r in range(n)][::-1]  # neither sorted nor starting at 0
        mine = hierarchical_rank_groups(ranks, sizes)
        assert [len(level) for level in mine] == [n // s for s in sizes]
        for rank in (ranks[0], ranks[-1], 1000):
            made.clear()
            groups, gloo = mc.create_hierarchical_groups(rank, ranks, sizes, create_gloo_process_groups=True,
                                                         group_desc="HCP")
            assert [r for r, kw in made if kw.get("backend") != "gloo"] == [g for level in mine for g in level]
            assert [r for r, kw in made if kw.get("backend") == "gloo"] == [g for level in mine for g in level]
            assert [g[1] for g in groups] == [tuple(g) for level in mine for g in level if rank in g]
            assert len(gloo) == len(groups)
    with pytest.raises(ParallelStateError, match="multiply to 4, but there are 6 ranks"):
        hierarchical_rank_groups(range(6), [2, 2])


def test_hybrid_rank_groups_match_megatron(mc, monkeypatch):
    made = _recording_megatron(mc, monkeypatch)
    for n in range(1, 19):
        ranks = [5 * r + 2 for r in range(n)][::-1]
        made.clear()
        mc.create_hybrid_dp_cp_groups(ranks[0], ranks, None)
        mine = hybrid_rank_groups(ranks)
        assert [r for r, _ in made] == [g for size in mine for g in mine[size]], n
        assert [kw["group_desc"] for _, kw in made] == [f"HYBRID_DP_CP_GROUP_{size}" for size in mine
                                                       for _ in mine[size]]
    assert hybrid_rank_groups(range(10)) == {2: [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]],
                                             4: [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]}
    with pytest.raises(ParallelStateError, match="repeats a rank"):
        hybrid_rank_groups([0, 1, 1, 2])


# --- NCCL options -------------------------------------------------------------------------------

def test_nccl_options(mc):
    cfgs = {"tp": {"max_ctas": 16}}
    assert get_nccl_options("dp", cfgs) is None
    import torch.distributed as dist

    if not hasattr(dist, "ProcessGroupNCCL"):
        with pytest.raises(ParallelStateError, match="no NCCL"):
            get_nccl_options("tp", cfgs)
    else:
        options = get_nccl_options("tp", {"tp": {"max_ctas": 16, "is_high_priority_stream": True}})
        assert options.config.max_ctas == 16 and options.is_high_priority_stream
        with pytest.raises(ParallelStateError, match="use 'IB' or 'socket'"):
            get_nccl_options("tp", {"tp": {"net_name": "eth"}})
    with pytest.raises(ParallelStateTypeError, match="must be a mapping"):
        get_nccl_options("tp", {"tp": 16})
    with pytest.raises(ParallelStateTypeError, match="nccl_comm_cfgs must be a dict"):
        get_nccl_options("tp", None)


def test_overwrite_nccl_comm_cfgs_matches_megatron(mc):
    ours, theirs = {"tp": {"max_ctas": 8}}, {"tp": {"max_ctas": 8}}
    for name, pair in [("tp", ("max_ctas", 4)), ("dp_cp", ("is_high_priority_stream", True)), ("tp", ("min_ctas", 1))]:
        overwrite_nccl_comm_cfgs(ours, name, pair)
        mc.overwrite_nccl_comm_cfgs(theirs, name, pair)
    assert ours == theirs == {"tp": {"max_ctas": 4, "min_ctas": 1}, "dp_cp": {"is_high_priority_stream": True}}
    with pytest.raises(ParallelStateTypeError, match="key_value_pair"):
        overwrite_nccl_comm_cfgs(ours, "tp", ("max_ctas",))


def test_load_nccl_comm_cfgs(tmp_path):
    assert load_nccl_comm_cfgs(None) == {}
    assert load_nccl_comm_cfgs(None, ["dp_cp", "tp"]) == {"dp_cp": {"is_high_priority_stream": True},
                                                         "tp": {"is_high_priority_stream": True}}
    path = tmp_path / "nccl.yaml"
    path.write_text("tp:\n  max_ctas: 16\n")
    try:
        import yaml  # noqa: F401
    except ImportError:
        with pytest.raises(ParallelStateError, match="pip install pyyaml"):
            load_nccl_comm_cfgs(str(path))
        return
    assert load_nccl_comm_cfgs(str(path), ["tp"]) == {"tp": {"max_ctas": 16, "is_high_priority_stream": True}}
    with pytest.raises(ParallelStateError, match="cannot be read"):
        load_nccl_comm_cfgs(str(tmp_path / "missing.yaml"))
    path.write_text("- tp\n")
    with pytest.raises(ParallelStateError, match="not a mapping"):
        load_nccl_comm_cfgs(str(path))
    path.write_text("# tp:\n#   max_ctas: 16\n")
    assert load_nccl_comm_cfgs(str(path), ["tp"]) == {"tp": {"is_high_priority_stream": True}}
    path.write_text("tp: 16\n")
    with pytest.raises(ParallelStateError, match="the settings of group 'tp' must be a mapping"):
        load_nccl_comm_cfgs(str(path))


# --- memory buffers -----------------------------------------------------------------------------

def test_global_memory_buffer_on_cpu():
    import torch

    buf = GlobalMemoryBuffer()
    allocations = []

    class Counting:
        def __enter__(self):
            allocations.append(1)

        def __exit__(self, *exc):
            return False

    a = buf.get_tensor((4, 6), torch.float32, "x", mem_alloc_context=Counting)
    assert a.shape == (4, 6) and a.device.type == "cpu" and not a.requires_grad
    b = buf.get_tensor([2, 3], torch.float32, "x", mem_alloc_context=Counting)  # fits: the same memory
    assert b.data_ptr() == a.data_ptr() and allocations == [1]
    c = buf.get_tensor(torch.Size([5, 6]), torch.float32, "x", mem_alloc_context=Counting)  # grows
    assert c.numel() == 30 and allocations == [1, 1] and buf.buffer[("x", torch.float32)].numel() == 30
    assert buf.get_tensor((2, 3), torch.bfloat16, "x").dtype == torch.bfloat16
    assert buf.get_tensor((2, 3), torch.float32, "y").data_ptr() != c.data_ptr()
    assert len(buf.buffer) == 3
    with pytest.raises(ParallelStateTypeError, match="torch.dtype"):
        buf.get_tensor((2,), "float32", "z")
    with pytest.raises(ParallelStateError, match="negative size"):
        buf.get_tensor((2, -1), torch.float32, "z")


def test_global_memory_buffer_lifecycle():
    destroy_global_memory_buffer()
    with pytest.raises(AssertionError, match="call initialize_model_parallel"):
        get_global_memory_buffer()
    set_global_memory_buffer()
    try:
        assert isinstance(get_global_memory_buffer(), GlobalMemoryBuffer)
        with pytest.raises(ParallelStateAssertionError, match="already initialized"):
            set_global_memory_buffer()
    finally:
        destroy_global_memory_buffer()
    with pytest.raises(ParallelStateAssertionError):
        get_global_memory_buffer()
    with pytest.raises(AssertionError, match="symmetric memory buffer is not initialized"):
        get_global_symmetric_memory_buffer()


def test_symmetric_memory_buffer_needs_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the error on a machine without CUDA")
    with pytest.raises(ParallelStateError, match="needs CUDA"):
        GlobalSymmetricMemoryBuffer(size_in_mb=1, process_group=None)


# --- process groups on real gloo ranks ----------------------------------------------------------

def _gloo_timeout(group):
    import torch

    return group._get_backend(torch.device("cpu")).options._timeout


def _symmetric_memory_manager(group):
    """megatron-core 0.17+'s SymmetricMemoryManager over a gloo group: what each step answers."""
    import torch

    out = []
    try:
        SymmetricMemoryManager.get_buffer("pair")
    except ParallelStateAssertionError as exc:
        out.append(type(exc).__name__)
    buf = SymmetricMemoryManager.get_buffer("pair", process_group=group, size_mb=1)
    out += [isinstance(buf.init_failure_reason, str) and bool(buf.init_failure_reason),
            buf.maybe_get_tensor((2, 3), torch.float32), buf.maybe_get_tensors([(6, torch.float32), (1, torch.int8)]),
            SymmetricMemoryManager.get_buffer("pair") is buf, SymmetricMemoryManager.is_initialized("pair")]
    SymmetricMemoryManager.destroy()
    out.append(SymmetricMemoryManager.is_initialized("pair"))
    try:
        SymmetricMemoryManager.get_buffer("pair", process_group="tp")
    except ParallelStateTypeError as exc:
        out.append(type(exc).__name__)
    return out


def _groups_and_timeouts(expected_hier, expected_hybrid):
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from parallel_state.groups import process_groups as pgs
    from parallel_state.groups.hierarchical import create_hierarchical_groups, create_hybrid_dp_cp_groups

    me = dist.get_rank()
    original = _gloo_timeout(c10d._get_default_group())
    start = c10d._world.group_count
    made = []
    try:
        mine = None
        for ranks in ([0, 1], [2, 3]):
            group = create_group(ranks, timeout=datetime.timedelta(seconds=50), group_desc="PAIR")
            made.append(group)
            if me in ranks:
                assert dist.get_process_group_ranks(group) == ranks and group.group_desc == "PAIR"
                mine = group
            else:
                assert group is dist.GroupMember.NON_GROUP_MEMBER
        after_pairs = c10d._world.group_count - start
        # With torch's barrier after each group turned on, non-members must take part (the full path).
        os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
        try:
            odd = create_group([1, 3])
        finally:
            del os.environ["TORCH_DIST_INIT_BARRIER"]
        made.append(odd)
        whole = create_group()  # None: the whole world
        made.append(whole)
        t = torch.ones(1)
        dist.all_reduce(t, group=mine)
        assert t.item() == 2
        dist.all_reduce(t, group=whole)
        assert t.item() == 8
        recorded = pgs.process_groups()
        assert recorded[0] is None and mine in recorded and whole in recorded
        assert (odd in recorded) == (me in (1, 3))
        # The core registers groups it built itself; repeats and non-member placeholders are skipped.
        pgs.register_process_groups([mine, whole, None, dist.GroupMember.NON_GROUP_MEMBER])
        assert pgs.process_groups() == recorded
        try:
            pgs.register_process_groups(["tp"])
        except ParallelStateTypeError:
            pass
        else:
            raise AssertionError("register_process_groups took a str")

        hier, hier_gloo = create_hierarchical_groups(me, [0, 1, 2, 3], [2, 2], create_gloo_process_groups=True,
                                                     group_desc="HCP")
        made += hier + hier_gloo
        hybrid = create_hybrid_dp_cp_groups(me, [0, 1, 2, 3], None)
        made += list(hybrid.values())

        symmetric = _symmetric_memory_manager(mine)
        update_pg_timeout(datetime.timedelta(seconds=99))
        # Without include_world the default group keeps its timeout; the recorded groups change.
        world_kept = _gloo_timeout(c10d._get_default_group()) == original
        recorded_changed = _gloo_timeout(mine).total_seconds() == 99
        update_pg_timeout(datetime.timedelta(seconds=123), include_world=True)
        every = [_gloo_timeout(g) for g in (c10d._get_default_group(), mine, whole, *hier)]
        update_pg_timeout(datetime.timedelta(seconds=77), pg=mine)
        one = (_gloo_timeout(mine), _gloo_timeout(whole))
        errors = []
        for bad in ("ten", datetime.timedelta(0)):
            try:
                update_pg_timeout(bad)
            except ParallelStateError as exc:
                errors.append(type(exc).__name__)
        try:
            create_group([0, 4])
        except ValueError as exc:
            errors.append(str(exc))
        return {
            "after_pairs": after_pairs,
            "count": c10d._world.group_count - start,
            "every": [x.total_seconds() for x in every],
            "world_kept": world_kept and recorded_changed,
            "one": [x.total_seconds() for x in one],
            "hier": [dist.get_process_group_ranks(g) for g in hier],
            "hier_gloo": [dist.get_process_group_ranks(g) for g in hier_gloo],
            "hier_desc": [g.group_desc for g in hier + hier_gloo],
            "hybrid": {size: dist.get_process_group_ranks(g) for size, g in hybrid.items()},
            "errors": errors,
            "buffer_device": str(GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x").device),
            "symmetric": symmetric,
        } | {"ok": (expected_hier[me], expected_hybrid[me])}
    finally:
        dist.barrier()  # every rank done connecting its gloo groups before any rank closes them
        for group in made:
            if isinstance(group, dist.ProcessGroup):
                dist.destroy_process_group(group)
        pgs.clear_process_groups()
        update_pg_timeout(original, include_world=True)


def test_create_group_and_update_pg_timeout_on_gloo_ranks(pools, mc, monkeypatch):
    made = _recording_megatron(mc, monkeypatch)
    expected_hier, expected_hybrid = [], []
    expected_descs = []
    for rank in range(4):
        made.clear()
        groups, _ = mc.create_hierarchical_groups(rank, [0, 1, 2, 3], [2, 2], create_gloo_process_groups=True,
                                                  group_desc="HCP")
        expected_hier.append([list(g[1]) for g in groups])
        mine = [kw for r, kw in made if rank in r]
        expected_descs.append([kw["group_desc"] for kw in mine if kw.get("backend") != "gloo"]
                              + [kw["group_desc"] for kw in mine if kw.get("backend") == "gloo"])
        expected_hybrid.append({size: list(g[1]) for size, g in mc.create_hybrid_dp_cp_groups(rank, [0, 1, 2, 3],
                                                                                               None).items()})
    results = pools(4).run(_groups_and_timeouts, expected_hier, expected_hybrid, timeout=60)
    for rank, res in enumerate(results):
        hier, hybrid = res["ok"]
        # Every rank moved torch's counter alike, members or not, so later groups get the same names.
        assert res["after_pairs"] == 2 and res["count"] == results[0]["count"]
        assert res["every"] == [123.0] * 5 and res["one"] == [77.0, 123.0] and res["world_kept"]
        assert res["hier"] == res["hier_gloo"] == hier and res["hybrid"] == hybrid, rank
        assert res["hier_desc"] == expected_descs[rank]
        assert res["errors"][:2] == ["ParallelStateTypeError", "ParallelStateError"]
        assert "outside the world of 4 ranks" in res["errors"][2]
        assert res["buffer_device"] == "cpu"  # the collective device under gloo
        # gloo ranks share no GPU memory (on a GPU machine the rendezvous fails): the buffer is None, says why
        assert res["symmetric"] == [
            "ParallelStateAssertionError", True, {"tensor": None, "handle": None}, {"handle": None, "tensors": None},
            True, True, False, "ParallelStateTypeError"], rank


def test_create_group_needs_torch_distributed():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process has a default group")
    with pytest.raises(ParallelStateError, match="init_process_group"):
        create_group([0])


# --- is_torch_min_version -----------------------------------------------------------------------

def test_is_torch_min_version_matches_megatron(mc):
    import torch
    from megatron.core.utils import is_torch_min_version as reference

    base = torch.__version__.split("+")[0]
    major, minor = (int(x) for x in base.split(".")[:2])
    for version in ("1.13.1", "2.0", "2.4.0", base, torch.__version__, f"{major}.{minor + 1}", f"{major}.{minor}.99",
                    "99.0", "2.4.0a0"):
        for equality in (True, False):
            assert is_torch_min_version(version, equality) == reference(version, equality), (version, equality)
    assert is_torch_min_version(base) and not is_torch_min_version(torch.__version__, check_equality=False)
    with pytest.raises(ValueError, match="not a version number"):
        is_torch_min_version("two point four")
