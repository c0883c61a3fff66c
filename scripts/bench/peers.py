"""The loaders users pick for a fast load, read as they read a checkpoint: every tensor of every file into
host memory, each consumed as it arrives (a device loader would copy it to the GPU and reuse the buffer).

Each is driven in a documented configuration, set before its first read (one run per interpreter):
- Run:ai Model Streamer (`runai-model-streamer`): RUNAI_STREAMER_CONCURRENCY=16 reading threads (its default
  for file systems), RUNAI_STREAMER_FS_STRATEGY a preference list: `io_uring_buffered,sync_buffered`
  (buffered) or `io_uring_direct,sync_buffered` (O_DIRECT through io_uring), and 16 MiB requests
  (RUNAI_STREAMER_CHUNK_BYTESIZE for the synchronous reader, RUNAI_STREAMER_FS_CHUNK_BYTESIZE for io_uring),
  its CPU buffer capped at MEMORY_LIMIT (RUNAI_STREAMER_MEMORY_LIMIT; unlimited, its default, it holds every
  file at once: 11.8 GB resident at 48 layers, which pushed the checkpoint out of a 24 GiB machine's page
  cache); all files in one `stream_files` request, `owned=False` (views into its reused buffers).
- fastsafetensors: `SafeTensorsFileLoader(..., nogds=True)` (no GPUDirect Storage on a CPU machine), 16 threads
  (`max_threads`, its default) with 16 MiB bounce buffers (`bbuf_size_kb`), FASTSAFETENSORS_ODIRECT=0
  (buffered) or 1 (O_DIRECT); FILES_PER_BATCH files per `copy_files_to_device`, as vLLM's iterator takes a
  few files at a time, so that host memory holds a batch, not the checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CHUNK = 16 << 20
FILES_PER_BATCH = 4


@dataclass(frozen=True)
class Peer:
    """A loader of another project, by its import name and its PyPI package."""

    module: str
    package: str

    def missing(self) -> str | None:
        """None when importable, else the one line a skipped row says."""
        if importlib.util.find_spec(self.module) is not None:
            return None
        return f"{self.package} is not installed (pip install -e '.[bench]')"


RUNAI = Peer("runai_model_streamer", "runai-model-streamer")
FASTSAFETENSORS = Peer("fastsafetensors", "fastsafetensors")

MEMORY_LIMIT = 2 << 30  # Run:ai's CPU buffer: unlimited by default, i.e. the size of every file requested
RUNAI_ENV = {"RUNAI_STREAMER_CONCURRENCY": "16", "RUNAI_STREAMER_CHUNK_BYTESIZE": str(CHUNK),
             "RUNAI_STREAMER_FS_CHUNK_BYTESIZE": str(CHUNK), "RUNAI_STREAMER_MEMORY_LIMIT": str(MEMORY_LIMIT),
             "RUNAI_STREAMER_LOG_LEVEL": "WARNING"}
RUNAI_STRATEGY = {"buffered": "io_uring_buffered,sync_buffered", "direct": "io_uring_direct,sync_buffered"}
FST_ODIRECT = {"buffered": "0", "direct": "1"}


def runai_env(mode: str) -> dict[str, str]:
    """The environment of a Run:ai streamer run in `mode` ("buffered" or "direct")."""
    return {**RUNAI_ENV, "RUNAI_STREAMER_FS_STRATEGY": RUNAI_STRATEGY[mode]}


def fastsafetensors_env(mode: str) -> dict[str, str]:
    """The environment of a fastsafetensors run in `mode` ("buffered" or "direct")."""
    return {"FASTSAFETENSORS_ODIRECT": FST_ODIRECT[mode]}


def runai_read(folder: Path, *, distributed: bool = False) -> Callable[[], int]:
    """Every tensor of every file of `folder` streamed by the Run:ai streamer; the bytes delivered. `distributed`:
    its distributed streaming over the initialised torch.distributed group (with RUNAI_STREAMER_DIST=1 on gloo:
    each rank reads a part, then every part is broadcast to every rank)."""
    from runai_model_streamer import SafetensorsStreamer

    files = [str(f) for f in sorted(folder.glob("*.safetensors"))]

    def run() -> int:
        delivered = 0
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files, device="cpu", owned=False, is_distributed=distributed)
            for _, tensor in streamer.get_tensors():
                delivered += tensor.numel() * tensor.element_size()
        return delivered
    return run


def fastsafetensors_read(folder: Path) -> Callable[[], int]:
    """Every tensor of every file of `folder` read by fastsafetensors, FILES_PER_BATCH files at a time."""
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    files = [str(f) for f in sorted(folder.glob("*.safetensors"))]

    def run() -> int:
        delivered = 0
        loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True, max_threads=16, bbuf_size_kb=CHUNK >> 10)
        try:
            for start in range(0, len(files), FILES_PER_BATCH):
                loader.add_filenames({0: files[start:start + FILES_PER_BATCH]})
                buffer = loader.copy_files_to_device()
                for name in loader.get_keys():
                    tensor = buffer.get_tensor(name)
                    delivered += tensor.numel() * tensor.element_size()
                buffer.close()
                loader.reset()
        finally:
            loader.close()
        return delivered
    return run


def set_environment(env: dict[str, str]) -> None:
    """Put a peer's configuration into this process's environment (before its library reads it)."""
    os.environ.update(env)
