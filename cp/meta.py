"""A fixed-size int64 header that says what a source rank holds, so receivers can follow it.

One header travels in one small collective: the kind of item (tensor, None, other object or an
error the source found), the dtype, the device type and the shape. Because every rank acts on the
source's header rather than on its own input, a receiver that starts with None, a placeholder of
another shape or dtype, or a non-tensor still takes part in exactly the same collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: Longest shape a header carries; longer tensors are refused on every rank (beyond torch's CUDA limit).
MAX_NDIM = 28
HEADER_LEN = 4 + MAX_NDIM

TENSOR, NONE, OBJECT, ERR_NOT_TENSOR, ERR_NDIM, ERR_DTYPE = range(1, 7)

_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "complex32",
    "uint8", "int8", "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
)
#: Codes are positions in a fixed list of names, so ranks agree on them whatever this torch lacks.
DTYPES: dict[int, torch.dtype] = {
    i: getattr(torch, n) for i, n in enumerate(_DTYPE_NAMES) if isinstance(getattr(torch, n, None), torch.dtype)
}
DTYPE_CODES: dict[torch.dtype, int] = {d: i for i, d in DTYPES.items()}
DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "mps", "npu", "privateuseone", "meta")


@dataclass(frozen=True)
class Meta:
    """A decoded header."""

    kind: int
    dtype: torch.dtype | None = None
    device_type: str | None = None
    shape: tuple[int, ...] = ()
    #: The source's number of dimensions (also set for ERR_NDIM, where no shape travels).
    ndim: int = 0

    def describe(self) -> str:
        """Shape, dtype and device as an error message shows them."""
        if self.kind == NONE:
            return "None"
        if self.kind == ERR_NDIM:
            return f"a tensor with {self.ndim} dimensions (at most {MAX_NDIM} supported)"
        if self.kind == ERR_DTYPE:
            return "a tensor of an unsupported dtype or device"
        if self.kind != TENSOR:
            return "not a tensor"
        dtype = str(self.dtype).replace("torch.", "")
        return f"shape {tuple(self.shape)} {dtype} on {self.device_type}"


def encode(item: Any, *, objects: bool = False, device_type: str | None = None) -> list[int]:
    """The header for ``item``; with ``objects`` a non-tensor is OBJECT, else ERR_NOT_TENSOR.

    ``device_type`` overrides the tensor's own, for a tensor that will travel on another device.
    """
    device_type = device_type or (item.device.type if isinstance(item, torch.Tensor) else None)
    header = [0] * HEADER_LEN
    if item is None:
        header[0] = NONE
    elif not isinstance(item, torch.Tensor):
        header[0] = OBJECT if objects else ERR_NOT_TENSOR
    elif item.dim() > MAX_NDIM:
        header[0], header[3] = ERR_NDIM, item.dim()
    elif item.dtype not in DTYPE_CODES or device_type not in DEVICE_TYPES:
        header[0] = ERR_DTYPE
    else:
        header[0] = TENSOR
        header[1] = DTYPE_CODES[item.dtype]
        header[2] = DEVICE_TYPES.index(device_type)
        header[3] = item.dim()
        header[4:4 + item.dim()] = item.shape
    return header


def decode(header: list[int]) -> Meta:
    """The Meta a header describes."""
    kind, ndim = header[0], header[3]
    if kind != TENSOR:
        return Meta(kind, ndim=ndim)
    return Meta(kind, DTYPES[header[1]], DEVICE_TYPES[header[2]], tuple(header[4:4 + ndim]), ndim)


def header_tensor(item: Any, device: torch.device, *, objects: bool = False,
                  device_type: str | None = None) -> torch.Tensor:
    """``encode(item)`` as an int64 tensor on ``device``."""
    return torch.tensor(encode(item, objects=objects, device_type=device_type), dtype=torch.int64, device=device)
