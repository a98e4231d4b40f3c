#!/bin/sh
# Runs a command with a /dev/shm of its own: a fresh tmpfs mounted there in a mount namespace of its own
# (root, or a user namespace's root). `make test` runs its two streams of suites side by side, each
# through this: the tests that check what their jobs left in /dev/shm (MPI's and torch's files; the
# engine's segments are memfds, which have no name there) see their own jobs' files only.
# `tests/own_shm.sh --probe` exits 0 where this works.
if [ "$1" = "--probe" ]; then
    exec "$0" true 2>/dev/null
fi
exec unshare --mount --propagation private sh -c 'mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm && exec "$@"' own-shm "$@"
