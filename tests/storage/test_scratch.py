"""scratch: one growing buffer per thread, its start handed out by `take`."""

from __future__ import annotations

import copy
import pickle
import threading

import torch

from wna16_loader.storage.scratch import Scratch


def test_a_take_that_fits_reuses_the_buffer_and_a_larger_one_grows_it() -> None:
    scratch = Scratch()
    first = scratch.take((4, 8), torch.int32)
    first.fill_(7)
    second = scratch.take((2, 3), torch.float16)
    assert first.shape == (4, 8) and first.dtype == torch.int32 and first.is_contiguous()
    assert second.shape == (2, 3) and second.dtype == torch.float16
    assert second.data_ptr() == first.data_ptr() and scratch.nbytes == 4 * 8 * 4  # the same memory: no new pages
    grown = scratch.take((5, 8), torch.int32)
    assert scratch.nbytes == 5 * 8 * 4 and grown.data_ptr() != first.data_ptr()
    assert bool((first == 7).all())  # the old buffer lives on while a tensor holds it


def test_each_thread_takes_from_its_own_buffer_and_release_frees_only_the_callers() -> None:
    scratch = Scratch()
    mine = scratch.take((16,), torch.int64)
    theirs: list[tuple[int, int]] = []

    def other() -> None:
        taken = scratch.take((16,), torch.int64)
        theirs.append((taken.data_ptr(), scratch.nbytes))
        scratch.release()
        theirs.append((0, scratch.nbytes))

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert theirs[0][0] != mine.data_ptr() and theirs[0][1] == 128 and theirs[1][1] == 0
    assert scratch.nbytes == 128  # this thread's buffer is kept
    scratch.release()
    assert scratch.nbytes == 0 and scratch.take((0,), torch.int32).numel() == 0


def test_a_copy_or_pickle_is_a_new_empty_scratch() -> None:
    """An engine module holding a Scratch can be deep-copied or pickled: the copy starts empty and works."""
    scratch = Scratch()
    scratch.take((8,), torch.int32).fill_(3)
    for other in (copy.deepcopy(scratch), pickle.loads(pickle.dumps(scratch))):
        assert isinstance(other, Scratch) and other.nbytes == 0
        assert other.take((2, 2), torch.int32).shape == (2, 2) and other.nbytes == 16
    assert scratch.nbytes == 32
