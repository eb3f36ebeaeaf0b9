"""Facts about a process group that the cp helpers need: its size, this rank's index, its backends.

Everything here works from the group object passed in; nothing reads the global parallel state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def check_group(group: Any, what: str, name: str = "cp_group") -> None:
    """Raise TypeError unless ``group`` is a ProcessGroup this rank belongs to."""
    if isinstance(group, dist.ProcessGroup):
        return
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise TypeError(
            f"{what}: {name} is torch's marker for a group this rank is not a member of; pass the group "
            f"this rank belongs to (e.g. parallel_state.get_context_parallel_group()), or None to disable"
        )
    raise TypeError(
        f"{what}: {name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}"
    )


def global_ranks(group: Any) -> list[int]:
    """The group's members as global ranks, in group-rank order."""
    return dist.get_process_group_ranks(group)


def parse_backend(name: str) -> dict[str, str] | None:
    """Device type -> backend for a backend name as torch reports it; None for a name not known here."""
    name = name.lower()
    if ":" in name:  # a multi-device group such as "cpu:gloo,cuda:nccl"
        return dict(part.strip().split(":", 1) for part in name.split(","))
    if name == "gloo":
        # gloo also carries CUDA tensors (through host copies); CPU comes first as its natural device.
        return {"cpu": "gloo", "cuda": "gloo"}
    if name == "nccl":
        return {"cuda": "nccl"}
    return None


def backend_map(group: Any) -> dict[str, str]:
    """Device type -> backend name for the devices ``group`` can communicate on."""
    name = str(dist.get_backend(group))
    bmap = parse_backend(name)
    if bmap is None:  # another backend: ask the group which devices it serves
        types = getattr(group, "_device_types", None) or [torch.device("cpu")]
        bmap = {t.type: name.lower() for t in types}
    return bmap


def backend_for(group: Any, device_type: str) -> str | None:
    """The backend ``group`` uses for tensors of ``device_type``, or None when it has none."""
    return backend_map(group).get(device_type)


def local_device(device_type: str) -> torch.device:
    """This process's device of ``device_type``: the current CUDA device for "cuda", as NCCL requires."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type)


def meta_device(group: Any) -> torch.device:
    """Where small metadata tensors (shapes, dtypes) travel for ``group``.

    It depends on the group only, never on a rank's own input, so every rank takes the same backend:
    in a "cpu:gloo,cuda:nccl" group a source with a CUDA tensor and a receiver holding None must
    still meet in the same collective. CPU when the group has a CPU backend (gloo), else the current
    CUDA device (NCCL), else the group's first device type.
    """
    bmap = backend_map(group)
    if "cpu" in bmap:
        return torch.device("cpu")
    if "cuda" in bmap:
        return local_device("cuda")
    return local_device(next(iter(bmap)))


def transport_device(group: Any, tensor: torch.Tensor) -> torch.device:
    """The device ``tensor`` must be on to travel through ``group``: its own when the group supports it."""
    bmap = backend_map(group)
    if tensor.device.type in bmap:
        return tensor.device
    return meta_device(group)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: every dtype travels bit-exact through every backend."""
    return t.detach().reshape(-1).view(torch.uint8)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """Gather equal-sized ``input`` from every rank into ``output`` (concatenated in group-rank order)."""
    # all_gather_single replaces the deprecated all_gather_into_tensor from torch 2.13 on.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)
