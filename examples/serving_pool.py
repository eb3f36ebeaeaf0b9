"""A video-generation worker pool that picks the context-parallel size per request, with the group cache on.

Every rank runs ``serve``: for each request it switches the topology (destroy, then initialize at the
request's cp size), splits the request's latent over the cp group, runs a stand-in for the model (a
sum over the sequence, all-reduced in the cp group), gathers the result and checks it. With the cache
on, only the first request at each cp size builds process groups; every later switch reuses them.

Run it on 4 CPU ranks:
    GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 4 --master-addr 127.0.0.1 examples/serving_pool.py
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

import cp
import parallel_state as ps

#: (name, cp size, frames): short clips at cp 2, long ones over the whole pool.
REQUESTS = [("short clip", 2, 8), ("long 720p clip", 4, 32), ("short clip", 2, 8), ("long 720p clip", 4, 32),
            ("short clip", 2, 8)]


def serve(requests: list[tuple[str, int, int]] = REQUESTS) -> list[dict[str, object]]:
    """Serve ``requests`` on this rank; one record per request (what it built, how long the switch took)."""
    from torch.distributed import distributed_c10d as c10d

    ps.enable_group_cache()
    log = []
    try:
        for name, cp_size, frames in requests:
            groups_before = len(c10d._world.pg_map)
            t0 = time.perf_counter()
            ps.destroy_model_parallel()  # no-op before the first request
            ps.initialize_model_parallel(context_parallel_size=cp_size, timeout=datetime.timedelta(seconds=60))
            switch_ms = (time.perf_counter() - t0) * 1e3
            latent = torch.arange(frames * 6, dtype=torch.float64).reshape(1, frames, 6)  # [B, T, C]
            group = ps.get_context_parallel_group()
            local = cp.split_inputs_cp(latent, seq_dim=1, cp_group=group)
            total = local.sum(dim=1, keepdim=True)  # the "model": needs the whole sequence
            dist.all_reduce(total, group=group)
            out = cp.cat_outputs_cp(local + total / frames, seq_dim=1, cp_group=group)
            assert torch.equal(out, latent + latent.sum(dim=1, keepdim=True) / frames)
            log.append({"request": name, "cp": cp_size, "switch_ms": round(switch_ms, 2),
                        "new_groups": len(c10d._world.pg_map) - groups_before})
        ps.destroy_model_parallel()
        log.append({"cache": ps.group_cache_info()})
    finally:
        ps.clear_group_cache()
    return log


def main() -> None:
    dist.init_process_group("gloo")
    log = serve()
    if dist.get_rank() == 0:
        for record in log:
            print(record)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
