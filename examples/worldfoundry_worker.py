"""A rank-0 request loop with WorldFoundry's RankCoordinator, on parallel_state.

Rank 0 serves requests (here: two, from a list); every other rank sits in ``worker_loop`` and
runs each request with it, over the context-parallel group. Run it on CPU with

    torchrun --nproc-per-node 2 examples/worldfoundry_worker.py

(``main()`` also runs inside a process group that is already up, as the tests do).
"""

from __future__ import annotations

from enum import IntEnum

import torch
import torch.distributed as dist

from parallel_state import worldfoundry as distributed


class Signal(IntEnum):
    GENERATE = 1
    EXIT = 2


class Pipeline:
    """Stands in for a model: each request's 'video' is split over the CP ranks and gathered back."""

    def __init__(self) -> None:
        self.served: list[list[float]] = []  # every rank's results, in request order
        rank = distributed.get_global_rank()
        self.rank_coordinator = distributed.RankCoordinator(
            device=distributed.get_distributed_device(), signal_type=Signal, is_master=rank == 0)
        self.rank_coordinator.register_distributed_ops(self)

    @distributed.distributed_op(Signal.GENERATE)
    def generate(self, prompt: str, frames: int) -> list[float]:
        """Every rank computes its shard of the frames; every rank returns the whole result."""
        group = distributed.get_cp_group()
        video = torch.arange(frames, dtype=torch.float32) * len(prompt)
        shard = distributed.split_inputs_cp(video, seq_dim=0, cp_group=group) + 1
        self.served.append(distributed.cat_outputs_cp(shard, seq_dim=0, cp_group=group).tolist())
        return self.served[-1]


def main() -> list[list[float]]:
    """Serve two requests from rank 0; every rank returns the results it computed, in order."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo")
    distributed.initialize_model_parallel(1, 1, dist.get_world_size())  # tp, pp, cp: all ranks share each request
    try:
        pipeline = Pipeline()
        if pipeline.rank_coordinator.is_master:
            for prompt in ("a cat", "a red car"):  # a real server would read these from its clients
                pipeline.generate(prompt, frames=4)
            pipeline.rank_coordinator.send_exit(exit_signal=Signal.EXIT)
            distributed.print_rank_0(f"served {len(pipeline.served)} requests: {pipeline.served}")
        else:
            pipeline.rank_coordinator.worker_loop(exit_signal=Signal.EXIT)
        return pipeline.served
    finally:
        distributed.destroy_model_parallel()
        if started:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
