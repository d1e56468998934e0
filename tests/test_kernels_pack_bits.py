"""tfm_kernels.pack_bits against its torch reference (and unpack_bits): widths around word boundaries, lead dims,
rows that are views of wider rows, all-set rows (bit 31: the sign), empty masks. CPU runs use the Triton
interpreter."""
import pytest
import torch

from tfm_kernels.pack_bits import pack_bits, pack_bits_ref
from tfm_kernels.tree_utils import unpack_bits


def check(device):
    g = torch.Generator().manual_seed(0)
    for lead, n in [((1,), 1), ((3,), 31), ((2,), 32), ((1, 5), 33), ((17,), 64), ((1, 65), 65), ((2, 3, 7), 129)]:
        mask = torch.rand(*lead, n, generator=g) < 0.5
        mask[..., 0, :] = True                                             # every bit of the first row: bit 31 too
        got = pack_bits(mask.to(device)).cpu()
        assert got.dtype == torch.int32 and torch.equal(got, pack_bits_ref(mask)), (lead, n)
        assert torch.equal(unpack_bits(got, n), mask)
        wide = torch.zeros(*lead, n + 9, dtype=torch.bool)
        wide[..., :n] = mask
        assert torch.equal(pack_bits(wide[..., :n].to(device)).cpu(), got)   # rows apart (a view)
    assert pack_bits(torch.zeros(0, 5, dtype=torch.bool, device=device)).shape == (0, 1)


@pytest.mark.interpreter
def test_equals_the_reference():
    check("cpu")


@pytest.mark.gpu
def test_gpu_equals_the_reference():
    check("cuda")


def test_rejects_bad_masks():
    with pytest.raises(ValueError, match="mask must be"):
        pack_bits(torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="mask must be"):
        pack_bits(torch.zeros(4, 3, dtype=torch.bool).t())
