"""``AttentionMask`` (``cp.Mask``): which keys each query of a sequence may attend, as a value, never a matrix.

Every mask here gives each query one contiguous interval of keys, so ``key_range(positions, length)``
(the per-query ``[lo, hi)``) is the primitive and everything else is computed from it in O(length):
``allowed`` / ``dense`` (the bool matrix, for tests and small lengths), ``widths`` (keys per query)
and ``work`` (allowed query-key pairs). Kinds, with ``c(i) = i // chunk``:

- ``full``: every query sees every key.
- ``causal``: query i sees keys j <= i.
- ``chunk_causal(chunk)``: i sees j iff c(j) <= c(i) (its own chunk of frames and every earlier one).
- ``sliding_window(chunk, window)``: i sees j iff c(i) - window < c(j) <= c(i) (the ``window`` most
  recent chunks, its own included).
- ``packed(lengths, chunk=None)``: segments of these lengths one after another; i sees j only inside
  its own segment, all of it without ``chunk``, chunk-causally with it (chunks counted from the
  segment's start).
- ``token_window(left, right)``: i sees j iff ``i - left <= j <= i + right`` (a two-sided token window, as
  Transformer Engine's ``window_size=(left, right)``); None is unbounded on that side, so
  ``token_window(w, 0)`` is a causal window of ``w`` earlier tokens and ``token_window(None, 0)`` is ``causal()``.

Pure arithmetic: torch is imported inside the methods that return tensors, so importing this module
(and ``parallel_state``) stays light.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from parallel_state.errors import ParallelStateTypeError, ParallelStateValueError
from parallel_state.topology.str_enum import StrEnum

if TYPE_CHECKING:
    import torch


class MaskKind(StrEnum):
    """The kinds of mask, in the order the constructors are documented (``AttentionMask.kind``)."""

    FULL = "full"
    CAUSAL = "causal"
    CHUNK_CAUSAL = "chunk_causal"
    SLIDING_WINDOW = "sliding_window"
    PACKED = "packed"
    TOKEN_WINDOW = "token_window"

    def __repr__(self) -> str:  # a mask's repr reads as the value it was built from: kind='causal'
        return repr(self.value)

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields of ``AttentionMask`` a mask of this kind takes (the others stay None)."""
        return _FIELDS[self]


_FIELDS = {MaskKind.FULL: (), MaskKind.CAUSAL: (), MaskKind.CHUNK_CAUSAL: ("chunk",),
           MaskKind.SLIDING_WINDOW: ("chunk", "window"), MaskKind.PACKED: ("lengths", "chunk"),
           MaskKind.TOKEN_WINDOW: ("left", "right")}
#: Every kind's name, for messages.
KINDS = tuple(kind.value for kind in MaskKind)


def as_int(what: str, name: str, value: Any) -> int:
    """``value`` as an int (anything with ``__index__`` but a bool); ParallelStateTypeError naming it otherwise."""
    if isinstance(value, bool):
        raise ParallelStateTypeError(f"{what}: {name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ParallelStateTypeError(f"{what}: {name} must be an int, got {type(value).__name__} {value!r}") from None


def _positive_int(what: str, name: str, value: Any) -> int:
    value = as_int(what, name, value)
    if value < 1:
        raise ParallelStateValueError(f"{what}: {name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class AttentionMask:
    """A sequence-wide attention mask stated by a few numbers; build it with the classmethods.

    Equal by value and hashable. ``kind`` is a ``MaskKind`` (a name given as a string becomes its member, and
    its ``fields`` say which of the others it takes). ``chunk`` is in tokens (e.g. tokens per frame x frames per chunk),
    ``window`` in chunks, ``lengths`` the packed segments' lengths in tokens, ``left`` / ``right`` a
    two-sided window's reach in tokens (None: unbounded).
    """

    kind: MaskKind
    chunk: int | None = None
    window: int | None = None
    lengths: tuple[int, ...] | None = None
    left: int | None = None
    right: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ParallelStateValueError(f"AttentionMask: unknown kind {self.kind!r}; use one of {KINDS} "
                                          f"(build masks with AttentionMask.causal(), .chunk_causal(chunk), ...)")
        kind = MaskKind(self.kind)
        object.__setattr__(self, "kind", kind)
        what = f"AttentionMask({kind.value!r})"
        for name in ("chunk", "window", "lengths", "left", "right"):
            if name not in kind.fields and getattr(self, name) is not None:
                raise ParallelStateValueError(f"{what}: a {kind} mask takes no {name}; got {name}="
                                              f"{getattr(self, name)!r}")
        if kind in (MaskKind.CHUNK_CAUSAL, MaskKind.SLIDING_WINDOW) or self.chunk is not None:
            object.__setattr__(self, "chunk", _positive_int(what, "chunk", self.chunk))
        if kind is MaskKind.SLIDING_WINDOW:
            object.__setattr__(self, "window", _positive_int(what, "window", self.window))
        if kind is MaskKind.PACKED:
            if isinstance(self.lengths, (str, bytes)) or not isinstance(self.lengths, Sequence):
                raise ParallelStateTypeError(f"{what}: lengths must be a sequence of segment lengths (ints), "
                                             f"got {type(self.lengths).__name__} {self.lengths!r}")
            if len(self.lengths) == 0:
                raise ParallelStateValueError(f"{what}: lengths is empty; pass the length of every segment packed "
                                              f"into the sequence, e.g. packed([4680, 9360])")
            lengths = tuple(_positive_int(what, f"lengths[{i}]", n) for i, n in enumerate(self.lengths))
            object.__setattr__(self, "lengths", lengths)
        if kind is MaskKind.TOKEN_WINDOW:
            for name in ("left", "right"):
                value = getattr(self, name)
                if value is not None:
                    value = as_int(what, name, value)
                    if value < 0:
                        raise ParallelStateValueError(f"{what}: {name} must be >= 0 tokens or None (unbounded), got "
                                                      f"{value}")
                    object.__setattr__(self, name, value)
            if self.left is None and self.right in (None, 0):  # one value per mask: equality means the same mask
                same = "full()" if self.right is None else "causal()"
                raise ParallelStateValueError(f"{what}: left=None, right={self.right} is AttentionMask.{same}; "
                                              f"build windows with AttentionMask.token_window(left, right)")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def full(cls) -> AttentionMask:
        """Every query attends to every key."""
        return cls(MaskKind.FULL)

    @classmethod
    def causal(cls) -> AttentionMask:
        """Query i attends to keys j <= i."""
        return cls(MaskKind.CAUSAL)

    @classmethod
    def chunk_causal(cls, chunk: int) -> AttentionMask:
        """Query i attends to keys j with ``j // chunk <= i // chunk`` (its chunk and every earlier one)."""
        return cls(MaskKind.CHUNK_CAUSAL, chunk=chunk)

    @classmethod
    def sliding_window(cls, chunk: int, window: int) -> AttentionMask:
        """Chunk-causal over the ``window`` most recent chunks, its own included: ``c(i) - window < c(j) <= c(i)``."""
        return cls(MaskKind.SLIDING_WINDOW, chunk=chunk, window=window)

    @classmethod
    def packed(cls, lengths: Sequence[int], chunk: int | None = None) -> AttentionMask:
        """Segments of ``lengths`` tokens packed one after another, attention only inside a segment.

        Without ``chunk`` a query sees its whole segment; with it, chunk-causal inside the segment
        (chunks counted from the segment's start).
        """
        return cls(MaskKind.PACKED, chunk=chunk, lengths=lengths)  # type: ignore[arg-type]  (__post_init__ makes it a tuple)

    @classmethod
    def token_window(cls, left: int | None, right: int | None) -> AttentionMask:
        """Query i attends to keys ``i - left <= j <= i + right`` (None: no bound on that side).

        Transformer Engine's ``window_size=(left, right)`` with -1 written as None: ``token_window(w, 0)`` is
        its causal sliding window, ``token_window(None, 0)`` is ``causal()`` and ``token_window(None, None)`` ``full()``.
        """
        if left is None and right is None:
            return cls.full()
        if left is None and not isinstance(right, bool) and right == 0:
            return cls.causal()
        return cls(MaskKind.TOKEN_WINDOW, left=left, right=right)

    @classmethod
    def parse(cls, spec: str, frame_tokens: int | None = None) -> AttentionMask:
        """A mask from its text form (``str(mask)``): ``full``, ``causal``, ``chunk_causal:CHUNK``,
        ``sliding_window:CHUNK,WINDOW``, ``packed:L1+L2+...`` or ``packed:L1+L2+...,CHUNK``.

        ``token_window:LEFT,RIGHT`` (tokens; -1 is unbounded). A token count written with a trailing ``f``
        (``chunk_causal:3f``) is in frames and is multiplied by ``frame_tokens``. ParallelStateValueError
        naming the spec for anything else.
        """
        if not isinstance(spec, str):
            raise ParallelStateTypeError(f"AttentionMask.parse: spec must be a str, got {type(spec).__name__}")
        usage = ("use full, causal, chunk_causal:CHUNK, sliding_window:CHUNK,WINDOW, packed:L1+L2+..., "
                 "packed:L1+L2+...,CHUNK or token_window:LEFT,RIGHT (token counts, -1 unbounded for a window; a trailing f "
                 "means frames, e.g. chunk_causal:3f)")
        name, _, rest = spec.strip().partition(":")
        args = [a.strip() for a in rest.split(",")] if rest.strip() else []

        def tokens(text: str, frames_ok: bool = True) -> int:
            scale = 1
            if frames_ok and text.endswith("f"):
                if frame_tokens is None:
                    raise ParallelStateValueError(f"mask {spec!r}: {text!r} counts frames but the tokens per frame "
                                                  f"are not known here; give the count in tokens")
                text, scale = text[:-1], frame_tokens
            try:
                return int(text) * scale
            except ValueError:
                raise ParallelStateValueError(f"mask {spec!r}: {text!r} is not an integer; {usage}") from None

        kind = MaskKind(name) if name in KINDS else None
        if kind in (MaskKind.FULL, MaskKind.CAUSAL, MaskKind.CHUNK_CAUSAL, MaskKind.SLIDING_WINDOW):
            if len(args) != len(kind.fields):
                raise ParallelStateValueError(f"mask {spec!r}: {kind} takes {len(kind.fields)} value(s), got "
                                              f"{len(args)}; {usage}")
            if kind is MaskKind.SLIDING_WINDOW:
                return cls.sliding_window(tokens(args[0]), tokens(args[1], frames_ok=False))
            return cls(kind, *(tokens(a) for a in args))
        if kind is MaskKind.TOKEN_WINDOW and len(args) == 2:
            left, right = (None if a == "-1" else tokens(a) for a in args)
            return cls.token_window(left, right)
        if kind is MaskKind.PACKED and len(args) in (1, 2):
            lengths = [tokens(a.strip()) for a in args[0].split("+")]
            return cls.packed(lengths, tokens(args[1]) if len(args) == 2 else None)
        raise ParallelStateValueError(f"mask {spec!r}: {usage}")

    def __str__(self) -> str:
        """The text form ``parse`` reads back (token counts)."""
        if self.kind is MaskKind.CHUNK_CAUSAL:
            return f"chunk_causal:{self.chunk}"
        if self.kind is MaskKind.SLIDING_WINDOW:
            return f"sliding_window:{self.chunk},{self.window}"
        if self.kind is MaskKind.PACKED:
            segs = "+".join(map(str, self.lengths or ()))
            return f"packed:{segs}" + ("" if self.chunk is None else f",{self.chunk}")
        if self.kind is MaskKind.TOKEN_WINDOW:
            return f"token_window:{-1 if self.left is None else self.left},{-1 if self.right is None else self.right}"
        return self.kind.value

    # ------------------------------------------------------------------ properties

    @property
    def is_causal_like(self) -> bool:
        """Whether no query sees a key after its own chunk (every kind but full and packed without chunk)."""
        kind = self.kind
        return kind in (MaskKind.CAUSAL, MaskKind.CHUNK_CAUSAL, MaskKind.SLIDING_WINDOW) or (
            kind is MaskKind.PACKED and self.chunk is not None) or (kind is MaskKind.TOKEN_WINDOW and self.right == 0)

    def describe(self) -> str:
        """A short phrase for reports."""
        if self.kind is MaskKind.FULL:
            return "full attention"
        if self.kind is MaskKind.CAUSAL:
            return "token-causal"
        if self.kind is MaskKind.CHUNK_CAUSAL:
            return f"chunk-causal, chunks of {self.chunk} tokens"
        if self.kind is MaskKind.SLIDING_WINDOW:
            return f"sliding window of {self.window} chunks of {self.chunk} tokens"
        if self.kind is MaskKind.TOKEN_WINDOW:
            def side(n: int | None) -> str:
                return "every" if n is None else str(n)
            return f"window of {side(self.left)} earlier and {side(self.right)} later tokens"
        segs = len(self.lengths or ())
        inner = "full attention" if self.chunk is None else f"chunk-causal in chunks of {self.chunk} tokens"
        return f"{segs} packed segment{'s' * (segs != 1)}, {inner} inside each"

    # ------------------------------------------------------------------ checks

    def check_length(self, length: int) -> int:
        """``length`` as an int after checking it is >= 1 and, for packed masks, the segments' sum."""
        what = f"AttentionMask {self}"
        length = as_int(what, "length", length)
        if length < 1:
            raise ParallelStateValueError(f"{what}: length must be >= 1 (the sequence's token count), got {length}")
        if self.lengths is not None and sum(self.lengths) != length:
            raise ParallelStateValueError(
                f"{what}: the packed segments add up to {sum(self.lengths)} tokens but the sequence has {length}; "
                f"pass every segment's length so that they sum to the sequence length (pad with a segment if needed)")
        return length

    def segment_bounds(self, length: int) -> tuple[int, ...]:
        """Where segments start, and the end: ``(0, l0, l0 + l1, ..., length)``; ``(0, length)`` unless packed."""
        length = self.check_length(length)
        if self.lengths is None:
            return (0, length)
        bounds = [0]
        for n in self.lengths:
            bounds.append(bounds[-1] + n)
        return tuple(bounds)

    # ------------------------------------------------------------------ the primitive and what follows

    def _positions(self, method: str, name: str, positions: Any, length: int) -> torch.Tensor:
        """``positions`` as a 1-D int64 tensor after checking its type and that it lies in ``[0, length)``."""
        import torch

        what = f"AttentionMask {self}.{method}"
        p = positions if isinstance(positions, torch.Tensor) else torch.as_tensor(positions, dtype=torch.int64)
        if p.dim() != 1 or p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
            raise ParallelStateTypeError(f"{what}: {name} must be a 1-D integer tensor, got {p.dim()}-D {p.dtype}")
        p = p.to(torch.int64)
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= length):
            raise ParallelStateValueError(f"{what}: {name} must lie in [0, {length}), got values from "
                                          f"{int(p.min())} to {int(p.max())}")
        return p

    def key_range(self, positions: Any, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For 1-D int64 query ``positions``: ``(lo, hi)``, query ``positions[i]`` may attend keys ``lo[i] <= j < hi[i]``.

        Positions must lie in ``[0, length)``; the results are int64 tensors of the same shape and device.
        """
        import torch

        length = self.check_length(length)
        p = self._positions("key_range", "positions", positions, length)
        if self.kind is MaskKind.FULL:
            return torch.zeros_like(p), torch.full_like(p, length)
        if self.kind is MaskKind.CAUSAL:
            return torch.zeros_like(p), p + 1
        if self.kind is MaskKind.TOKEN_WINDOW:
            lo = torch.zeros_like(p) if self.left is None else torch.clamp(p - self.left, min=0)
            hi = torch.full_like(p, length) if self.right is None else torch.clamp(p + self.right + 1, max=length)
            return lo, hi
        if self.kind is MaskKind.PACKED:
            bounds = torch.tensor(self.segment_bounds(length), dtype=torch.int64, device=p.device)
            seg = torch.searchsorted(bounds[1:], p, right=True)
            start, end = bounds[seg], bounds[seg + 1]
            if self.chunk is None:
                return start, end
            hi = torch.minimum(end, start + ((p - start) // self.chunk + 1) * self.chunk)
            return start, hi
        chunk = self.chunk
        assert chunk is not None
        c = p // chunk
        hi = torch.clamp((c + 1) * chunk, max=length)
        if self.kind is MaskKind.CHUNK_CAUSAL:
            return torch.zeros_like(p), hi
        assert self.window is not None
        return torch.clamp((c - self.window + 1) * chunk, min=0), hi

    def allowed(self, q_positions: Any, k_positions: Any, length: int) -> torch.Tensor:
        """Bool ``[len(q), len(k)]``: True where query ``q_positions[a]`` may attend key ``k_positions[b]``."""
        lo, hi = self.key_range(q_positions, length)
        k = self._positions("allowed", "k_positions", k_positions, length)
        return (lo[:, None] <= k[None, :]) & (k[None, :] < hi[:, None])

    def dense(self, length: int) -> torch.Tensor:
        """The bool ``[length, length]`` matrix (True where query i may attend key j); for small lengths and tests."""
        import torch

        pos = torch.arange(self.check_length(length), dtype=torch.int64)
        return self.allowed(pos, pos, length)

    def widths(self, length: int) -> torch.Tensor:
        """int64 ``[length]``: how many keys each query may attend (``hi - lo`` of every position)."""
        import torch

        length = self.check_length(length)
        if self.kind is not MaskKind.PACKED:
            lo, hi = self.key_range(torch.arange(length, dtype=torch.int64), length)
            return hi - lo
        # Segment by segment, as the unpacked kind of each: no per-position segment lookup.
        inner = AttentionMask.full() if self.chunk is None else AttentionMask.chunk_causal(self.chunk)
        return torch.cat([inner.widths(n) for n in self.lengths or ()])

    def work(self, length: int) -> int:
        """Allowed (query, key) pairs of the whole sequence: the attention's work in pairs."""
        return int(self.widths(length).sum())


__all__ = ["KINDS", "AttentionMask", "MaskKind"]
