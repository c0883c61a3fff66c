"""The memory reads land in: size classes, the pool, huge-page advised buffers."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wna16_loader.storage.buffers import ALIGN, HUGE_PAGE, BufferPool, host_tensor, huge_paged, size_class

HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE") and Path("/sys/kernel/mm/transparent_hugepage").exists()  # (the kernel's)


@given(st.integers(1, 1 << 40))
def test_a_size_class_rounds_up_by_less_than_an_eighth_to_whole_pages(nbytes: int) -> None:
    size = size_class(nbytes)
    assert nbytes <= size and size % ALIGN == 0
    assert size - nbytes < max(ALIGN, nbytes // 8 + 1)
    assert size_class(size) == size  # a class is its own class
    if nbytes > 16 << 20:
        assert size % HUGE_PAGE == 0


@given(st.integers(1, 1 << 32), st.integers(1, 1 << 32))
def test_size_classes_keep_the_order_of_sizes(a: int, b: int) -> None:
    assert (size_class(a) <= size_class(b)) if a <= b else (size_class(a) >= size_class(b))


def test_sizes_of_one_layer_in_two_files_share_a_class() -> None:
    """Two layers' runs of a TP 8 rank of a Qwen3-30B-A3B-shaped GPTQ checkpoint (bytes, as planned): 4 KiB apart,
    one buffer serves either."""
    assert size_class(1_691_648) == size_class(1_695_744) == 1_703_936


def test_buffers_are_aligned_reused_and_counted() -> None:
    pool = BufferPool(pin=False)
    first = pool.take(3 * ALIGN)
    assert first.data_ptr() % ALIGN == 0 and len(first) == 3 * ALIGN and pool.allocated == 3 * ALIGN
    pool.release(first)
    assert pool.take(2 * ALIGN).data_ptr() == first.data_ptr()  # the smallest free one that fits
    second = pool.take(ALIGN)
    assert second.data_ptr() != first.data_ptr() and pool.allocated == 4 * ALIGN


def test_a_huge_paged_buffer_outlives_its_mapping_object_and_asks_for_huge_pages() -> None:
    buffer = huge_paged(2 * HUGE_PAGE)
    gc.collect()
    buffer[::4096] = 7  # (every page touched, after the mmap object's last Python name is gone)
    assert buffer.data_ptr() % ALIGN == 0 and int(buffer.sum()) == 7 * (2 * HUGE_PAGE // 4096)
    if not HUGE_PAGES:
        pytest.skip("no transparent huge pages in this kernel: the buffer has 4 KiB pages")
    assert "hg" in _vm_flags(buffer.data_ptr())  # MADV_HUGEPAGE (whether the kernel finds huge pages is its call)


@pytest.mark.parametrize("shape,dtype", [((3, HUGE_PAGE // 8 + 5), torch.float16), ((HUGE_PAGE // 4 - 1,), torch.int32),
                                         ((16, 48, 1024), torch.int32)])
def test_a_host_tensor_is_an_ordinary_tensor_in_huge_page_advised_memory_from_2_mib(shape, dtype) -> None:
    tensor = host_tensor(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous() and tensor.device.type == "cpu"
    tensor.copy_(torch.arange(tensor.numel()).reshape(shape).to(dtype))  # writable, every element its own
    assert torch.equal(tensor.flatten()[-3:], torch.arange(tensor.numel())[-3:].to(dtype))
    if HUGE_PAGES:
        huge = tensor.numel() * tensor.element_size() >= HUGE_PAGE
        assert ("hg" in _vm_flags(tensor.data_ptr())) == huge


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_pinned_pool_takes_page_locked_memory() -> None:
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs a GPU runtime")
    buffer = BufferPool(pin=True).take(5 * ALIGN)
    assert buffer.is_pinned() and buffer.data_ptr() % ALIGN == 0 and len(buffer) == 5 * ALIGN
