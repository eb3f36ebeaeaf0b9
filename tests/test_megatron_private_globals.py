"""megatron-core's private globals written by hand, on real gloo ranks, beside megatron-core 0.16.1 itself.

TeleTron (``teletron/core/parallel_state.py``, ``initialize_model_parallel_base``) initializes
megatron-core without its ``initialize_model_parallel``: it creates the groups itself, writes them
into megatron-core's module globals (``ps._CONTEXT_PARALLEL_GROUP = group``, the global ranks as
``range`` objects, the gloo twins, the virtual pipeline's two), calls
``ps._set_global_memory_buffer()``, and its model then calls the getters. The sequence here is
that one, over this file's own rank arithmetic (megatron-core's default order, tp 1 x cp 2 x pp 2
on 4 ranks): it is replayed on megatron-core's module and on ``parallel_state``, with groups of
their own, and every getter's answer is compared (which written object a group or rank list is,
its ranks; sizes, ranks and flags by value; raising or not). TeleTron writes the virtual
pipeline's globals only with pp > 2 and three globals megatron-core 0.16 no longer has
(``_TENSOR_AND_EXPERT_PARALLEL_GROUP``, ``_DATA_MODULO_EXPERT_PARALLEL_GROUP`` and its gloo
twin, plain module attributes in both); here the first are written at pp 2 and the last left out.
"""

from __future__ import annotations

import inspect
import warnings

import parallel_state as ps
from parallel_state import ParallelStateError

TP, CP, PP = 1, 2, 2


def _teletron_writes(world: int) -> list[tuple[str, object]]:
    """Create TeleTron's groups (every rank creates every group, in one order) and return this rank's writes."""
    import torch.distributed as dist

    dp = world // (TP * CP * PP)
    rank = dist.get_rank()

    def at(t: int, c: int, d: int, p: int) -> int:
        return t + TP * (c + CP * (d + dp * p))

    coords = [(t, c, d, p) for p in range(PP) for d in range(dp) for c in range(CP) for t in range(TP)]

    def groups(*varying: int) -> list[list[int]]:
        """The groups over the coordinates at ``varying`` (0 tp, 1 cp, 2 dp, 3 pp), each sorted."""
        out: dict[tuple[int, ...], list[int]] = {}
        for x in coords:
            out.setdefault(tuple(v for i, v in enumerate(x) if i not in varying), []).append(at(*x))
        return [sorted(g) for g in out.values()]

    writes: list[tuple[str, object]] = []

    def build(kind_groups: list[list[int]], group_global: str | None, ranks_global: str | None = None,
              gloo_global: str | None = None, as_range: bool = False) -> None:
        for ranks in kind_groups:
            group = dist.new_group(ranks)
            gloo = dist.new_group(ranks, backend="gloo") if gloo_global else None
            if rank in ranks:
                if group_global:
                    writes.append((group_global, group))
                if gloo_global:
                    writes.append((gloo_global, gloo))
                if ranks_global:
                    step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
                    writes.append((ranks_global, range(ranks[0], ranks[-1] + 1, step) if as_range else ranks))

    build(groups(2), "_DATA_PARALLEL_GROUP", "_DATA_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GROUP_GLOO", True)
    build(groups(1, 2), "_DATA_PARALLEL_GROUP_WITH_CP", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
          "_DATA_PARALLEL_GROUP_WITH_CP_GLOO", True)
    build(groups(1), "_CONTEXT_PARALLEL_GROUP", "_CONTEXT_PARALLEL_GLOBAL_RANKS", as_range=True)
    build(groups(0, 3), "_MODEL_PARALLEL_GROUP")
    build(groups(0), "_TENSOR_MODEL_PARALLEL_GROUP")
    for pipeline in groups(3):
        build([pipeline], "_PIPELINE_MODEL_PARALLEL_GROUP", "_PIPELINE_GLOBAL_RANKS", as_range=True)
        for global_, ranks_global, members in (
                ("_EMBEDDING_GROUP", "_EMBEDDING_GLOBAL_RANKS", [pipeline[0], pipeline[-1]]),
                ("_POSITION_EMBEDDING_GROUP", "_POSITION_EMBEDDING_GLOBAL_RANKS", [pipeline[0]])):
            group = dist.new_group(members)
            if rank in members:
                writes.append((global_, group))
            if rank in pipeline:  # every stage knows its pipeline's embedding ranks
                writes.append((ranks_global, members))
    build(groups(0, 1, 2), "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP")
    build(groups(0, 2), "_TENSOR_AND_DATA_PARALLEL_GROUP")
    build([[r] for r in range(world)], "_EXPERT_MODEL_PARALLEL_GROUP")  # expert parallelism 1
    writes += [("_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK", 0), ("_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", 2)]
    return writes


def _getters(mps) -> list[tuple[str, dict]]:
    """megatron-core's getters callable without arguments, and their with_context_parallel=True variants."""
    calls = []
    for name, fn in sorted(vars(mps).items()):
        if name.startswith(("get_", "is_")) and inspect.isfunction(fn) and fn.__module__ == mps.__name__:
            params = inspect.signature(fn).parameters.values()
            if all(p.default is not p.empty for p in params if p.kind is not p.VAR_KEYWORD):
                calls.append((name, {}))
                if "with_context_parallel" in inspect.signature(fn).parameters:
                    calls.append((name, {"with_context_parallel": True}))
    return calls + [("get_data_parallel_group", {"with_context_parallel": True, "partial_data_parallel": True})]


def _answers(module, calls, writes) -> dict[str, object]:
    """Each call's answer: a written object by its global's name (and its ranks), anything else by value."""
    import torch.distributed as dist

    def describe(value):
        if value is None or isinstance(value, (bool, int, str)):
            return value
        names = sorted({name for name, v in writes if v is value})
        if names:
            ranks = dist.get_process_group_ranks(value) if isinstance(value, dist.ProcessGroup) else list(value)
            return ("written", names, ranks)
        if value is module._GLOBAL_MEMORY_BUFFER:
            return "the global memory buffer"
        return ("object", type(value).__name__)

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for name, kwargs in calls:
            try:
                out[f"{name}({kwargs})"] = describe(getattr(module, name)(**kwargs))
            except Exception:  # noqa: BLE001 - raising is the answer compared (megatron-core asserts, or indexes)
                out[f"{name}({kwargs})"] = "raises"
    return out


#: The process-group collection's fields TeleTron's writes fill (megatron-core asserts on the partial dp one).
FIELDS = ["tp", "pp", "mp", "cp", "embd", "pos_embd", "dp", "dp_cp", "tp_dp_cp"]


def _pg_collection(collection, writes) -> dict[str, object]:
    return {f: sorted(n for n, v in writes if v is getattr(collection, f)) for f in FIELDS}


def _initialize_by_hand(module, world: int) -> list[tuple[str, object]]:
    """TeleTron's initialization on ``module``: the groups written into its globals, then the memory buffer."""
    writes = _teletron_writes(world)
    for name, value in writes:
        setattr(module, name, value)
    if module._GLOBAL_MEMORY_BUFFER is None:
        module._set_global_memory_buffer()
    return writes


def case_teletron_initialization(world):
    """TeleTron's sequence on megatron-core's module, then on parallel_state (which bridges it); destroy leaves nothing."""
    import megatron.core.parallel_state as mps
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.distributed import distributed_c10d as c10d

    from parallel_state.groups import state
    from parallel_state.megatron import megatron_globals

    before = set(c10d._world.pg_map)
    calls = _getters(mps)
    names = sorted(megatron_globals.NAMES & set(vars(mps)))
    pristine = {name: getattr(mps, name) for name in names}
    out = {}

    # megatron-core 0.16.1 itself: the writes, the memory buffer, the getters; then its own destroy.
    theirs = _initialize_by_hand(mps, world)
    out["megatron"] = _answers(mps, calls, theirs)
    out["megatron_pgs"] = _pg_collection(ProcessGroupCollection.use_mpu_process_groups(required_pgs=FIELDS), theirs)
    dist.barrier()  # every rank done connecting its gloo groups before any rank closes them
    mps.destroy_model_parallel()  # frees its gloo groups, leaves the global ranks: put its module back
    for name, value in pristine.items():
        setattr(mps, name, value)
    for pg in set(c10d._world.pg_map) - before:
        dist.destroy_process_group(pg)

    # parallel_state: the same sequence with groups of its own.
    ours = _initialize_by_hand(ps, world)
    created = set(c10d._world.pg_map) - before
    out["ours"] = _answers(ps, calls, ours)
    out["ours_pgs"] = _pg_collection(ps.process_group_collection(required_pgs=FIELDS), ours)
    out["ours_reads"] = all(getattr(ps, name) is value for name, value in ours if not name.startswith("_VIRTUAL"))
    # megatron-core was loaded, so the bridge carried the writes into its module: its getters answer alike
    out["bridged"] = _answers(mps, calls, ours)

    ps.destroy_model_parallel()
    out["left"] = {
        "written": dict(state.written), "overrides": dict(state.overrides),
        "globals": {n: v for n, v in megatron_globals.values().items() if v not in (None, {})},
        "attributes": [n for n in vars(ps) if n in megatron_globals.NAMES],
        "megatron": [n for n in names if not (getattr(mps, n) is pristine[n] or getattr(mps, n) == pristine[n])],
        "initialized": [ps.is_initialized(), ps.model_parallel_is_initialized(), mps.is_initialized()],
    }
    try:
        ps.get_context_parallel_world_size()
    except AssertionError as exc:
        out["after_destroy"] = str(exc)
    # the groups were the caller's, as in megatron-core: destroy forgets them, their creator frees them
    out["groups_kept"] = set(c10d._world.pg_map) - before == created
    dist.barrier()  # every rank done connecting its gloo groups before any rank closes them
    for pg in created:
        dist.destroy_process_group(pg)
    return out


def test_teletron_initialization_answers_as_megatron_core(pools):
    for out in pools(4).run(case_teletron_initialization, 4, timeout=240):
        mismatched = {k: (v, out["ours"][k]) for k, v in out["megatron"].items() if v != out["ours"][k]}
        assert not mismatched, mismatched
        assert out["bridged"] == out["megatron"]
        assert out["ours_pgs"] == out["megatron_pgs"] and out["ours_reads"]
        # what TeleTron's model calls, as it gets them
        answers = out["ours"]
        assert answers["get_context_parallel_world_size({})"] == CP
        assert answers["get_context_parallel_group({})"][1] == ["_CONTEXT_PARALLEL_GROUP"]
        assert answers["get_context_parallel_global_ranks({})"][1] == ["_CONTEXT_PARALLEL_GLOBAL_RANKS"]
        # 0.19's default (with_gtp_remat=True) reads the gtp_remat group, which TeleTron does not write:
        # megatron-core 0.19 raises there too (the comparison above), earlier releases read the written group
        dp_cp = "raises" if ps.megatron_release() == "0.19" else CP
        assert answers["get_data_parallel_world_size({'with_context_parallel': True})"] == dp_cp
        assert answers["get_virtual_pipeline_model_parallel_world_size({})"] == 2
        assert answers["get_global_memory_buffer({})"] == "the global memory buffer"
        assert out["left"] == {"written": {}, "overrides": {}, "globals": {}, "attributes": [], "megatron": [],
                               "initialized": [False, False, False]}
        assert "not initialized: call parallel_state.initialize_model_parallel" in out["after_destroy"]
        assert out["groups_kept"]


def case_writes_over_a_build():
    """A write over initialize_model_parallel's groups takes effect everywhere; del, destroy and refusals."""
    from unittest import mock

    import megatron.core.parallel_state as mps
    import torch.distributed as dist

    out = {}
    ps.initialize_model_parallel(context_parallel_size=2)
    built = ps.get_context_parallel_group()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[dist.get_rank() // 2]
    mps._EMBEDDING_GLOBAL_RANKS = [7]  # on megatron-core's bridged module: megatron-core's alone
    ps._CONTEXT_PARALLEL_GROUP = mine
    out["megatron_side"] = [mps._EMBEDDING_GLOBAL_RANKS, ps._EMBEDDING_GLOBAL_RANKS == [dist.get_rank()]]
    out["write"] = [ps.get_context_parallel_group() is mine, ps.get_context_parallel_world_size() == 2,
                    ps.get_context_parallel_rank() == dist.get_rank() % 2, ps.process_group_collection().cp is mine,
                    mps.get_context_parallel_group() is mine, ps._CONTEXT_PARALLEL_GROUP is mine]
    with mock.patch.object(ps, "_CONTEXT_PARALLEL_GROUP", None):  # a write, then del to put the last one back
        out["patched"] = [ps.get_context_parallel_group(check_initialized=False), mps._CONTEXT_PARALLEL_GROUP]
        try:
            ps.get_context_parallel_world_size()
        except AssertionError:
            out["patched"].append("raises")
    out["restored"] = [ps.get_context_parallel_group() is mine, mps.get_context_parallel_group() is mine]
    del ps._CONTEXT_PARALLEL_GROUP  # undoes the write: the built group again
    out["undone"] = [ps.get_context_parallel_group() is built, mps.get_context_parallel_group() is built]
    ps._MPU_DATA_PARALLEL_WORLD_SIZE = 3  # megatron-core reads it first, for every data-parallel variant
    out["mpu"] = [ps.get_data_parallel_world_size(), ps.get_data_parallel_world_size(with_context_parallel=True),
                  mps.get_data_parallel_world_size()]
    errors = []
    for name, value in (("_global_process_group_list", []), ("_CONTEXT_PARALLEL_GROUP", 5),
                        ("_PIPELINE_GLOBAL_RANKS", "0,1"), ("_MPU_TENSOR_MODEL_PARALLEL_RANK", -1)):
        try:
            setattr(ps, name, value)
        except ParallelStateError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    out["unchanged"] = [ps.get_context_parallel_group() is built, "_global_process_group_list" not in vars(ps),
                        ps.get_tensor_model_parallel_rank() == 0]
    ps.destroy_model_parallel()
    out["mps_after"] = [mps._CONTEXT_PARALLEL_GROUP, mps._MPU_DATA_PARALLEL_WORLD_SIZE, mps._EMBEDDING_GLOBAL_RANKS]
    ps._TENSOR_MODEL_PARALLEL_GROUP = mine  # by hand: initialize refuses, as megatron-core's asserts
    try:
        ps.initialize_model_parallel(context_parallel_size=2)
    except AssertionError as exc:
        out["refused"] = str(exc)
    out["nothing_built"] = ps.groups.state.peek() is None and ps.get_tensor_model_parallel_group() is mine
    ps.destroy_model_parallel()
    dist.barrier()  # every rank done connecting its gloo groups before any rank closes them
    for pair in pairs:
        dist.destroy_process_group(pair)
    return out


def test_writes_over_a_build_take_effect_and_destroy_forgets_them(pools):
    for out in pools(4).run(case_writes_over_a_build, timeout=120):
        assert out["write"] == [True] * 6 and out["megatron_side"] == [[7], True]
        assert out["patched"] == [None, None, "raises"]
        assert out["restored"] == [True, True] and out["undone"] == [True, True]
        assert out["mpu"] == [3, 3, 3]
        process_list, group, ranks, mpu = out["errors"]
        assert "create_group" in process_list and "update_pg_timeout(timeout, pg=group)" in process_list
        assert "ProcessGroup" in group and "list (or range) of ints" in ranks and ">= 0" in mpu
        assert out["unchanged"] == [True] * 3 and out["mps_after"] == [None, None, None]
        assert "_TENSOR_MODEL_PARALLEL_GROUP" in out["refused"] and "destroy_model_parallel()" in out["refused"]
        assert out["nothing_built"]
