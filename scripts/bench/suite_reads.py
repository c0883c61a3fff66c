"""Suite reads, per GiB of a rank's share: ways to read the column slice of K-major qweight words [K/8, N] that a TP rank
of a GPTQ checkpoint needs, out of the page cache, transposed into [N/tp, K/8] (what the fused writer does).

A column slice of row-major words has a few hundred bytes of every row, so as a view of the file mapping it
faults in every page of the tensor (tp x its bytes). The contenders, on the gate and up qweights of the
first file of suite small's `--size full` GPTQ checkpoint (one thread, CPU seconds, best of --reps):

| mapping view        | the loader's way: a transposing copy straight from a fresh mapping               |
| preadv covering     | one preadv of the range from the slice's first to its last byte into a reused     |
|                     | buffer, then a transposing copy of the slice from there                           |
| preadv per row      | one preadv per row segment into a reused [K/8, N/tp] buffer, then the copy        |
| preadv skipping     | one preadv per tensor, the row segments into a reused buffer and the bytes between |
|                     | into one small scratch buffer (the kernel still copies them), then the copy       |
| memory only         | the transposing copy from a buffer already in memory (no file: the copy's own cost) |

each into fresh output memory (first touch, as a load's fused parameters) and into output already mapped;
also the fresh output under MADV_HUGEPAGE, and the raw cost per GiB of faulting in a mapping and of pread.
Usage: python scripts/bench --suite reads [--workdir /tmp/wna16-bench] [--tp 4] [--reps 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from wna16_loader.load.copies import copy_transposing

from .suite_small import build_checkpoint

MADV_HUGEPAGE = 14  # Linux
HUGE = 2 << 20


class Case:
    """The gate and up qweights of one file: file byte of each, [K/8, N] words, and one rank's columns."""

    def __init__(self, path: Path, tp: int, rank: int) -> None:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        names = sorted((k for k in header if k.endswith(("gate_proj.qweight", "up_proj.qweight"))),
                       key=lambda k: header[k]["data_offsets"][0])
        self.path, (self.rows, self.n) = path, header[names[0]]["shape"]
        self.begins = [8 + length + header[k]["data_offsets"][0] for k in names]
        self.width = self.n // tp
        self.first = rank * self.width  # first column of the rank
        self.share = len(names) * self.rows * self.width * 4  # bytes

    def out(self, fresh: bool, kept: torch.Tensor, huge: bool = False) -> torch.Tensor:
        """[E, N/tp, K/8] int32: fresh memory (under MADV_HUGEPAGE with `huge`), or `kept` (already mapped)."""
        shape = (len(self.begins), self.width, self.rows)
        if not fresh:
            return kept
        if not huge:
            return torch.empty(shape, dtype=torch.int32)
        raw = torch.empty(self.share + HUGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % HUGE
        ctypes.CDLL(None).madvise(ctypes.c_void_p(raw.data_ptr() + skip), ctypes.c_size_t(self.share), MADV_HUGEPAGE)
        return raw[skip:skip + self.share].view(torch.int32).view(shape)


def via_mapping(case: Case, out: torch.Tensor) -> None:
    """A transposing copy of every slice straight from a fresh mapping (closed after)."""
    with open(case.path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(mapped, dtype=torch.uint8)
    for i, begin in enumerate(case.begins):
        words = flat[begin:begin + case.rows * case.n * 4].view(torch.int32).view(case.rows, case.n)
        copy_transposing(out[i], words[:, case.first:case.first + case.width].t())
    del flat, words
    mapped.close()


def via_covering(case: Case, out: torch.Tensor) -> None:
    """One preadv per tensor of the range its slice spans, into a reused buffer; then the transposing copy."""
    span = (case.rows - 1) * case.n + case.width  # words from the slice's first to its last
    buffer = torch.empty(span, dtype=torch.int32)
    view = memoryview(buffer.numpy()).cast("B")
    rows = buffer.as_strided((case.rows, case.width), (case.n, 1))
    with open(case.path, "rb", buffering=0) as handle:
        for i, begin in enumerate(case.begins):
            os.preadv(handle.fileno(), [view], begin + 4 * case.first)
            copy_transposing(out[i], rows.t())


def via_rows(case: Case, out: torch.Tensor, skip_gaps: bool = False) -> None:
    """The row segments of each slice by preadv into a reused [K/8, N/tp] buffer, one call per row (or, with
    `skip_gaps`, one call per tensor with the bytes between segments read into a scratch buffer); then the copy."""
    rows = torch.empty((case.rows, case.width), dtype=torch.int32)
    view, run, stride = memoryview(rows.numpy()).cast("B"), 4 * case.width, 4 * case.n
    segments = [view[r * run:(r + 1) * run] for r in range(case.rows)]
    gap = memoryview(bytearray(stride - run))
    buffers = [gap] * (2 * case.rows - 1)
    buffers[0::2] = segments
    with open(case.path, "rb", buffering=0) as handle:
        for i, begin in enumerate(case.begins):
            first = begin + 4 * case.first
            if skip_gaps:
                os.preadv(handle.fileno(), buffers, first)
            else:
                for r, segment in enumerate(segments):
                    os.preadv(handle.fileno(), [segment], first + r * stride)
            copy_transposing(out[i], rows.t())


def memory_only(case: Case, out: torch.Tensor) -> None:
    """The transposing copy alone, from one slice already in memory."""
    rows = torch.ones((case.rows, case.width), dtype=torch.int32)
    for i in range(len(case.begins)):
        copy_transposing(out[i], rows.t())


def best_rate(fn: Callable[[], None], nbytes: int, reps: int) -> float:
    """Best CPU seconds per GiB of `nbytes` over `reps` calls."""
    best = float("inf")
    for _ in range(reps):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best / (nbytes / 2**30)


def contenders(case: Case, reps: int) -> dict[str, dict[str, float]]:
    """label -> {'fresh': s/GiB, 'mapped': s/GiB (, 'huge': s/GiB)} of every way, checked equal to the mapping's."""
    kept = case.out(True, torch.empty(0))
    via_mapping(case, kept)
    ways = {"mapping view": via_mapping, "preadv covering": via_covering, "preadv per row": via_rows,
            "preadv skipping": lambda c, o: via_rows(c, o, skip_gaps=True)}
    rates: dict[str, dict[str, float]] = {}
    for label, fn in ways.items():
        check = case.out(True, kept)
        fn(case, check)
        assert torch.equal(check, kept), label
        rates[label] = {"fresh": best_rate(lambda: fn(case, case.out(True, kept)), case.share, reps),
                        "mapped": best_rate(lambda: fn(case, kept), case.share, reps)}
    rates["mapping view"]["huge"] = best_rate(lambda: via_mapping(case, case.out(True, kept, huge=True)),
                                              case.share, reps)
    rates["memory only"] = {"fresh": best_rate(lambda: memory_only(case, case.out(True, kept)), case.share, reps),
                            "mapped": best_rate(lambda: memory_only(case, kept), case.share, reps)}
    return rates


def raw_rates(path: Path, reps: int) -> dict[str, float]:
    """s/GiB of faulting in a fresh mapping of `path` (one byte a page, then unmapped) and of one pread of it."""
    size = path.stat().st_size
    buffer = bytearray(size)

    def fault() -> None:
        with open(path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(mapped, dtype=torch.uint8)
        flat[::mmap.PAGESIZE].sum()
        del flat
        mapped.close()

    def pread() -> None:
        with open(path, "rb", buffering=0) as handle:
            os.preadv(handle.fileno(), [buffer], 0)
    return {"fault in a mapping (per GiB mapped)": best_rate(fault, size, reps),
            "pread (per GiB read)": best_rate(pread, size, reps)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="scripts/bench --suite reads", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "wna16-bench")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder = build_checkpoint(args.workdir, "gptq", "full")
    path = sorted(folder.glob("*.safetensors"))[0]
    case = Case(path, args.tp, 1 if args.tp > 1 else 0)
    print(f"{path.name}: {len(case.begins)} gate/up qweights [{case.rows}, {case.n}], TP {args.tp} rank share "
          f"{case.share / 2**20:.1f} MiB; CPU s per GiB of share, one thread, best of {args.reps}")
    print("| way | fresh output | output already mapped | fresh, MADV_HUGEPAGE |\n|---|---|---|---|")
    for label, rate in contenders(case, args.reps).items():
        print(f"| {label} | {rate['fresh']:.3f} | {rate['mapped']:.3f} | {rate.get('huge', float('nan')):.3f} |")
    for label, rate in raw_rates(path, args.reps).items():
        print(f"{label}: {rate:.3f} s/GiB")

