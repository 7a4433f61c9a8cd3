"""The memory an OpenVINO replica process shares its hidden states through
(pipeline.model.engine_process.SharedStates): the child grows it as passes need, the
worker maps it again and reads what the child wrote, and an array of the old map stays
valid while it is in use."""

from __future__ import annotations

import os

import numpy as np

from pipeline.model.engine_process import SharedStates, _shared_file


def test_the_worker_reads_what_the_child_wrote_as_the_file_grows() -> None:
    fd = _shared_file("test-states")
    child, worker = SharedStates(fd), SharedStates(os.dup(fd))
    try:
        small = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
        np.copyto(child.fit(small.shape), small)
        seen = worker.view(small.shape, child.size)
        assert np.array_equal(seen, small)
        first_size = child.size

        large = np.random.default_rng(0).random((8, 512, 384), dtype=np.float32)  # 6 MiB
        np.copyto(child.fit(large.shape), large)
        assert child.size > first_size and child.size >= large.nbytes
        assert np.array_equal(worker.view(large.shape, child.size), large)
        # The array of the first map is still readable (a pass's pooling in flight).
        assert seen.shape == (2, 3, 4) and np.isfinite(seen).all()
    finally:
        child.close()
        worker.close()
