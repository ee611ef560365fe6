"""A batch made in a loader worker travels as one buffer (mtl/data/packing.py): unpacked, it is the batch the
collate made, every tensor's values, dtype and shape bit for bit, and every tensor a view of the one buffer."""

import pickle

import torch

from mtl.data.packing import ALIGN, Packed, PackedCollate, unpacked


def _batch():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(4, 6, generator=g, dtype=torch.float64)
    return {
        "image": torch.randn(2, 3, 5, 5, generator=g),
        "index": torch.arange(7),
        "mask": torch.rand(3, 3, generator=g) > 0.5,
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4, dtype=torch.int32),
        "strided": wide[:, ::2],  # not contiguous: it comes back contiguous, the same values
        "text": ["a caption", "another"],
        "nested": {"ids": torch.randint(0, 9, (2, 3), generator=g, dtype=torch.int16), "n": 2},
    }


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert a == b


def test_a_packed_batch_unpacks_to_the_same_batch_in_one_buffer():
    batch = _batch()
    packed = pickle.loads(pickle.dumps(Packed(batch)))  # as it crosses to the training process
    got = packed.unpack()
    _assert_same(got, batch)
    tensors = [got[k] for k in ("image", "index", "mask", "half", "scalar", "empty", "strided")] + [got["nested"]["ids"]]
    assert {t.untyped_storage().data_ptr() for t in tensors} == {packed.buffer.untyped_storage().data_ptr()}
    assert all(start % ALIGN == 0 for start, *_ in packed.layout)


def test_the_collate_wrapper_packs_and_the_loader_side_unpacks():
    collate = PackedCollate(lambda items: {"x": torch.stack(items)})
    out = collate([torch.ones(2), torch.zeros(2)])
    assert isinstance(out, Packed)
    assert torch.equal(unpacked(out)["x"], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert unpacked({"x": 1}) == {"x": 1}  # an unpacked batch (no workers) passes as it is
