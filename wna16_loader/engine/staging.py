"""Where the engine hook keeps the tensors an engine hands over until their projection is written.

An engine passes every routed-expert tensor whole, one call at a time. Holding each one (the engine's
`torch.Tensor` plus a record of it) until its projection is complete keeps two objects per tensor alive
long enough for CPython's cyclic collector to promote them into its oldest generation, and every few
ten thousand promotions set off a full collection over the whole process (at DeepSeek-V3 scale: a dozen
of them per load, a second or more of CPU). So a `Stage` copies what the write needs of a per-expert
tensor, the storage slice covering the rank's part, into one buffer per role for a chunk of consecutive
slots, and lets the engine's tensor go at once; per tensor it keeps only a name and plain tuples of
strings and ints, which the collector stops tracking. Stacked tensors (few: one per role and layer) and
large tensors the rank needs whole (HOLD_WHOLE_BYTES: few per GB) are held as they are in a `TensorStore`.

| Stage.buffers[role] | [S, *staged]  `tensor[index[role]]` of the tensor of each of the S slots |
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..models.names import Source
from ..storage.index import TensorRef
from ..storage.scratch import Scratch, destination

Index = tuple[slice | int, ...]
MEMORY_FILE = "<memory>"  # TensorRef.file of a tensor handed over by an engine
# A per-expert tensor the rank needs whole is held as it is from this size on: copying it would cost more than
# the collector's work per object held (~7 µs per held tensor at DeepSeek-V3 scale, about a 64 KiB copy),
# and tensors this large are too few per GB to set off many full collections.
HOLD_WHOLE_BYTES = 64 << 10


class TensorStore:
    """Whole in-memory tensors, read like a CheckpointIndex: `read(ref, index)` is `tensor[index]` on the CPU.

    Each `hold` of a name is matched by one `release`; the tensor is dropped at the last one. `nbytes`: the
    bytes of the tensors held.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._holds: dict[str, int] = {}
        self.nbytes = 0
        self.scratch = Scratch()  # `gather(scratch=True)`: chunks placed at once reuse one buffer

    def __len__(self) -> int:
        return len(self._tensors)

    def hold(self, ref: TensorRef, tensor: torch.Tensor) -> TensorRef:
        """Keep `tensor` under `ref.name` until released."""
        holds = self._holds.get(ref.name, 0)
        if not holds:
            self.nbytes += tensor.numel() * tensor.element_size()
        self._tensors[ref.name] = tensor
        self._holds[ref.name] = holds + 1
        return ref

    def release(self, name: str) -> None:
        """Drop one hold of tensor `name`; the tensor goes with the last."""
        self._holds[name] -= 1
        if not self._holds[name]:
            tensor = self._tensors.pop(name)
            self.nbytes -= tensor.numel() * tensor.element_size()
            del self._holds[name]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of held tensor `name`."""
        return self._tensors[name].dtype

    def read(self, ref: TensorRef, index: Index = ()) -> torch.Tensor:
        """`tensor[index]` (basic slices and ints), on the CPU."""
        tensor = self._tensors[ref.name]
        return (tensor[index] if index else tensor).to("cpu")

    view = read  # the TensorReader name: the held tensor is the caller's, so a view is as safe as it

    def gather(self, refs: Sequence[TensorRef], indices: Sequence[Index], *, pin: bool = False,
               scratch: bool = False) -> torch.Tensor:
        """`[view(ref, index) ...]` stacked into fresh CPU memory (pinned with `pin`), or with `scratch` into this
        store's `Scratch` (valid until the thread's next scratch gather)."""
        return stacked_copy([self.view(ref, index) for ref, index in zip(refs, indices)], pin,
                            self.scratch if scratch else None)

    def view_stacked(self, refs: Sequence[TensorRef], indices: Sequence[Index]) -> None:
        """Held tensors are separate objects, never one strided view: None (the reader then gathers)."""
        return None

    @classmethod
    def of(cls, ref: TensorRef, tensor: torch.Tensor) -> "TensorStore":
        """A store holding one tensor."""
        store = cls()
        store.hold(ref, tensor)
        return store


def stacked_copy(views: list[torch.Tensor], pin: bool, scratch: Scratch | None = None) -> torch.Tensor:
    """`views` stacked into fresh CPU memory (pinned with `pin`), or into `scratch`."""
    return torch.stack(views, out=destination((len(views), *views[0].shape), views[0].dtype, pin, scratch))


def within(staged: Index, index: Index) -> Index:
    """`index` (basic slices of the whole tensor) as slices of the part `staged` (slices of the whole tensor
    too) that holds it: the staged part is all a stage keeps, and every read of it stays inside."""
    assert len(index) == len(staged), f"{index} reads other dims than the staged {staged}"
    out = []
    for have, want in zip(staged, index):
        assert isinstance(want, slice) and isinstance(have, slice) and want.step is None and \
            have.start <= want.start <= want.stop <= have.stop, f"{index} reads outside the staged {staged}"
        out.append(slice(want.start - have.start, want.stop - have.start))
    return tuple(out)


def copy_index(index: Index, shape: tuple[int, ...]) -> Index | slice | None:
    """`index` (slices of a tensor of `shape`) without its trailing whole-dim slices: None for the whole
    tensor, a bare slice for a cut along the first dim only (each a cheaper `tensor[...]` per call)."""
    dims = list(index)
    while dims and dims[-1] == slice(0, shape[len(dims) - 1]):
        dims.pop()
    return None if not dims else dims[0] if len(dims) == 1 else tuple(dims)


class Stage:
    """The tensors of one chunk of consecutive local slots [first, first + count) of one projection from one
    source kind, and a TensorReader over them (module table).

    Per slot: `roles[i]` the bit mask of the roles arrived (-1 once written), `names[role][i]` the tensor
    that brought each. A per-expert tensor is copied (its `index` part) into `buffers[role][i]` and
    `where[name]` says where; anything else (stacked tensors, or a dtype other than the buffer's) is held
    whole in `held`, the hook's TensorStore. Roles are their values (plain strings) throughout.
    """

    def __init__(self, first: int, count: int, source: Source, stacked: bool, held: TensorStore) -> None:
        self.first, self.count, self.source, self.stacked, self.held = first, count, source, stacked, held
        self.roles = [0] * count
        self.names: dict[str, list[str | None]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}  # the whole tensor's shape, per role
        self.index: dict[str, Index] = {}  # the staged part, per role
        self.pick: dict[str, Index | slice | None] = {}  # the same as the copy takes it (`copy_index`)
        self.buffers: dict[str, torch.Tensor] = {}
        self.where: dict[str, tuple[str, int]] = {}  # staged tensor name -> (role, slot)
        self.ready = 0  # slots whose required roles are all here, not written yet
        self.written = 0

    def take(self, role: str, index: Index | None, i: int, loaded: torch.Tensor, name: str) -> None:
        """Keep tensor `name` for role `role` of slot `i`: its `index` part copied into the role's buffer,
        or the whole tensor held (`index` None: a stacked tensor, kept for every slot it feeds). Every
        tensor of one role has one shape (the hook checks each header first)."""
        names = self.names.get(role)
        if names is None:
            names = self.names[role] = [None] * self.count
            self.shapes[role] = tuple(loaded.shape)
        elif names[i] is not None:
            self.drop(role, i)
        names[i] = name
        if index is not None and self._stages(role, index, loaded):
            pick = self.pick[role]
            self.buffers[role][i].copy_(loaded if pick is None else loaded[pick])
            self.where[name] = (role, i)
            return
        self.held.hold(TensorRef(name, MEMORY_FILE, tuple(loaded.shape), loaded.dtype), loaded)

    def _stages(self, role: str, index: Index, loaded: torch.Tensor) -> bool:
        """Whether the `index` part of `loaded` goes into the role's buffer (made at the first that does): not
        when the part is a whole tensor of HOLD_WHOLE_BYTES or more, nor for another dtype or index."""
        buffer = self.buffers.get(role)
        if buffer is None:
            pick = copy_index(index, tuple(loaded.shape))
            if pick is None and loaded.numel() * loaded.element_size() >= HOLD_WHOLE_BYTES:
                return False
            shape = (self.count, *loaded[index].shape)
            buffer = self.buffers[role] = torch.empty(shape, dtype=loaded.dtype, device="cpu")
            self.index[role], self.pick[role] = index, pick
        staged = self.index[role]
        return buffer.dtype is loaded.dtype and (staged is index or staged == index)

    def drop(self, role: str, i: int) -> None:
        """Forget what slot `i` holds for `role`."""
        name = self.names[role][i]
        self.names[role][i] = None
        if self.where.get(name) == (role, i):
            del self.where[name]
        else:
            self.held.release(name)

    def ref(self, role: str, i: int) -> TensorRef:
        """The TensorRef of the tensor slot `i` holds for `role` (its whole shape and dtype)."""
        name = self.names[role][i]
        where = self.where.get(name)
        dtype = self.held.dtype(name) if where is None else self.buffers[role].dtype
        return TensorRef(name, MEMORY_FILE, self.shapes[role], dtype)

    def view(self, ref: TensorRef, index: Index = ()) -> torch.Tensor:
        """`tensor[index]` of a tensor this stage keeps (a view of its buffer row, or of the held tensor)."""
        where = self.where.get(ref.name)
        if where is None:
            return self.held.view(ref, index)
        role, i = where
        return self.buffers[role][i][within(self.index[role], index)]

    def view_stacked(self, refs: Sequence[TensorRef], indices: Sequence[Index]) -> torch.Tensor | None:
        """`[view(ref, index) ...]` as one view of a buffer when the refs are staged in consecutive slots of
        one role under one index; else None."""
        where = [self.where.get(ref.name) for ref in refs]
        first = where[0]
        if first is None or any(w is None or w[0] != first[0] for w in where) or \
                any(index != indices[0] for index in indices):
            return None
        role, start = first
        if [w[1] for w in where] != list(range(start, start + len(where))):
            return None
        return self.buffers[role][start:start + len(where)][(slice(None), *within(self.index[role], indices[0]))]

    def gather(self, refs: Sequence[TensorRef], indices: Sequence[Index], *, pin: bool = False,
               scratch: bool = False) -> torch.Tensor:
        """`[view(ref, index) ...]` stacked into fresh CPU memory (pinned with `pin`), or with `scratch` into the
        held store's `Scratch` (valid until the thread's next scratch gather)."""
        stacked, into = self.view_stacked(refs, indices), self.held.scratch if scratch else None
        if stacked is None:
            return stacked_copy([self.view(ref, index) for ref, index in zip(refs, indices)], pin, into)
        return destination(tuple(stacked.shape), stacked.dtype, pin, into).copy_(stacked)

    def release(self, i: int) -> None:
        """Slot `i` is written: let go of the tensors it holds whole (its buffer rows go with the stage)."""
        for names in self.names.values():
            name = names[i]
            if name is not None and name not in self.where:
                self.held.release(name)
            names[i] = None
        self.roles[i] = -1
        self.written += 1
