"""dist_init, DistributedManager, the resolvers and the print helpers: env tables, rank pools, real torchrun launches."""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

import parallel_state as ps
import scheduler
from parallel_state import DistributedManager, LaunchInfo, ParallelStateError, ParallelStateWarning, TopologyPlan
from parallel_state.runtime.launch import DEFAULT_MASTER_PORT, LAUNCHERS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAUNCH_VARS = sorted({v for launcher in LAUNCHERS for names in launcher.fields.values() for v in names}
                     | {"OMPI_COMM_WORLD_LOCAL_SIZE"})
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1"}


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, no manager state, and no torch.distributed in this (the pytest) process."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    DistributedManager.cleanup()
    assert not ps.runtime.resolve.dist_ready()
    yield monkeypatch
    DistributedManager.cleanup()


def _set(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)


# --- launcher detection: environment tables ------------------------------------------------

DETECTED = {
    "single": ({}, LaunchInfo("single", 0, 1, 0)),
    "address-alone-names-no-launcher": ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"},
                                        LaunchInfo("single", 0, 1, 0)),
    "torchrun": (TORCHRUN, LaunchInfo("torchrun", 3, 4, 1, "127.0.0.1", 29555)),
    "slurm": (SLURM, LaunchInfo("slurm", 5, 8, 1, "127.0.0.1", DEFAULT_MASTER_PORT)),
    "slurm-nprocs-master-addr": ({"SLURM_PROCID": "2", "SLURM_NPROCS": "4", "SLURM_LOCALID": "0",
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29600"},
                                 LaunchInfo("slurm", 2, 4, 0, "127.0.0.1", 29600)),
    "openmpi": (OMPI, LaunchInfo("openmpi", 1, 2, 1, "127.0.0.1", DEFAULT_MASTER_PORT)),
    "openmpi-one-node-no-address": ({**OMPI, "MASTER_ADDR": None, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
                                    LaunchInfo("openmpi", 1, 2, 1, "127.0.0.1", DEFAULT_MASTER_PORT)),
    "torchrun-before-slurm": ({**SLURM, **TORCHRUN}, LaunchInfo("torchrun", 3, 4, 1, "127.0.0.1", 29555)),
    "slurm-before-openmpi": ({**OMPI, **SLURM}, LaunchInfo("slurm", 5, 8, 1, "127.0.0.1", DEFAULT_MASTER_PORT)),
}


@pytest.mark.parametrize("name", DETECTED)
def test_detect_launch_table(clean_env, name):
    env, expected = DETECTED[name]
    _set(clean_env, {k: v for k, v in env.items() if v is not None})
    info = ps.detect_launch()
    assert info == expected
    assert info.init_method == {"single": None, "torchrun": "env://"}.get(
        info.launcher, f"tcp://127.0.0.1:{expected.master_port}")


def test_init_method_brackets_ipv6():
    assert LaunchInfo("slurm", 0, 2, 0, "::1", 1234).init_method == "tcp://[::1]:1234"


INCOMPLETE = {  # environment -> exactly what the error must list as missing
    "rank-alone": ({"RANK": "0"}, ["WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]),
    "rank-without-master-addr": ({**TORCHRUN, "MASTER_ADDR": None}, ["MASTER_ADDR"]),
    "local-rank-alone": ({"LOCAL_RANK": "0"}, ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]),
    "torchrun-incomplete-beside-full-slurm": ({**SLURM, "RANK": "5"},
                                              ["WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]),
    "slurm-procid-alone": ({"SLURM_PROCID": "0"},
                           ["SLURM_NTASKS or SLURM_NPROCS", "SLURM_LOCALID", "SLURM_LAUNCH_NODE_IPADDR or MASTER_ADDR"]),
    "openmpi-rank-alone": ({"OMPI_COMM_WORLD_RANK": "0"},
                           ["OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "MASTER_ADDR"]),
    "openmpi-two-nodes-no-address": ({**OMPI, "MASTER_ADDR": None, "OMPI_COMM_WORLD_SIZE": "4",
                                      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, ["MASTER_ADDR"]),
}


@pytest.mark.parametrize("name", INCOMPLETE)
def test_incomplete_environment_lists_what_is_missing(clean_env, name):
    env, missing = INCOMPLETE[name]
    _set(clean_env, {k: v for k, v in env.items() if v is not None})
    with pytest.raises(ParallelStateError, match="missing: ") as err:
        ps.detect_launch()
    listed = str(err.value).split("missing: ")[1].split("; ")[0]
    assert listed.split(", ") == missing
    assert "single process" in str(err.value)
    # The manager refuses too, and stays uninitialized.
    with pytest.raises(ParallelStateError, match="missing: "):
        DistributedManager.initialize()
    assert not DistributedManager.is_initialized()


MALFORMED = {
    "rank-not-int": ({**TORCHRUN, "RANK": "three"}, "RANK='three' is not an integer"),
    "rank-outside-world": ({**TORCHRUN, "RANK": "4"}, "RANK=4 is outside the world of WORLD_SIZE=4"),
    "world-zero": ({**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    "local-above-rank": ({**TORCHRUN, "RANK": "0"}, "LOCAL_RANK=1 must be between 0 and the global rank RANK=0"),
    "port-out-of-range": ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    "slurm-ntasks-not-int": ({**SLURM, "SLURM_NTASKS": "8(x2)"}, "SLURM_NTASKS='8(x2)' is not an integer"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_environment_is_explained(clean_env, name):
    env, message = MALFORMED[name]
    _set(clean_env, env)
    with pytest.raises(ParallelStateError) as err:
        ps.detect_launch()
    assert message in str(err.value)


# --- resolvers: environment and single process (in this process) -----------------------------

def _local_device(index):
    """What collective_device() must say for local rank ``index`` outside a distributed run."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", index) if index < torch.cuda.device_count() else ParallelStateError


def _collective_device_or_error():
    try:
        return ps.collective_device()
    except ParallelStateError:
        return ParallelStateError


def test_resolvers_single_process(clean_env):
    import torch

    assert ps.resolve_world_size() == 1
    assert ps.resolve_global_rank() == 0
    assert ps.resolve_global_rank(7) == 7
    assert ps.collective_device() == _local_device(torch.cuda.current_device() if torch.cuda.is_available() else 0)


@pytest.mark.parametrize("env, world, rank", [(TORCHRUN, 4, 3), (SLURM, 8, 5), (OMPI, 2, 1)],
                         ids=["torchrun", "slurm", "openmpi"])
def test_resolvers_from_launcher_environment(clean_env, env, world, rank):
    _set(clean_env, env)
    assert ps.resolve_world_size() == world
    assert ps.resolve_global_rank() == rank
    assert ps.resolve_global_rank(0) == 0  # an explicit value, even 0, wins
    assert _collective_device_or_error() == _local_device(1)


def test_resolver_rejects_bad_explicit_rank(clean_env):
    with pytest.raises(ValueError, match="global_rank must be >= 0"):
        ps.resolve_global_rank(-1)
    for bad in ("1", True, 1.0):
        with pytest.raises(TypeError, match="global_rank must be an int"):
            ps.resolve_global_rank(bad)


def test_resolver_with_half_environment_says_what_is_missing(clean_env):
    clean_env.setenv("RANK", "2")
    assert ps.resolve_global_rank() == 2
    with pytest.raises(ParallelStateError, match="lacks WORLD_SIZE"):
        ps.resolve_world_size()


# --- DistributedManager in this process (single process: no torch.distributed started) -------

def test_manager_single_process_lifecycle(clean_env):
    import torch

    # PhysicsNeMo raises its Warning class as an error here; code catching either name keeps working.
    with pytest.raises(ps.PhysicsNeMoUninitializedDistributedManagerWarning, match="before DistributedManager.initialize"):
        DistributedManager()
    assert not DistributedManager.is_initialized()
    DistributedManager.initialize()
    assert DistributedManager.is_initialized()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning once initialized
        a, b = DistributedManager(), DistributedManager()
    assert a is not b and a.__dict__ is b.__dict__
    a.note = "shared"
    assert b.note == "shared"
    assert (b.rank, b.world_size, b.local_rank, b.distributed, b.launch.launcher) == (0, 1, 0, False, "single")
    assert b.device == _local_device(torch.cuda.current_device() if torch.cuda.is_available() else 0)
    assert b.cuda == torch.cuda.is_available()
    assert not ps.runtime.resolve.dist_ready()  # a single process starts no process group
    # The manager now answers first, even over a launcher environment set afterwards.
    _set(clean_env, TORCHRUN)
    assert (ps.resolve_world_size(), ps.resolve_global_rank()) == (1, 0)
    assert ps.collective_device() == b.device
    with pytest.warns(ParallelStateWarning, match="already initialized"):
        DistributedManager.initialize()
    DistributedManager.cleanup()
    assert not DistributedManager.is_initialized() and not hasattr(a, "note")
    assert (ps.resolve_world_size(), ps.resolve_global_rank()) == (4, 3)


def test_manager_rejects_bad_arguments(clean_env):
    with pytest.raises(TypeError, match="backend must be"):
        DistributedManager.initialize(backend=3)
    with pytest.raises(TypeError, match="timeout must be a positive datetime.timedelta"):
        DistributedManager.initialize(timeout=5)
    assert not DistributedManager.is_initialized()


# --- dist_init and the manager on a pool of real gloo ranks ------------------------------------

def _config(**engine):
    return SimpleNamespace(engine_config=SimpleNamespace(**engine))


def case_dist_init(config_form):
    import torch
    import torch.distributed as dist

    values = dict(distributed_backend="gloo", distributed_timeout_minutes=0.5, cp_size=2, pp_size=2)
    if config_form:
        ps.dist_init(_config(**values))
    else:
        ps.dist_init(**values)
    rank = dist.get_rank()
    plan = TopologyPlan(4, cp=2, pp=2, order="tp-cp-pp-dp")
    sched = scheduler.pipeline._scheduler  # created by dist_init through the hook
    out = {
        "cp": ps.get_context_parallel_global_ranks(),
        "pp": dist.get_process_group_ranks(ps.get_pp_group()),
        "expected_cp": list(plan.group_ranks("cp", rank)), "expected_pp": list(plan.group_ranks("pp", rank)),
        "is_last_rank": ps.is_last_rank(), "is_last_tp_cp_rank": ps.is_last_tp_cp_rank(),
        "cp_rank": ps.get_cp_rank(), "scheduler": sched is not None,
        "timeout": ps.groups.state.current().timeout.total_seconds(),
        "world": ps.resolve_world_size(), "rank": ps.resolve_global_rank(),
        "device": str(ps.collective_device()), "sched_device": str(sched.device),
    }
    # Called again with the same sizes it changes nothing; with other sizes it refuses.
    ps.dist_init(**values)
    assert scheduler.pipeline._scheduler is sched and ps.get_cp_world_size() == 2
    try:
        ps.dist_init(distributed_backend="gloo", cp_size=4, pp_size=1)
    except ParallelStateError as exc:
        out["relayout_error"] = str(exc)
    assert ps.get_cp_world_size() == 2 and torch.distributed.is_initialized()
    return out


@pytest.mark.parametrize("config_form", [True, False], ids=["config", "keywords"])
def test_dist_init_on_running_gloo_world(pools, config_form):
    for rank, out in enumerate(pools(4).run(case_dist_init, config_form)):
        assert out["cp"] == out["expected_cp"] and out["pp"] == out["expected_pp"], out
        assert out["is_last_rank"] == (rank == 3)
        assert out["is_last_tp_cp_rank"] == (out["cp_rank"] == 1)
        assert out["scheduler"] and out["sched_device"] == "cpu" and out["device"] == "cpu"
        assert out["timeout"] == 30.0
        assert (out["world"], out["rank"]) == (4, rank)
        assert "already initialized with tp=1, cp=2, pp=2" in out["relayout_error"]
        assert "destroy_model_parallel()" in out["relayout_error"]


def case_dist_init_errors():
    import torch.distributed as dist

    errors = {}
    attempts = {
        "sizes": lambda: ps.dist_init(distributed_backend="gloo", cp_size=2, pp_size=1),
        "backend": lambda: ps.dist_init(distributed_backend="nccl", cp_size=2, pp_size=2),
        "both": lambda: ps.dist_init(_config(distributed_backend="gloo", distributed_timeout_minutes=1,
                                             cp_size=2, pp_size=2), cp_size=2),
        "no_engine": lambda: ps.dist_init(SimpleNamespace(cp_size=2)),
        "engine_lacks": lambda: ps.dist_init(_config(cp_size=2, pp_size=2)),
        "cp_type": lambda: ps.dist_init(distributed_backend="gloo", cp_size="2", pp_size=2),
        "pp_value": lambda: ps.dist_init(distributed_backend="gloo", cp_size=4, pp_size=0),
        "minutes": lambda: ps.dist_init(distributed_backend="gloo", cp_size=2, pp_size=2,
                                        distributed_timeout_minutes=-1),
        "timeout": lambda: ps.dist_init(distributed_backend="gloo", cp_size=2, pp_size=2, timeout=30),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except (ParallelStateError, TypeError, ValueError) as exc:
            errors[name] = (type(exc).__name__, str(exc))
        assert not ps.is_initialized(), name  # nothing half-built
    assert dist.is_initialized()  # the world dist_init did not start is left alone

    def failing_hook():
        raise RuntimeError("hook failed")

    ps.register_dist_init_hook(failing_hook)
    try:
        ps.dist_init(distributed_backend="gloo", cp_size=2, pp_size=2)
    except RuntimeError as exc:
        errors["hook"] = (type(exc).__name__, str(exc))
    finally:
        ps.runtime.dist_init._dist_init_hooks.remove(failing_hook)
    errors["hook_left_groups"] = ps.is_initialized()
    return errors


def test_dist_init_errors_leave_nothing_behind(pools):
    for errors in pools(4).run(case_dist_init_errors):
        assert errors["sizes"] == ("ParallelStateError", errors["sizes"][1])
        assert "cp_size=2 * pp_size=1 = 2, but the world size is 4" in errors["sizes"][1]
        assert "already initialized with backend 'gloo'" in errors["backend"][1]
        assert errors["both"][0] == "TypeError" and "not both" in errors["both"][1]
        assert errors["no_engine"][0] == "TypeError" and "no engine_config" in errors["no_engine"][1]
        assert "lacks distributed_backend, distributed_timeout_minutes" in errors["engine_lacks"][1]
        assert errors["cp_type"] == ("TypeError", "cp_size must be an int, got '2'")
        assert errors["pp_value"] == ("ValueError", "pp_size must be >= 1, got 0")
        assert errors["minutes"][0] == "ValueError" and "distributed_timeout_minutes" in errors["minutes"][1]
        assert errors["timeout"][0] == "TypeError" and "datetime.timedelta" in errors["timeout"][1]
        assert errors["hook"] == ("RuntimeError", "hook failed") and errors["hook_left_groups"] is False


def case_dist_init_mismatch():
    import torch.distributed as dist

    odd = dist.get_rank() == 3  # launched with other values than the rest
    try:
        ps.dist_init(distributed_backend="gloo", cp_size=1 if odd else 2, pp_size=4 if odd else 2,
                     timeout=datetime.timedelta(seconds=20))
    except ParallelStateError as exc:
        return str(exc), ps.is_initialized()
    return None, ps.is_initialized()


def test_dist_init_names_the_rank_launched_with_other_values(pools):
    for message, initialized in pools(4).run(case_dist_init_mismatch):
        assert message is not None and initialized is False
        assert "dist_init" in message and "rank 3" in message and "cp_size" in message, message


def case_manager_adopts_running_world():
    import torch.distributed as dist

    rank = dist.get_rank()
    DistributedManager.initialize()
    try:
        m = DistributedManager()
        out = dict(rank=m.rank, world=m.world_size, local=m.local_rank, distributed=m.distributed,
                   backend=m.backend, device=str(m.device), cuda=m.cuda, launcher=m.launch.launcher,
                   resolved=(ps.resolve_global_rank(), ps.resolve_world_size()), coll=str(ps.collective_device()))
    finally:
        DistributedManager.cleanup()
    out["still_running"] = dist.is_initialized()  # it did not start the world, so it leaves it
    # A launcher environment that disagrees with the running world is refused.
    saved = {k: os.environ.get(k) for k in TORCHRUN}
    os.environ.update({**TORCHRUN, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "8"})
    try:
        DistributedManager.initialize()
    except ParallelStateError as exc:
        out["mismatch"] = str(exc)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out["after_mismatch"] = DistributedManager.is_initialized()
    return out


def test_manager_adopts_a_running_world(pools):
    for rank, out in enumerate(pools(4).run(case_manager_adopts_running_world)):
        assert (out["rank"], out["world"], out["local"]) == (rank, 4, rank)
        assert out["distributed"] and out["backend"] == "gloo" and out["launcher"] == "single"
        assert out["device"] == out["coll"] == "cpu" and out["cuda"] is False
        assert out["resolved"] == (rank, 4) and out["still_running"]
        assert f"initialized as rank {rank} of 4, but the torchrun environment says rank {rank} of 8" in out["mismatch"]
        assert out["after_mismatch"] is False


def case_print_helpers():
    from loguru import logger

    lines = []
    sink = logger.add(lines.append, format="{message}", level="INFO")
    try:
        ps.print_rank_0("once {not a format}")
        ps.print_per_rank("each")
    finally:
        logger.remove(sink)
    return [str(line).strip() for line in lines]


def test_print_helpers(pools):
    for rank, lines in enumerate(pools(4).run(case_print_helpers)):
        expected = (["[rank 0] once {not a format}"] if rank == 0 else []) + [f"[rank {rank}] each"]
        assert lines == expected


def test_print_rank_0_outside_distributed(clean_env):
    from loguru import logger

    lines = []
    sink = logger.add(lines.append, format="{name}:{function} {message}", level="INFO")
    try:
        ps.print_rank_0("alone")
        clean_env.setenv("RANK", "2")  # not distributed, but the line still names the rank
        ps.print_per_rank("env")
    finally:
        logger.remove(sink)
    # Each line is attributed to the caller, not to parallel_state.runtime.log.
    assert [str(line).strip() for line in lines] == [
        "test_runtime:test_print_rank_0_outside_distributed [rank 0] alone",
        "test_runtime:test_print_rank_0_outside_distributed [rank 2] env"]


def test_is_last_helpers_outside_distributed(clean_env):
    assert ps.is_last_rank() is True
    with pytest.raises(ParallelStateError, match="is_last_tp_cp_rank"):
        ps.is_last_tp_cp_rank()


# --- fresh processes -----------------------------------------------------------------------

def _python(code, env_extra, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=ROOT, **env_extra)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


NCCL_WITHOUT_CUDA = """
import json, torch.distributed as dist, parallel_state as ps
out = {}
for name, call in (("dist_init", lambda: ps.dist_init(distributed_backend="nccl")),
                   ("manager", lambda: ps.DistributedManager.initialize(backend="nccl"))):
    try:
        call()
    except ps.ParallelStateError as exc:
        out[name] = str(exc)
    out[name + "_started"] = dist.is_initialized() or ps.DistributedManager.is_initialized()
print(json.dumps(out))
"""


def test_nccl_without_cuda_fails_at_once():
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on CUDA machines too.
    out = _python(NCCL_WITHOUT_CUDA, {**TORCHRUN, "CUDA_VISIBLE_DEVICES": "", "RANK": "0", "LOCAL_RANK": "0",
                                      "WORLD_SIZE": "2", "MASTER_PORT": "9"})
    for name in ("dist_init", "manager"):
        assert "'nccl' needs CUDA" in out[name] and "gloo" in out[name], out
        assert out[name + "_started"] is False


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(mode, nnodes, node_rank, nproc, port):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
           "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
           "--max-restarts", "0", os.path.join(HERE, "launch_dist_init.py"), mode]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return dict(args=cmd, env=env, stderr=subprocess.STDOUT)


def _finish(outcomes):
    """Every launcher exited 0 (None: killed at the launch's timeout, with its workers); their joint output."""
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stdout[-6000:]
    return "\n".join(outcome.stdout for outcome in outcomes)


def _oks(output):
    # Ranks share the launcher's stdout, so one rank's line can run into another's: match tokens, not lines.
    return sorted(f"OK rank {r} local {lr}" for r, lr in re.findall(r"OK rank (\d+) local (\d+)", output))


def _one_node():
    return [_torchrun("single", 1, 0, 4, _free_port())]


def _two_nodes():
    port = _free_port()
    return [_torchrun("nodes", 2, node, 2, port) for node in (0, 1)]


@pytest.mark.launch(_one_node, timeout=180)
def test_torchrun_four_processes_pipeline_ring_and_rebuild(launched):
    output = _finish(launched)
    assert _oks(output) == [f"OK rank {r} local {r}" for r in range(4)], output[-4000:]


@pytest.mark.launch(_two_nodes, timeout=180)
def test_torchrun_two_nodes_local_rank_differs_from_rank(launched):
    output = _finish(launched)
    expected = ["OK rank 0 local 0", "OK rank 1 local 1", "OK rank 2 local 0", "OK rank 3 local 1"]
    assert _oks(output) == expected, output[-4000:]
