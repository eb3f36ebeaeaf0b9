"""Process-group collections: megatron-core's ``ProcessGroupCollection`` filled with this project's groups.

Newer megatron-core model code takes its groups as one object (``pg_collection=``) rather than
reading ``parallel_state``'s globals. :func:`process_group_collection` fills megatron-core's own
``ProcessGroupCollection`` (every field its ``use_mpu_process_groups`` fills, in the installed
release) with the live groups, or, without megatron-core, this module's plain
:class:`ProcessGroupCollection` with the same field names (the union of releases 0.16 to 0.19).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from parallel_state.errors import ParallelStateTypeError, ParallelStateValueError
from parallel_state.megatron.answers import ANSWERS, lookup
from parallel_state.topology import kinds
from parallel_state.topology.answer_keys import AnswerKey

#: Field -> the answer holding its group, in megatron-core 0.19's field order (0.16-0.18 have a subset):
#: every field is a kind's (``hcp``: the hierarchical levels' family), from its row's ``field``. The
#: data-parallel fields hold the replicate groups, the ``*_gtp_remat`` ones the groups spanning
#: gtp_remat, as megatron-core 0.19's ``use_mpu_process_groups`` fills them.
FIELDS: dict[str, AnswerKey] = {r.field.name: r.answer for r in kinds.FIELDS if r.field is not None}
#: Fields that hold None where the group does not exist on this rank (megatron-core reads them with
#: check_initialized=False, or fills None): those of kinds a plan or a rank may lack.
OPTIONAL = frozenset(r.field.name for r in kinds.FIELDS if r.field is not None and r.optional)


@dataclass
class ProcessGroupCollection:
    """megatron-core's ``ProcessGroupCollection`` fields, for code that runs without megatron-core.

    Every field holds a ``torch.distributed.ProcessGroup`` (``hcp``: a list of them) or None: one
    field per kind row's collection field (:data:`FIELDS`), in megatron-core 0.19's order. Fill it from
    the live topology with :meth:`use_mpu_process_groups` or :func:`parallel_state.process_group_collection`.
    """

    # <generated: pg-collection> by `python -m parallel_state.tools.generate` from the kind rows
    tp: Any = None
    pp: Any = None
    mp: Any = None
    embd: Any = None
    pos_embd: Any = None
    cp: Any = None
    tp_cp: Any = None
    hcp: Any = None
    ep: Any = None
    expt_tp: Any = None
    tp_ep: Any = None
    tp_ep_pp: Any = None
    tp_ep_pp_with_egtp_remat: Any = None
    tp_dp_cp: Any = None
    dp: Any = None
    dp_cp: Any = None
    dp_cp_gtp_remat: Any = None
    dp_cp_ag: Any = None
    gtp_remat: Any = None
    expt_gtp_remat: Any = None
    expt_dp: Any = None
    expt_dp_gtp_remat: Any = None
    expt_dp_ag: Any = None
    intra_dp_cp: Any = None
    intra_expt_dp: Any = None
    inter_dist_opt: Any = None
    intra_dist_opt: Any = None
    # </generated: pg-collection>

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: Sequence[str] | None = None) -> ProcessGroupCollection:
        """The live topology's groups (only ``required_pgs``, if given), as megatron-core's classmethod."""
        return process_group_collection(required_pgs, megatron=False)

    def __repr__(self) -> str:
        sizes = [f"{f.name}({[g.size() for g in v] if isinstance(v, list) else v.size()})"
                 for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None]
        return f"ProcessGroupCollection({', '.join(sizes) or 'empty'})"


def process_group_collection(required_pgs: Sequence[str] | None = None, *, all_gather: bool = False,
                             megatron: bool | None = None) -> Any:
    """The live topology's groups (and those written to megatron-core's globals on ``parallel_state``) as a
    process-group collection for model code's ``pg_collection=``.

    ``megatron`` None: megatron-core's own ``ProcessGroupCollection`` when megatron-core is installed
    (its fields for the installed release; megatron-core is imported and bridged), else this module's
    plain one; True or False chooses. ``required_pgs`` limits the fields filled, as in
    megatron-core's ``use_mpu_process_groups``. ``all_gather=True`` first creates the separate
    all-gather groups (``create_all_gather_groups``, expert ones with expert parallelism; every rank
    of the topology must then call it alike) so that ``dp_cp_ag`` / ``expt_dp_ag`` are filled; without
    it they hold the all-gather groups only if they exist.
    """
    from parallel_state.groups import state as _st
    from parallel_state.topology import arguments as a
    from parallel_state.topology import releases

    use_megatron = releases.installed() is not None if megatron is None else a.flag("megatron", megatron)
    if use_megatron:
        from parallel_state.megatron.bridge import bridge_megatron, import_megatron

        import_megatron()  # a clear ImportError without megatron-core
        from megatron.core.process_groups_config import ProcessGroupCollection as cls
    else:
        cls = ProcessGroupCollection
    names = [f.name for f in dataclasses.fields(cls)]
    if required_pgs is None:
        wanted = names
    else:
        if isinstance(required_pgs, (str, bytes)) or not isinstance(required_pgs, Sequence):
            raise ParallelStateTypeError(f"required_pgs must be a list of field names or None, got {required_pgs!r}")
        wanted = list(required_pgs)
        invalid = [n for n in wanted if n not in names]
        if invalid:
            raise ParallelStateValueError(f"Invalid process groups requested: {invalid}; the fields are {names}")
    if a.flag("all_gather", all_gather):
        from parallel_state.megatron.initialize import create_all_gather_groups

        create_all_gather_groups(for_expert_parallelism=_st.current("process_group_collection(all_gather=True)").plan.ep > 1)
    elif _st.peek() is None and not _st.written:
        _st.current("process_group_collection()")  # raises, saying what to call first
    if use_megatron:
        bridge_megatron()
    values = {n: ANSWERS.get(FIELDS[n]) if n in OPTIONAL else lookup(FIELDS[n]) for n in wanted if n in FIELDS}
    return cls(**values)
