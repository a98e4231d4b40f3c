# The engine's exceptions, defined once here (engine.watch and engine.__init__ re-export them).

class EngineError(RuntimeError):
    """A communication failed inside a transport (MPI or shared memory) or the engine's own schedule."""


class EngineTimeout(EngineError):
    """An operation did not complete within the group's timeout; the group is unusable after it."""


class EngineMismatch(EngineError):
    """Ranks called different collectives (or with different arguments) at the same point."""


class EnginePeerLost(EngineError):
    """A peer process of the group exited while this rank waited for it."""


class EngineAborted(EngineError):
    """The group was aborted (abort() from any thread) while, or before, this call waited."""


class NotContiguousError(ValueError):
    """A torch tensor argument is not contiguous (callers with a fallback catch exactly this)."""


class NotDivisibleError(ValueError):
    """An even split's buffer has a count the group size doesn't divide, found before anything moved
    (callers with a fallback that names the fix in their own API's terms catch exactly this)."""
