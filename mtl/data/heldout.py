"""The held-out stream: the training items a bilevel weighting method (mtl/weighting/bilevel.py) evaluates its
meta-objective on, and that the model never trains on.

``data.heldout = h`` holds out the LAST h items of the training set (indices n - h ... n - 1; the train loader
draws from the first n - h only, ``build_train_loader(heldout=h)``). Each meta update takes one global batch of
``data.batch_size`` x world size of them: the epoch's order is a permutation of the h items seeded by
(seed, epoch) alone, a global batch is the next contiguous slice of it and rank r takes the positions r, r + W,
... of that slice, like the train loader's sampler. So W processes with batch B see together exactly the items
of a 1-process run with batch W*B, and the mean of their losses is that run's loss. An epoch ends when fewer
than a global batch is left (the rest is dropped, like ``drop_last``).

The position is the epoch and the global items consumed in it (``state_dict``), the same on any world size; it
goes into every checkpoint (``trainer_state.pt``, "heldout"), so a resumed run draws the same held-out batches
as the run it continues. Items are read and collated in the main process: one small batch per meta update.
"""

from __future__ import annotations

from torch.utils.data import Dataset

from mtl.data.multi_input import TaskSampler
from mtl.errors import DataError


def verify_heldout_size(heldout: int, train_size: int, batch_size: int, world_size: int) -> None:
    """The held-out part must fill one global batch and leave one for training (the same decision on every rank)."""
    need = batch_size * world_size
    if heldout < need:
        raise DataError(f"data.heldout={heldout} holds out fewer items than one global batch (data.batch_size="
                        f"{batch_size} x {world_size} process(es) = {need}), and a meta update needs one; raise "
                        "data.heldout or lower data.batch_size")
    if train_size - heldout < need:
        raise DataError(f"data.heldout={heldout} leaves {train_size - heldout} of the {train_size} training items "
                        f"to train on, fewer than one global batch ({need}); lower data.heldout or add data")


class HeldoutStream:
    """This rank's share of the held-out batches, in order (see the module docstring): a ``TaskSampler`` over the
    h held-out items under the key ``("heldout",)``, of which each global batch is this rank's every W-th."""

    def __init__(self, ds: Dataset, collate, heldout: int, batch_size: int, rank: int, world_size: int, seed: int):
        verify_heldout_size(heldout, len(ds), batch_size, world_size)
        self.ds, self.collate = ds, collate
        self.offset, self.size = len(ds) - heldout, int(heldout)
        self.batch_size, self.rank, self.world = int(batch_size), int(rank), int(world_size)
        self.sampler = TaskSampler(self.size, seed, "heldout", key=("heldout",))

    def indices(self) -> tuple[list[int], int]:
        """(this rank's data-set indices of the next global batch, their epoch); advances the position."""
        glob, epoch = self.sampler.take(self.batch_size * self.world)
        return [self.offset + i for i in glob[self.rank::self.world]], epoch

    def next_batch(self) -> dict:
        idx, epoch = self.indices()
        keyed = hasattr(self.ds, "set_epoch")  # our data sets take (index, epoch): the epoch's caption, augmentation
        return self.collate([self.ds[(i, epoch)] if keyed else self.ds[i] for i in idx])

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "samples": self.sampler.pos, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if int(state["size"]) != self.size:
            raise DataError(f"the checkpoint's held-out stream is over {state['size']} items, this run's data.heldout "
                            f"is {self.size}; resume with the same data.heldout")
        self.sampler.load_state_dict({"epoch": state["epoch"], "pos": state["samples"], "size": self.size})
