"""ForkedRanks: torch's own multi-process harness (MultiProcessTestCase) with its ranks forked, not
spawned (a spawned rank spends most of its time importing torch again), and the FileStore's file
removed at the end, with any store a test made beside it (`self.file_name + ".anything"`). A test
class takes it before MultiProcessTestCase and sets `world_size`."""

import glob
import os

import torch.multiprocessing


class ForkedRanks:
    world_size = 3

    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    def tearDown(self):
        super().tearDown()
        for path in [self.file_name] + glob.glob(glob.escape(self.file_name) + ".*"):
            try:
                os.remove(path)
            except OSError:
                pass
