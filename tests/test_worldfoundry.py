"""parallel_state.worldfoundry: WorldFoundry's call forms replayed on 2 and 4 gloo ranks, the rank-0
orchestration on 4 ranks, the DTensor helpers on a 2-rank mesh against one-process arithmetic, and
every one of the 55 names with WorldFoundry's parameters.

WORLDFOUNDRY below is what WorldFoundry's sources declare (OpenEnvision/WorldFoundry
worldfoundry/core/distributed/__init__.py for the names; the signatures from its
model_parallel/context.py, collectives/{device_mesh,generic}.py, runtime/inference_runtime.py and
weed33834/WorldFoundry worldfoundry/core/distributed/{model_parallel_groups,pipeline_parallel,
rank_orchestration,logging}.py). The expected values are computed here from WorldFoundry's
documented semantics, not with its code.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import subprocess
import sys
import uuid
from enum import IntEnum
from types import SimpleNamespace

import pytest

from parallel_state import worldfoundry as distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUNS: dict = {}


def _run(pools, world, case, *args):
    """``case`` on ``world`` ranks, run once per session: test_every_name_is_exercised reuses the results."""
    key = (world, case.__name__, args)
    if key not in _RUNS:
        _RUNS[key] = pools(world).run(case, *args)
    return _RUNS[key]
R = inspect.Parameter.empty  # "required": no default
KW = "kw"  # marks the parameters after it keyword-only

#: name -> WorldFoundry's parameters in order: (name, default); KW starts the keyword-only ones.
WORLDFOUNDRY: dict[str, list] = {
    "broadcast": [("item", R), ("process_group", None)],
    "broadcast_split_tensor": [("tensor", R), ("seq_dim", R), ("process_group", None)],
    "cat_outputs_cp": [("x", R), ("seq_dim", R), ("cp_group", None)],
    "cat_outputs_cp_object_list": [("object_list", R), ("cp_group", None)],
    "cat_outputs_cp_with_grad": [("x", R), ("seq_dim", R), ("cp_group", None)],
    "find_split": [("shape_tensor", R), ("cp_size", R), ("patch_values", (1, 2, 2)), ("view_factor", 1)],
    "robust_broadcast": [("tensor", R), ("src", R), ("pg", R), ("is_check_shape", False)],
    "split_inputs_cp": [("x", R), ("seq_dim", R), ("cp_group", None)],
    "split_inputs_cp_object_list": [("object_list", R), ("cp_group", None)],
    "broadcast_dtensor_model_states": [("model", R), ("mesh", R)],
    "get_local_tensor_if_dtensor": [("tensor", R)],
    "get_local_tensor_if_DTensor": [("tensor", R)],
    "get_global_rank": [], "get_world_size": [], "is_distributed_initialized": [],
    "dist_init": [("config", R)], "is_last_rank": [], "is_last_tp_cp_rank": [],
    "get_distributed_device": [("local_rank", None)],
    "print_per_rank": [("message", R)], "print_rank_0": [("message", R)],
    "destroy_model_parallel": [], "get_cp_group": [("check_initialized", True)], "get_cp_rank": [],
    "get_cp_world_size": [], "get_dp_group": [("with_context_parallel", False)],
    "get_dp_group_gloo": [("with_context_parallel", False)], "get_dp_rank": [("with_context_parallel", False)],
    "get_dp_world_size": [("with_context_parallel", False)], "get_model_parallel_group": [],
    "get_pipeline_model_parallel_first_rank": [], "get_pipeline_model_parallel_last_rank": [],
    "get_pipeline_model_parallel_next_rank": [], "get_pipeline_model_parallel_prev_rank": [],
    "get_pp_group": [], "get_pp_rank": [], "get_pp_world_size": [],
    "get_tensor_model_parallel_last_rank": [("with_context_parallel", False)],
    "get_tensor_model_parallel_ranks": [("with_context_parallel", False)],
    "get_tensor_model_parallel_src_rank": [("with_context_parallel", False)],
    "get_tp_group": [("check_initialized", True), ("with_context_parallel", False)],
    "get_tp_rank": [("with_context_parallel", False)], "get_tp_world_size": [("with_context_parallel", False)],
    "initialize_model_parallel": [("tp_size", 1), ("pp_size", 1), ("cp_size", 1),
                                  ("nccl_communicator_config_path", None), ("distributed_timeout_minutes", 30),
                                  ("order", "tp-cp-pp-dp")],
    "model_parallel_is_initialized": [], "init_pp_scheduler": [], "pp_scheduler": [],
    "distributed_op": [("signal", R), KW, ("coordinator_attr", "rank_coordinator")],
    # classes: the constructor, then "Class.method"
    "PPScheduler": [], "DTensorFastEmaModelUpdater": [], "FastEmaModelUpdater": [],
    "DistributedOpSpec": [("signal", R), ("method_name", R)],
    "SignalBus": [KW, ("device", R), ("signal_type", R), ("master_rank", 0)],
    "PayloadBus": [KW, ("master_rank", 0)],
    "RankCoordinator": [KW, ("device", R), ("signal_type", R), ("is_master", R), ("master_rank", 0),
                        ("signal_bus", None), ("payload_bus", None)],
}
METHODS: dict[str, list] = {
    "PPScheduler.isend_next": [("tensor", R)], "PPScheduler.irecv_prev": [("buffer", R)],
    "PPScheduler.recv_prev_data": [("shape", R), ("dtype", R)],
    "PPScheduler.queue_irecv_prev": [("shape", R), ("dtype", R)], "PPScheduler.queue_irecv_prev_data": [],
    "DTensorFastEmaModelUpdater.copy_to": [("src_model", R), ("tgt_model", R)],
    "DTensorFastEmaModelUpdater.update_average": [("src_model", R), ("tgt_model", R), ("beta", 0.9999)],
    "DTensorFastEmaModelUpdater.cache": [("parameters", R), ("is_cpu", False)],
    "DTensorFastEmaModelUpdater.restore": [("parameters", R)],
    "SignalBus.send": [("signal", R)], "SignalBus.recv": [],
    "PayloadBus.broadcast_object": [("payload", R)],
    "RankCoordinator.invoke": [KW, ("signal", R), ("payload", R), ("handler", R)],
    "RankCoordinator.register": [KW, ("signal", R), ("method_name", R), ("callback", R)],
    "RankCoordinator.register_distributed_ops": [("obj", R)],
    "RankCoordinator.worker_loop": [KW, ("exit_signal", R)],
    "RankCoordinator.send_exit": [KW, ("exit_signal", R)],
}


def _params(obj):
    if inspect.isclass(obj):
        params = list(inspect.signature(obj.__init__).parameters.values())[1:]  # without self
    else:
        params = list(inspect.signature(obj).parameters.values())
        if "." in getattr(obj, "__qualname__", "") and params and params[0].name == "self":
            params = params[1:]
    return params


def _check_signature(name, obj, expected):
    """Ours takes WorldFoundry's parameters first, in its order, kinds and defaults; any more are optional."""
    params = _params(obj)
    keyword_only = False
    i = 0
    for item in expected:
        if item == KW:
            keyword_only = True
            continue
        pname, default = item
        assert i < len(params), f"{name}: lacks WorldFoundry's parameter {pname!r}"
        p = params[i]
        assert p.name == pname, f"{name}: parameter {i} is {p.name!r}, WorldFoundry's is {pname!r}"
        kind = inspect.Parameter.KEYWORD_ONLY if keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert p.kind == kind, f"{name}: {pname} is {p.kind.name}, WorldFoundry's is {kind.name}"
        if default is not R:
            assert p.default == default, f"{name}: {pname} defaults to {p.default!r}, WorldFoundry's to {default!r}"
        i += 1
    for p in params[i:]:  # what ours adds must not change a WorldFoundry call
        assert p.default is not R or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD), f"{name}: extra {p.name} is required"


def test_all_55_names_with_worldfoundry_parameters():
    assert len(distributed.__all__) == 55 == len(set(distributed.__all__))
    assert set(distributed.__all__) == set(WORLDFOUNDRY)
    public = {n for n in vars(distributed) if not n.startswith("_") and not inspect.ismodule(getattr(distributed, n))}
    assert public - {"annotations", "Any", "Optional"} == set(distributed.__all__)
    for name, expected in WORLDFOUNDRY.items():
        _check_signature(name, getattr(distributed, name), expected)
    for dotted, expected in METHODS.items():
        cls, meth = dotted.split(".")
        _check_signature(dotted, getattr(getattr(distributed, cls), meth), expected)
    assert distributed.FastEmaModelUpdater is distributed.DTensorFastEmaModelUpdater
    assert distributed.get_local_tensor_if_DTensor is distributed.get_local_tensor_if_dtensor
    # The main namespace keeps megatron-core's initialize_model_parallel; the facade has WorldFoundry's.
    import parallel_state as ps

    assert list(inspect.signature(ps.initialize_model_parallel).parameters)[0] == "tensor_model_parallel_size"
    assert list(inspect.signature(ps.get_tp_group).parameters) == ["with_context_parallel"]


def test_import_parallel_state_stays_light():
    code = ("import sys, parallel_state; bad = [m for m in ('cp', 'scheduler', 'parallel_state.worldfoundry', "
            "'parallel_state.runtime.orchestration', 'parallel_state.runtime.dtensor', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_single_process_forms():
    """WorldFoundry's documented single-process contract, and the orchestration outside a distributed run."""
    import torch

    x = torch.arange(24).reshape(2, 3, 4)
    assert distributed.split_inputs_cp(x, seq_dim=1, cp_group=None) is x
    assert distributed.cat_outputs_cp(x, seq_dim=1, cp_group=None) is x
    assert distributed.cat_outputs_cp_with_grad(x, 1, None) is x
    assert distributed.broadcast("cond", None) == "cond" and distributed.broadcast_split_tensor(x, 1) is x
    objs = ["a", "b"]
    assert distributed.split_inputs_cp_object_list(object_list=objs) is objs
    assert distributed.cat_outputs_cp_object_list(object_list=objs, cp_group=None) is objs
    assert distributed.robust_broadcast(x, 0, None, is_check_shape=True) is x
    assert not distributed.is_distributed_initialized()
    assert (distributed.get_global_rank(), distributed.get_world_size()) == (0, 1)
    assert distributed.get_distributed_device() == torch.device("cpu")  # CPU-only CI
    assert distributed.is_last_rank()
    distributed.print_rank_0("single process: logged")
    distributed.print_per_rank("single process: logged")
    with pytest.raises(TypeError, match="local_rank"):
        distributed.get_distributed_device(-1)
    # find_split under WorldFoundry's parameter name; cp_size_t is recorded.
    import parallel_state as ps

    assert distributed.find_split(shape_tensor=torch.Size([1, 16, 3, 8, 6]), cp_size=2) == torch.Size([3, 4, 6])
    assert ps.cp_size_t == 1
    ps.destroy_model_parallel()
    # One process: the master runs each op itself; a worker has nobody to hear from.
    coord = distributed.RankCoordinator(device=torch.device("cpu"), signal_type=Sig, is_master=True)
    assert Service(coord).add(2, b=3) == 5
    with pytest.raises(ValueError, match="not a member of Sig"):
        coord.invoke(signal=99, payload=1, handler=lambda p: p)
    with pytest.raises(ps.ParallelStateError, match="not initialized"):
        distributed.SignalBus(device=torch.device("cpu"), signal_type=Sig).recv()
    with pytest.raises(TypeError, match="IntEnum"):
        distributed.SignalBus(device=torch.device("cpu"), signal_type=int)


# --- replay of WorldFoundry's call forms -----------------------------------------------------------------

class _Tracked:
    """The facade, recording which names a case used."""

    def __init__(self):
        self.used = set()

    def __getattr__(self, name):
        self.used.add(name)
        return getattr(distributed, name)


def _ref_find_split(shape, cp_size, patch=(1, 2, 2)):
    """WorldFoundry's split rule, from its docs: the temporal factor first, then the height; never the width."""
    _, _, t, h, w = shape
    cp_t = math.gcd(t // patch[0], cp_size)
    cp_h = cp_size // cp_t
    assert (h // patch[1]) % cp_h == 0
    return [t // cp_t, h // cp_h, w], cp_t


def case_replay(world):
    """Model code as WorldFoundry writes it: MAGI-style dist_init + pp loop, Cosmos-style CP split and gather."""
    import torch
    import torch.distributed as dist

    import parallel_state as ps

    D = _Tracked()
    rank = D.get_global_rank()
    out = {"rank": rank, "world": D.get_world_size(), "ready": D.is_distributed_initialized(),
           "device": str(D.get_distributed_device()), "device0": str(D.get_distributed_device(0))}
    pp = 2 if world == 4 else 1
    cfg = SimpleNamespace(engine_config=SimpleNamespace(distributed_backend="gloo", distributed_timeout_minutes=1,
                                                        cp_size=world // pp, pp_size=pp))
    D.dist_init(cfg)
    D.print_rank_0("dist_init done")
    D.print_per_rank("on every rank")
    cp_group = D.get_cp_group()
    out.update(mp=D.model_parallel_is_initialized(), cp_rank=D.get_cp_rank(), cp_size=D.get_cp_world_size(),
               cp_ranks=dist.get_process_group_ranks(cp_group), pp_rank=D.get_pp_rank(), pp_size=D.get_pp_world_size(),
               pp_ranks=dist.get_process_group_ranks(D.get_pp_group()), dp_rank=D.get_dp_rank(),
               dp_size=D.get_dp_world_size(), dp_cp_size=D.get_dp_world_size(with_context_parallel=True),
               dp_ranks=dist.get_process_group_ranks(D.get_dp_group()),
               dp_gloo=dist.get_process_group_ranks(D.get_dp_group_gloo(with_context_parallel=True)),
               mp_ranks=dist.get_process_group_ranks(D.get_model_parallel_group()),
               tp_rank=D.get_tp_rank(), tp_size=D.get_tp_world_size(), tpcp_rank=D.get_tp_rank(with_context_parallel=True),
               tpcp_size=D.get_tp_world_size(True),
               tpcp_ranks=dist.get_process_group_ranks(D.get_tp_group(True, True)),
               tp_ranks=dist.get_process_group_ranks(D.get_tp_group()),
               tp_group_unchecked=D.get_tp_group(check_initialized=False) is ps.get_tp_group(),
               src=D.get_tensor_model_parallel_src_rank(), src_cp=D.get_tensor_model_parallel_src_rank(True),
               ps_src=ps.get_tensor_model_parallel_src_rank(),
               ps_src_keyword=_raises(ps.get_tensor_model_parallel_src_rank, with_context_parallel=True),
               ps_src_positional=_raises(ps.get_tensor_model_parallel_src_rank, True),
               tp_list=D.get_tensor_model_parallel_ranks(with_context_parallel=True),
               last=D.get_tensor_model_parallel_last_rank(with_context_parallel=True),
               first=D.get_pipeline_model_parallel_first_rank(), pp_last=D.get_pipeline_model_parallel_last_rank(),
               next=D.get_pipeline_model_parallel_next_rank(), prev=D.get_pipeline_model_parallel_prev_rank(),
               is_last=D.is_last_rank(), is_last_tp_cp=D.is_last_tp_cp_rank())

    # MAGI-style pipeline loop: each stage hands its activation to the next over the scheduler dist_init made.
    if pp > 1:
        sched = D.pp_scheduler()
        out["sched"] = isinstance(sched, D.PPScheduler)
        sched.queue_irecv_prev((2,), torch.float32)
        sched.isend_next(torch.full((2,), float(rank))).wait()
        out["pp_got"] = sched.queue_irecv_prev_data().tolist()

    # Cosmos-Predict2-style spatial split: find_split, then broadcast_split_tensor from the CP source.
    cp = D.get_cp_world_size()
    torch.manual_seed(0)
    latent = torch.randn(1, 4, 3, 8, 6)  # T=3 cannot take a factor 2: the height is split
    split = D.find_split(latent.shape, cp)
    out["split"], out["cp_size_t"] = list(split), ps.cp_size_t
    mine = latent if D.get_cp_rank() == 0 else torch.zeros(2, 2)  # receivers hold a placeholder of another shape
    local = D.broadcast_split_tensor(mine, seq_dim=3, process_group=cp_group)
    out["local"] = local
    out["same_as_split"] = torch.equal(D.split_inputs_cp(latent, seq_dim=3, cp_group=cp_group), local)
    x = (local * 2 + 1).flatten(3, 4)  # the "model", on the local tokens
    full = D.cat_outputs_cp(x, seq_dim=3, cp_group=cp_group)[:, :2]  # cat_outputs_cp(...)[:, :n]
    out["full"] = full
    # cat_outputs_cp_with_grad: the gradient of the gathered result reaches the local shard only.
    leaf = local.clone().requires_grad_(True)
    gathered = D.cat_outputs_cp_with_grad(leaf * 3, 3, cp_group)
    gathered.sum().backward()
    out["grad"] = leaf.grad.unique().tolist()
    out["gathered_with_grad"] = gathered.detach()
    # Conditions broadcast from the CP source: a tensor (receivers hold another shape), a str, a dict, None.
    cond = torch.arange(6.0).reshape(2, 3) if D.get_cp_rank() == 0 else torch.ones(5)
    out["cond"] = D.broadcast(cond, cp_group)
    out["text"] = D.broadcast("a red car" if D.get_cp_rank() == 0 else None, process_group=cp_group)
    out["meta"] = D.broadcast({"fps": 24} if D.get_cp_rank() == 0 else {"fps": 0}, cp_group)
    out["none"] = D.broadcast(None, cp_group)
    src = min(dist.get_process_group_ranks(cp_group))
    out["robust"] = D.robust_broadcast(torch.tensor([7, 8, 9]) if rank == src else torch.empty(1), src, cp_group)
    out["robust_checked"] = D.robust_broadcast(torch.full((2,), float(rank)), src, pg=cp_group, is_check_shape=True)
    try:
        D.robust_broadcast(torch.zeros(3 if rank == src else 4), src, cp_group, is_check_shape=True)
    except ValueError as exc:
        out["shape_error"] = str(exc)
    # Object lists: prompts split over the CP ranks and gathered back, with WorldFoundry's keyword.
    prompts = [f"prompt {i}" for i in range(2 * cp)]
    part = D.split_inputs_cp_object_list(object_list=prompts, cp_group=cp_group)
    out["part"] = part
    out["prompts"] = D.cat_outputs_cp_object_list(object_list=[p.upper() for p in part], cp_group=cp_group)
    D.destroy_model_parallel()

    # WorldFoundry's initialize_model_parallel: sizes positionally (tp, pp, cp), order tp-cp-pp-dp.
    if world == 4:
        D.initialize_model_parallel(1, 2, 2)
        D.init_pp_scheduler()
        out["init_pp"] = dist.get_process_group_ranks(D.pp_scheduler().group)
    else:
        D.initialize_model_parallel(2)
        out["init_pp"] = None
    out["init_cp"] = dist.get_process_group_ranks(D.get_cp_group())
    out["init_tp"] = dist.get_process_group_ranks(D.get_tp_group())
    out["used"] = D.used
    return out


def _layout(world, tp, cp, pp):
    """Global ranks of each group for order tp-cp-pp-dp (tp fastest): rank = tp + T*(cp + C*(pp + P*dp))."""
    dp = world // (tp * cp * pp)
    coords = {r: (r % tp, r // tp % cp, r // (tp * cp) % pp, r // (tp * cp * pp)) for r in range(world)}

    def group(rank, dims):
        mine = coords[rank]
        return sorted(r for r, c in coords.items() if all(c[i] == mine[i] for i in range(4) if i not in dims))

    return coords, dp, group


@pytest.mark.parametrize("world", [2, 4])
def test_replay_worldfoundry_call_forms(pools, world):
    import torch

    results = _run(pools, world, case_replay, world)
    pp = 2 if world == 4 else 1
    cp = world // pp
    coords, dp, group = _layout(world, 1, cp, pp)
    torch.manual_seed(0)
    latent = torch.randn(1, 4, 3, 8, 6)
    split, cp_t = _ref_find_split(latent.shape, cp)
    for rank, out in enumerate(results):
        _, cp_rank, pp_rank, dp_rank = coords[rank]
        cp_ranks, pp_ranks = group(rank, {1}), group(rank, {2})
        assert (out["rank"], out["world"], out["ready"], out["device"], out["device0"]) == (rank, world, True,
                                                                                            "cpu", "cpu")
        assert out["mp"] and out["cp_ranks"] == cp_ranks and out["pp_ranks"] == pp_ranks
        assert (out["cp_rank"], out["cp_size"], out["pp_rank"], out["pp_size"]) == (cp_rank, cp, pp_rank, pp)
        assert (out["dp_rank"], out["dp_size"], out["dp_cp_size"]) == (dp_rank, dp, dp * cp)
        assert out["dp_ranks"] == group(rank, {3}) and out["dp_gloo"] == group(rank, {1, 3})
        assert out["mp_ranks"] == group(rank, {0, 2})
        assert (out["tp_rank"], out["tp_size"], out["tp_ranks"]) == (0, 1, [rank])
        assert (out["tpcp_rank"], out["tpcp_size"], out["tpcp_ranks"]) == (cp_rank, cp, cp_ranks)
        assert out["tp_group_unchecked"]
        assert (out["src"], out["src_cp"], out["tp_list"], out["last"]) == (rank, cp_ranks[0], cp_ranks, cp_ranks[-1])
        # parallel_state's own accessor is megatron-core's, which takes no argument; the flag is WorldFoundry's.
        assert out["ps_src"] == rank
        assert "unexpected keyword argument 'with_context_parallel'" in out["ps_src_keyword"]
        assert out["ps_src_positional"].startswith("TypeError")
        assert (out["first"], out["pp_last"]) == (pp_ranks[0], pp_ranks[-1])
        assert (out["next"], out["prev"]) == (pp_ranks[(pp_rank + 1) % pp], pp_ranks[(pp_rank - 1) % pp])
        assert out["is_last"] == (rank == world - 1) and out["is_last_tp_cp"] == (cp_rank == cp - 1)
        if pp > 1:
            assert out["sched"] and out["pp_got"] == [float(out["prev"])] * 2
        # The spatial split, against WorldFoundry's arithmetic and torch's own chunking.
        assert (out["split"], out["cp_size_t"]) == (split, cp_t) == ([3, 8 // cp, 6], 1)
        expected_local = latent.chunk(cp, dim=3)[cp_rank]
        assert torch.equal(out["local"], expected_local) and out["same_as_split"]
        assert torch.equal(out["full"], (latent * 2 + 1).flatten(3, 4)[:, :2])  # all CP shards, rank order
        assert out["grad"] == [3.0]
        assert torch.equal(out["gathered_with_grad"], latent * 3)
        assert torch.equal(out["cond"], torch.arange(6.0).reshape(2, 3))
        assert (out["text"], out["meta"], out["none"]) == ("a red car", {"fps": 24}, None)
        assert out["robust"].tolist() == [7, 8, 9]
        assert out["robust_checked"].tolist() == [float(cp_ranks[0])] * 2
        assert "is_check_shape" in out["shape_error"] and "(3,)" in out["shape_error"] and "(4,)" in out["shape_error"]
        assert out["part"] == [f"prompt {i}" for i in range(2 * cp_rank, 2 * cp_rank + 2)]
        assert out["prompts"] == [f"PROMPT {i}" for i in range(2 * cp)]
        if world == 4:  # initialize_model_parallel(1, 2, 2): tp=1, pp=2, cp=2 in order tp-cp-pp-dp
            assert out["init_cp"] == [rank - rank % 2, rank - rank % 2 + 1] and out["init_pp"] == [rank % 2, rank % 2 + 2]
            assert out["init_tp"] == [rank]
        else:  # initialize_model_parallel(2): tp=2
            assert out["init_tp"] == [0, 1] and out["init_cp"] == [rank]


# --- orchestration ---------------------------------------------------------------------------------------

class Sig(IntEnum):
    ADD = 1
    ECHO = 2
    FAIL = 3
    RAW = 4
    STRAY = 5
    EXIT = 9


class Service:
    def __init__(self, coordinator):
        self.rank_coordinator = coordinator
        self.log = []

    @distributed.distributed_op(Sig.ADD)
    def add(self, a, b=0):
        self.log.append(("add", a, b))
        return a + b

    @distributed.distributed_op(Sig.ECHO)
    def echo(self, payload):
        self.log.append(("echo", payload))
        return payload

    @distributed.distributed_op(Sig.FAIL)
    def fail(self, bad_ranks):
        import torch.distributed as dist

        if dist.get_rank() in bad_ranks:
            raise ValueError(f"boom on {dist.get_rank()}")
        self.log.append(("fail-ok", tuple(bad_ranks)))


def _raises(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def case_orchestration():
    import torch.distributed as dist

    D = _Tracked()
    rank = dist.get_rank()
    device = D.get_distributed_device()
    master = rank == 0
    coord = D.RankCoordinator(device=device, signal_type=Sig, is_master=master)
    service = Service(coord)
    coord.register_distributed_ops(service)
    coord.register(signal=Sig.RAW, method_name="raw", callback=lambda: {}["no such key"])  # raises before invoke
    out = {"spec": Service.add.__distributed_op_spec__,
           "spec_type": isinstance(Service.add.__distributed_op_spec__, D.DistributedOpSpec),
           "wrong_master": _raises(D.RankCoordinator, device=device, signal_type=Sig, is_master=not master),
           "dup": _raises(coord.register, signal=Sig.ADD, method_name="other", callback=lambda: None)}
    # Buses on their own: ordered signals and a payload.
    bus = D.SignalBus(device=device, signal_type=Sig)
    payloads = D.PayloadBus()
    if master:
        bus.send(Sig.ECHO)
        bus.send(Sig.ADD)
        out["bus"] = [Sig.ECHO, Sig.ADD]
        out["payload"] = payloads.broadcast_object({"steps": 2})
    else:
        out["bus"] = [bus.recv(), bus.recv()]
        out["payload"] = payloads.broadcast_object(None)
    if master:
        out["results"] = [service.add(1, b=2), service.echo({"prompt": "a cat"})]
        out["worker_fail"] = _raises(service.fail, [2, 3])
        try:
            service.fail([0])
        except ValueError as exc:
            out["master_fail"] = f"{type(exc).__name__}: {exc}"
        out["raw"] = _raises(coord.invoke, signal=Sig.RAW, payload=1, handler=lambda p: p)
        out["after"] = service.add(5)  # the workers still serve after all those errors
        out["no_payload"] = _raises(coord.invoke, signal=Sig.ADD, payload=None, handler=lambda p: p)
        out["worker_only"] = _raises(coord.worker_loop, exit_signal=Sig.EXIT)
        coord.send_exit(exit_signal=Sig.EXIT)
    else:
        out["worker_args"] = _raises(service.add, 1)
        out["not_master_exit"] = _raises(coord.send_exit, exit_signal=Sig.EXIT)
        coord.worker_loop(exit_signal=Sig.EXIT)
    out["log"] = service.log
    # A signal no worker handles: an error on every rank, which ends the loops.
    if master:
        out["stray"] = _raises(coord.invoke, signal=Sig.STRAY, payload=0, handler=lambda p: p)
    else:
        out["stray"] = _raises(coord.worker_loop, exit_signal=Sig.EXIT)
    # A coordinator over a subgroup, whose master is not rank 0 (group: this project's extension).
    sub = dist.new_group([1, 3])
    if rank in (1, 3):
        sub_service = Service(D.RankCoordinator(device=device, signal_type=Sig, is_master=rank == 3, master_rank=3,
                                                group=sub))
        sub_service.rank_coordinator.register_distributed_ops(sub_service)
        if rank == 3:
            out["sub_fail"] = _raises(sub_service.fail, [1])
            out["sub"] = sub_service.echo("from rank 3")
            sub_service.rank_coordinator.send_exit(exit_signal=Sig.EXIT)
        else:
            sub_service.rank_coordinator.worker_loop(exit_signal=Sig.EXIT)
        out["sub_log"] = sub_service.log
    else:
        out["outsider"] = _raises(D.RankCoordinator, device=device, signal_type=Sig, is_master=False, master_rank=3,
                                  group=sub)
    dist.barrier()
    dist.destroy_process_group(sub)
    out["used"] = D.used
    return out


def case_silent_master():
    """The master never sends: the worker's wait ends in an error at the group's timeout, not a hang."""
    import datetime

    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    coord = distributed.RankCoordinator(device=torch.device("cpu"), signal_type=Sig, is_master=dist.get_rank() == 0,
                                        group=group)
    err = _raises(coord.worker_loop, exit_signal=Sig.EXIT) if dist.get_rank() == 1 else None
    dist.barrier()  # the master waits here, on the default group, while the worker times out
    dist.destroy_process_group(group)
    return err


def case_late_outcome(tag):
    """A worker whose op outlasts the group's timeout: the outcome round (the store's) names it on the master."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    rank, store = dist.get_rank(), c10d._get_default_store()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    coord = distributed.RankCoordinator(device=torch.device("cpu"), signal_type=Sig, is_master=rank == 0, group=group)

    def slow(payload):
        if rank == 1:  # the op lasts until the master has given up on it, however long its timeout took
            store.wait([f"{tag}/master gave up"], datetime.timedelta(seconds=60))
        return payload

    coord.register(signal=Sig.ECHO, method_name="slow",
                   callback=lambda: coord.invoke(signal=Sig.ECHO, payload=None, handler=slow))
    if rank == 0:
        err = _raises(coord.invoke, signal=Sig.ECHO, payload="x", handler=slow)
        store.set(f"{tag}/master gave up", "1")
    else:
        err = _raises(coord.worker_loop, exit_signal=Sig.EXIT)
    dist.barrier()  # on the default group: the master waits here while the worker finishes and reports
    dist.destroy_process_group(group)
    return err


def test_an_outcome_round_names_the_rank_that_never_reported(pools):
    master, worker = pools(2).run(case_late_outcome, uuid.uuid4().hex)
    assert master.startswith("ParallelStateError: rank 0: reporting the outcome of ECHO failed"), master
    assert "rank(s) 1 of 2 did not arrive within the timeout (0:00:02)" in master
    assert worker.startswith("ParallelStateError: rank 1: reporting the outcome of ECHO failed"), worker


def test_a_silent_master_is_an_error_at_the_group_timeout(pools):
    master, worker = pools(2).run(case_silent_master)
    assert master is None
    assert worker.startswith("ParallelStateError: rank 1: waiting for signal #0 from master rank 0 failed")
    assert "group's timeout" in worker


def test_orchestration_on_4_ranks(pools):
    results = _run(pools, 4, case_orchestration)
    expected_log = [("add", 1, 2), ("echo", {"prompt": "a cat"}), ("fail-ok", (0,)), ("add", 5, 0)]
    for rank, out in enumerate(results):
        assert out["spec"].signal == Sig.ADD and out["spec"].method_name == "add" and out["spec_type"]
        assert "is_master" in out["wrong_master"] and "already registered" in out["dup"]
        assert out["bus"] == [Sig.ECHO, Sig.ADD] and out["payload"] == {"steps": 2}
        assert "UnknownSignalError" in out["stray"] and "STRAY" in out["stray"] and "[1, 2, 3]" in out["stray"]
        if rank == 3:
            assert out["sub"] == "from rank 3" and out["sub_fail"].startswith("DistributedOpError: FAIL failed on 1")
            assert "rank 1: ValueError: boom on 1" in out["sub_fail"]
        if rank in (1, 3):
            assert out["sub_log"] == [("fail-ok", (1,))] * (rank == 3) + [("echo", "from rank 3")]
        else:
            assert "not a member of the group" in out["outsider"]
        if rank == 0:
            assert out["results"] == [3, {"prompt": "a cat"}] and out["after"] == 5
            # Workers' errors reach the master, each rank named with its exception.
            assert out["worker_fail"].startswith("DistributedOpError: FAIL failed on 2 rank(s)")
            assert "rank 2: ValueError: boom on 2" in out["worker_fail"] and "rank 3: ValueError: boom on 3" in \
                out["worker_fail"]
            assert out["master_fail"] == "ValueError: boom on 0"  # the master's own error, as it was
            assert "RAW failed on 3 rank(s)" in out["raw"] and "KeyError" in out["raw"]
            assert "ValueError" in out["no_payload"] and "ParallelStateError" in out["worker_only"]
            # the master's own log: its failing FAIL call logged nothing there
            assert out["log"] == [("add", 1, 2), ("echo", {"prompt": "a cat"}), ("fail-ok", (2, 3)), ("add", 5, 0)]
        else:
            assert "ValueError" in out["worker_args"] and "only the master" in out["not_master_exit"]
            fail_ok = [("fail-ok", (2, 3))] if rank == 1 else []
            assert out["log"] == expected_log[:2] + fail_ok + expected_log[2:]


def _example():
    spec = importlib.util.spec_from_file_location("worldfoundry_worker", os.path.join(ROOT, "examples",
                                                                                      "worldfoundry_worker.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case_example():
    return _example().main()


def test_example_serves_two_requests(pools):
    expected = [[(i * len(p) + 1) for i in range(4)] for p in ("a cat", "a red car")]
    assert pools(2).run(case_example) == [expected, expected]


# --- DTensor helpers ---------------------------------------------------------------------------------------

def _model(seed, dtype="float32"):
    import torch

    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.randn(4, 3, dtype=getattr(torch, dtype)))
    m.b = torch.nn.Parameter(torch.randn(6, dtype=getattr(torch, dtype)))
    return m


def _shard(module, mesh):
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    for name, p in list(module.named_parameters()):
        setattr(module, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return module


def case_dtensor():
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    import parallel_state as ps

    D = _Tracked()
    rank = dist.get_rank()
    ps.initialize_model_parallel()  # dp=2
    shard_mesh = ps.fsdp_mesh(2)["shard"]  # 1-D, both ranks: parameters sharded over it
    src, tgt = _shard(_model(1), shard_mesh), _shard(_model(2), shard_mesh)
    out = {"is_dtensor": isinstance(tgt.w, DTensor), "local_shape": tuple(D.get_local_tensor_if_DTensor(tgt.w).shape),
           "plain": D.get_local_tensor_if_dtensor(torch.ones(2)).tolist()}
    ema = D.FastEmaModelUpdater()
    ema.update_average(src, tgt, beta=0.9)
    out["ema"] = [D.get_local_tensor_if_dtensor(p).detach().clone() for p in tgt.parameters()]
    ema.cache(tgt.parameters(), is_cpu=True)
    out["cache_twice"] = _raises(ema.cache, tgt.parameters())
    ema.copy_to(src, tgt)
    out["copied"] = [D.get_local_tensor_if_dtensor(p).detach().clone() for p in tgt.parameters()]
    ema.restore(tgt.parameters())
    out["restored"] = [D.get_local_tensor_if_dtensor(p).detach().clone() for p in tgt.parameters()]
    out["restore_empty"] = _raises(ema.restore, tgt.parameters())
    half = _shard(_model(3, "float16"), shard_mesh)
    out["fp16"] = _raises(D.DTensorFastEmaModelUpdater().update_average, src, half)
    out["mismatch"] = _raises(ema.copy_to, src, torch.nn.Linear(2, 2))
    # State broadcast over the replicate dimension (both ranks replicate: shard size 1).
    mesh = ps.fsdp_mesh(1)
    torch.manual_seed(10 + rank)  # every rank starts different
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(DTensor.from_local(torch.randn(3, 2), mesh, [Replicate(), Replicate()],
                                                    run_check=False))
    model.register_buffer("steps", torch.tensor([rank + 1, rank + 2]))
    model.t = torch.nn.Parameter(torch.randn(2, 4).t())  # a non-contiguous plain parameter
    D.broadcast_dtensor_model_states(model, mesh)
    out["bcast"] = [D.get_local_tensor_if_dtensor(model.w).detach().clone(), model.steps.clone(), model.t.detach().clone()]
    out["no_replicate"] = _raises(D.broadcast_dtensor_model_states, model, shard_mesh)
    out["used"] = D.used
    return out


def test_dtensor_helpers_on_2_ranks_match_one_process(pools):
    import torch

    results = _run(pools, 2, case_dtensor)
    src, tgt = _model(1), _model(2)
    ema = [0.9 * t.detach() + 0.1 * s.detach() for t, s in zip(tgt.parameters(), src.parameters(), strict=True)]
    torch.manual_seed(10)
    w0, t0 = torch.randn(3, 2), torch.randn(2, 4).t()
    for rank, out in enumerate(results):
        assert out["is_dtensor"] and out["local_shape"] == (2, 3) and out["plain"] == [1.0, 1.0]
        for got, full in zip(out["ema"], ema, strict=True):
            assert torch.allclose(got, full.chunk(2)[rank], rtol=0, atol=1e-6)
        for got, full in zip(out["copied"], src.parameters(), strict=True):
            assert torch.equal(got, full.detach().chunk(2)[rank])
        for got, before in zip(out["restored"], out["ema"], strict=True):
            assert torch.equal(got, before)
        assert "already held" in out["cache_twice"] and "nothing is cached" in out["restore_empty"]
        assert "float32" in out["fp16"] and "TypeError" in out["fp16"]
        assert "ValueError" in out["mismatch"]
        w, steps, t = out["bcast"]
        assert torch.equal(w, w0) and steps.tolist() == [1, 2] and torch.equal(t, t0)
        assert "'replicate'" in out["no_replicate"]


def test_every_name_is_exercised(pools):
    """Every name of __all__ was called by one of the cases above (or is the class a case used through an instance)."""
    used = set()
    for world in (2, 4):
        used |= _run(pools, world, case_replay, world)[0]["used"]
    used |= _run(pools, 4, case_orchestration)[0]["used"]
    used |= _run(pools, 2, case_dtensor)[0]["used"]
    # Exercised in test_single_process_forms / by the cases without the tracker.
    used |= {"distributed_op"}
    assert set(distributed.__all__) - used == set()
