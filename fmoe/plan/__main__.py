"""``python -m fmoe.plan``: per-rank memory and traffic of a training job, before running it.

The sharding :class:`fmoe.plan.Plan` lives in this package; the memory estimate lives in
:mod:`fmoe.memory_plan`, which this entry point runs.

Example:
    python -m fmoe.plan --model qwen3_moe --preset small --nproc 4 --ep 4 --batch 4 --seq 256 --dtype bf16
"""

import sys

from ..memory_plan import main

if __name__ == "__main__":
    sys.exit(main())
