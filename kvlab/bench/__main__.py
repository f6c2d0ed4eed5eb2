"""`python -m kvlab.bench`: see `kvlab.bench.cli`.

Before anything is timed, the run makes sure OpenMP's idle threads *sleep* while they wait
(OMP_WAIT_POLICY=PASSIVE) instead of spinning. On a CPU shared with other busy programs a thread
that reaches a barrier first spins until its partner is scheduled again, and a CPU-time clock (the
CPU default, `--clock cpu`) counts those spins as work: a 30 µs attention call measured 5-8 ms that
way on two cores shared by eight sessions. The policy is read when torch loads OpenMP, so the run
restarts itself once with it set; an OMP_WAIT_POLICY already in the environment is kept. Both
sides of every comparison run in the one process, under the same policy.
"""

import os
import sys

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.execv(sys.executable, [sys.executable, "-m", "kvlab.bench", *sys.argv[1:]])

from .cli import main  # noqa: E402  (after the restart above)

main()
