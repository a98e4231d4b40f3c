"""Free ports for the tests' stores and launchers: the engine's own choice (torchbridge.launch.free_ports),
below the kernel's ephemeral range, where one free when chosen stays free until the job binds it."""

from torchbridge.launch import free_port, free_ports  # noqa: F401
