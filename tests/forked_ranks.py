"""ForkedRanks: torch's own multi-process harness (MultiProcessTestCase) with its ranks forked, not
spawned (a spawned rank spends most of its time importing torch again), and the FileStore's file
removed at the end, with any store a test made beside it (`self.file_name + ".anything"`), and any rank
still alive then killed. A test class takes it before MultiProcessTestCase and sets `world_size`."""

import glob
import os

import torch.multiprocessing


class ForkedRanks:
    world_size = 3

    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    def tearDown(self):
        processes = list(getattr(self, "processes", []))
        super().tearDown()   # (SIGTERM to every rank)
        # A rank stuck where the handler of that signal never runs (C code that never returns, as OpenMP's
        # barrier in a forked rank) would keep pytest from exiting at the end of the run: killed here.
        for process in processes:
            process.join(2)
            if process.is_alive():
                process.kill()
                process.join(10)
        for path in [self.file_name] + glob.glob(glob.escape(self.file_name) + ".*"):
            try:
                os.remove(path)
            except OSError:
                pass
