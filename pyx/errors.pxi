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


# What left a group unusable, by the error that did, in the words its refusals use ("allreduce: this
# group is unusable after a peer was lost (...)"): the core's own failures and the watch's share them,
# and the adapter maps them to torch's ErrorType. A corrupt frame is an EngineError.
BROKEN_AFTER = {EngineTimeout: "an earlier call timed out", EnginePeerLost: "a peer was lost",
                EngineMismatch: "a collective mismatch", EngineError: "a corrupt frame"}


class NotContiguousError(ValueError):
    """A torch tensor argument is not contiguous (callers with a fallback catch exactly this)."""


class NotDenseError(TypeError):
    """A torch tensor argument is sparse (or of another layout that is no dense buffer): callers that
    have a form for it (the adapter's sparse all_reduce) catch exactly this."""


class NotDivisibleError(ValueError):
    """An even split's buffer has a count the group size doesn't divide, found before anything moved
    (callers with a fallback that names the fix in their own API's terms catch exactly this)."""
