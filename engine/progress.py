"""A background thread per process group that runs its operations in issue order (Horovod's pattern:
calls only enqueue, and a caller that waits at once runs the operation itself); pyx/progress.pyx says how.
"""

from ._progress import DONE, PENDING, RUNNING, Progress, Task, ran, was_run

__all__ = ["DONE", "PENDING", "Progress", "RUNNING", "Task", "ran", "was_run"]
