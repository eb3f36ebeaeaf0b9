"""The keys of the accessors' answers: a kind and a fact about it, both from a closed set.

An accessor's answer (``megatron.answers.ANSWERS``) is keyed by an :data:`AnswerKey`, the
string ``"<kind>.<fact>"`` (``"tp.rank"``, ``"dp-cp.group"``), so that a lookup is one dict read
of a plain string. A key is made only by :func:`key` from a kind's name and a :class:`Fact`
(readers write ``TP.key(Fact.RANK)``, ``Kind.key``): a misspelt kind or fact is an error where
the reader is imported, never an absent key at run time. :func:`parts` gives a key's kind and
fact back without parsing it.
"""

from __future__ import annotations

from typing import NewType

from parallel_state.topology.str_enum import StrEnum

#: An answer's key, made by :func:`key` (a plain ``str`` at run time, so a lookup costs one dict read).
AnswerKey = NewType("AnswerKey", str)


class Fact(StrEnum):
    """What an answer says about its kind."""

    #: This rank's group of the kind (megatron-core's global), its gloo twin, a family's groups.
    GROUP = "group"
    GLOO = "gloo"
    GROUPS = "groups"
    #: This rank's index in its group, the group's size, its global ranks, the first of them.
    RANK = "rank"
    SIZE = "size"
    RANKS = "ranks"
    SRC = "src"
    #: Whether this rank is in a group of a kind that may leave it out (the embedding kinds).
    IN = "in"
    #: Whether the kind was built (the separate all-gather group).
    EXISTS = "exists"
    #: The pipeline's: whether this is the first or last stage; the first, last, next, previous stage's rank.
    IS_FIRST = "is_first"
    IS_LAST = "is_last"
    FIRST = "first"
    LAST = "last"
    NEXT = "next"
    PREV = "prev"
    #: Of no kind: whether the groups exist, and megatron-core's get_all_ranks string.
    INITIALIZED = "initialized"
    ALL_RANKS = "all_ranks"


#: (kind, fact) -> its key, and back: each key is made once, so a lookup finds the very same string.
_KEYS: dict[tuple[str, Fact], AnswerKey] = {}
_PARTS: dict[str, tuple[str, Fact]] = {}


def key(kind: str, fact: Fact) -> AnswerKey:
    """The key of ``fact`` about the kind named ``kind`` ("" for the facts of no kind)."""
    made = _KEYS.get((kind, fact))
    if made is not None:
        return made
    if not isinstance(fact, Fact):
        raise TypeError(f"an answer's fact is a Fact (Fact.RANK, ...), got {fact!r}")
    if not isinstance(kind, str):
        raise TypeError(f"an answer's kind is a kind's name (Kind.name), got {kind!r}")
    made = AnswerKey(f"{kind}.{fact.value}" if kind else fact.value)
    _KEYS[(kind, fact)] = made
    _PARTS[made] = (kind, fact)
    return made


def parts(answer: str) -> tuple[str, Fact] | None:
    """The kind's name and the fact of a key made by :func:`key` (None for any other string)."""
    return _PARTS.get(answer)


#: The virtual pipeline's answers: megatron-core's interleaving, which is no group kind.
VIRTUAL_PIPELINE = "vpp"
VPP_SIZE = key(VIRTUAL_PIPELINE, Fact.SIZE)
VPP_RANK = key(VIRTUAL_PIPELINE, Fact.RANK)
#: The answers of no kind.
INITIALIZED = key("", Fact.INITIALIZED)
ALL_RANKS = key("", Fact.ALL_RANKS)
