"""Pipeline-parallel point-to-point scheduler (MAGI-1's ``PPScheduler``) on parallel_state's groups.

Importing this package registers its dist_init and teardown hooks with parallel_state, which
never imports it: ``dist_init`` then creates the scheduler when ``pp_size > 1`` and
``destroy_model_parallel`` drops it.
"""

from scheduler.pipeline import PPScheduler, init_pp_scheduler, pp_scheduler  # noqa: F401
from scheduler.sends import SendHandle  # noqa: F401
