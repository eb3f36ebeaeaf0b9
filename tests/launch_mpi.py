"""Run under ``mpirun -np 4`` (Open MPI); driven by tests/test_runtime_mesh.py.

DistributedManager.initialize() must recognise the Open MPI launch from OMPI_COMM_WORLD_* alone
(no torchrun variables, no MASTER_ADDR: one node means the loopback address), then dist_init
builds cp 2 x pp 2 and every group, and device_mesh(), is checked against the plan with a real
collective; then the manager's meshes (over those very groups) and a named group. Each rank prints
``OK rank <r> local <l>``; any failed check raises, so mpirun exits non-zero.
"""

from __future__ import annotations

import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import parallel_state as ps  # noqa: E402
from parallel_state import TopologyPlan  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=60)


def main() -> str:
    rank, local = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    assert "RANK" not in os.environ and "MASTER_ADDR" not in os.environ, "not a pure Open MPI environment"
    ps.DistributedManager.initialize(backend="gloo", timeout=TIMEOUT)
    manager = ps.DistributedManager()
    info = manager.launch
    assert (info.launcher, info.master_addr) == ("openmpi", "127.0.0.1"), info
    assert (manager.rank, manager.world_size, manager.local_rank) == (rank, 4, local), manager
    assert dist.is_initialized() and dist.get_rank() == rank and dist.get_world_size() == 4
    ps.dist_init(distributed_backend="gloo", cp_size=2, pp_size=2, timeout=TIMEOUT)
    plan = TopologyPlan(4, cp=2, pp=2, order="tp-cp-pp-dp")
    groups = {"cp": ps.get_context_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
              "dp": ps.get_data_parallel_group(), "tp": ps.get_tensor_model_parallel_group()}
    mesh = ps.device_mesh()
    for kind, group in groups.items():
        ranks = list(plan.group_ranks(kind, rank))
        assert dist.get_process_group_ranks(group) == ranks, (kind, dist.get_process_group_ranks(group), ranks)
        assert mesh.get_group(kind) is group and mesh[kind].mesh.tolist() == ranks, kind
        t = torch.tensor([rank + 1])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(r + 1 for r in ranks), (kind, t.item(), ranks)
    # nvalchemi's calls: a 1-D world mesh is the world's group; a (pp, cp) mesh is the live groups themselves.
    world_mesh = manager.initialize_mesh(mesh_shape=(4,), mesh_dim_names=("domain",))
    assert manager.get_mesh_group(world_mesh) is dist.group.WORLD
    pp_cp = manager.initialize_mesh(mesh_shape=(2, -1), mesh_dim_names=("pp", "cp"))
    assert pp_cp.get_group("cp") is groups["cp"] and pp_cp.get_group("pp") is groups["pp"], "not the live groups"
    ps.DistributedManager.create_process_subgroup("model_parallel", 2)
    t = torch.tensor([rank + 1])
    dist.all_reduce(t, group=manager.group("model_parallel"))
    assert t.item() == (3 if rank < 2 else 7) and manager.group_rank("model_parallel") == rank % 2, t.item()
    ps.DistributedManager.cleanup()
    assert not dist.is_initialized() and not ps.is_initialized()
    return f"OK rank {rank} local {local}"


if __name__ == "__main__":
    print(main(), flush=True)
