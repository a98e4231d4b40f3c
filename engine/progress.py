"""A background thread per process group that runs its operations in issue order.

Callers submit an operation and get a Task back at once (Horovod's pattern: user-facing calls only
enqueue). A caller that waits on a task which has not started yet, is first in line and has nothing
running ahead of it runs the task itself instead of sleeping while the thread does: the thread leaves
a new task a short grace (50 us) before it takes it. A caller that will wait at once anyway (torch's
async_op=False) uses run(), which runs the operation in place when nothing is queued, without waking
the thread, taking a lock or allocating. Order is kept either way: only the head of the queue runs, and
never two at once.

Compiled (pyx/progress.pyx): every synchronous collective passes through run(), and its state changes
are atomic under the GIL only when no Python code runs between the check and the update.
"""

from ._progress import DONE, PENDING, RUNNING, Progress, Task

__all__ = ["DONE", "PENDING", "Progress", "RUNNING", "Task"]
