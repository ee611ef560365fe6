"""A batch made in a loader worker, sent to the training process as one buffer.

A worker hands each tensor of a batch to the training process through shared memory, one storage at a time: for
each, the training process opens a connection to the worker, authenticates, receives a file descriptor and maps it
(``torch.multiprocessing``'s ``file_descriptor`` strategy). A QM9 batch (a PyG ``Batch`` of graphs, its bookkeeping
and the 11 tasks' targets) holds 22 tensors, and receiving them cost the training process 4-6 ms of CPU a batch,
about half of a GPU step's host time (docs/qm9.md). Packed, the batch is one storage: the worker copies every tensor
into one byte buffer and pickles the rest of the batch with each tensor replaced by its place in the buffer; the
training process receives the one buffer and rebuilds the batch with each tensor a view of it. The values, dtypes
and shapes are those the worker made, bit for bit (every tensor comes back contiguous).

``PackedCollate`` wraps a loader's collate in its workers; ``unpacked`` is what the loader's iterator applies
(mtl/data/loader.py does both when ``data.num_workers`` > 0). ``Packed.pin_memory`` pins the one buffer, so the
DataLoader's pin-memory thread handles it as one tensor.
"""

from __future__ import annotations

import io
import pickle

import torch

ALIGN = 64  # bytes: every tensor starts at a multiple of this in the buffer, so a view of any dtype is aligned


class _Pickler(pickle.Pickler):
    def __init__(self, file, tensors: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor:
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, views: list):
        super().__init__(file)
        self.views = views

    def persistent_load(self, pid):
        return self.views[pid]


class Packed:
    """A batch as one uint8 buffer (every tensor's bytes, aligned), the tensors' (offset, dtype, shape), and the
    pickle of the rest with each tensor replaced by its index."""

    def __init__(self, batch):
        tensors: list[torch.Tensor] = []
        f = io.BytesIO()
        _Pickler(f, tensors).dump(batch)
        self.skeleton = f.getvalue()
        self.layout, offset = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            self.layout.append((offset, n, t.dtype, tuple(t.shape)))
            offset += -(-n // ALIGN) * ALIGN
        self.buffer = torch.empty(offset, dtype=torch.uint8)
        for t, (start, n, _, _) in zip(tensors, self.layout):
            self.buffer[start:start + n].view(t.dtype).view(t.shape).copy_(t)

    def pin_memory(self, device=None):
        self.buffer = self.buffer.pin_memory(device) if device is not None else self.buffer.pin_memory()
        return self

    def unpack(self):
        """The batch, each tensor a view of the buffer."""
        views = [self.buffer[start:start + n].view(dtype).view(shape) for start, n, dtype, shape in self.layout]
        return _Unpickler(io.BytesIO(self.skeleton), views).load()


class PackedCollate:
    """``collate``, its batch packed (in the loader's worker)."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, items):
        return Packed(self.collate(items))


def unpacked(batch):
    return batch.unpack() if isinstance(batch, Packed) else batch
