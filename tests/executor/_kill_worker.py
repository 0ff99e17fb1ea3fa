"""``python -m tests.executor._kill_worker ARGS``: ``soapsearch.run`` whose rank 1 dies (exit 1,
no goodbye) at its first forward step, to check that the others fail fast and say why."""

import os
import sys

from soapsearch import run
from soapsearch.executor import runtime

if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        runtime.Executor._forward = lambda self, p: os._exit(1)
    sys.exit(run.main(sys.argv[1:]))
