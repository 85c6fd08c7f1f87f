"""Pipeline parallelism over the `stage` mesh axis: schedules as tables (schedules.py), one
executor for all of them (executor.py), the step's pipelined loss and gradients (runner.py) and
which layers sit where (layout.py)."""
from meshlab.parallel.pipeline.executor import StageFns
from meshlab.parallel.pipeline.layout import (LayoutError, chunk_order, check_layers, order_for, reorder, reorder_placed,
                                              stage_map, stored_order)
from meshlab.parallel.pipeline.schedules import SCHEDULES, Schedule, ScheduleError, bubble, build, theory_bubble

__all__ = ["StageFns", "LayoutError", "chunk_order", "check_layers", "order_for", "reorder", "reorder_placed",
           "stage_map", "stored_order", "SCHEDULES", "Schedule",
           "ScheduleError", "bubble", "build", "theory_bubble"]
