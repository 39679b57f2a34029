"""FLIP patch dropout (mmcl/models/flip.py): the patches kept, their number and order, masks that are a function of
(seed, step, micro-batch, global row), so that 2 processes equal 1 and accumulation's passes see the same masks."""

import pytest
import torch

from mmcl.models import flip

MIX = 0x9E3779B97F4A7C15


def _tokens(n, p, d=3, seed=0):
    """(n, 1 + p, d) tokens whose first feature is the patch index (-1 for the class token)."""
    x = torch.randn(n, 1 + p, d, generator=torch.Generator().manual_seed(seed))
    x[:, :, 0] = torch.arange(-1, p, dtype=x.dtype)
    return x


def test_mask_seed_is_the_documented_63_bit_mix():
    for seed, step, micro in ((0, 0, 0), (7, 123, 1), (2**40 + 5, 10**6, 3)):
        want = ((seed & 0xFFFFFFFF) * MIX + (step + 1) * (MIX >> 7) + micro * 0x2545F4914F6CDD1D) & (2**63 - 1)
        assert flip.mask_seed(seed, step, micro) == want
    seeds = {flip.mask_seed(s, t, m) for s in range(3) for t in range(20) for m in range(4)}
    assert len(seeds) == 3 * 20 * 4


def test_patch_keys_are_distinct_in_a_row_and_carry_the_patch_index():
    seeds = torch.tensor([12345, 678], dtype=torch.int64)
    keys = flip.patch_keys(seeds, torch.arange(5), 49)
    assert keys.shape == (5, 49) and keys.dtype == torch.int64
    assert torch.equal(keys & 0xFFFF, torch.arange(49).expand(5, 49))
    assert all(len(set(row.tolist())) == 49 for row in keys)
    assert bool((keys >= 0).all()) and bool((keys < 2**48).all())
    assert torch.equal(keys[2:], flip.patch_keys(seeds, torch.arange(2, 5), 49))  # a row's keys are its own
    assert not torch.equal(keys, flip.patch_keys(seeds + 1, torch.arange(5), 49))


@pytest.mark.parametrize("prob,p", [(0.5, 16), (0.75, 49), (0.9, 5), (0.3, 7)])
def test_the_kept_patches_are_the_largest_keys_in_spatial_order_after_the_class_token(prob, p):
    drop = flip.SeededPatchDropout(prob, seed=3)
    drop.begin_step(4)
    x = _tokens(6, p)
    out = drop(x)
    keep = max(1, int(p * (1.0 - prob)))
    assert out.shape == (6, 1 + keep, 3)
    assert torch.equal(out[:, 0], x[:, 0])  # the class token, always
    s = flip.mask_seed(3, 4, 0)
    keys = flip.patch_keys(torch.tensor([s & 0xFFFFFFFF, s >> 32]), torch.arange(6), p)
    for i in range(6):
        want = sorted(keys[i].topk(keep).indices.tolist())
        assert out[i, 1:, 0].long().tolist() == want
        assert torch.equal(out[i, 1:], x[i, 1:][want])


def test_two_processes_draw_the_masks_of_one_process_with_the_global_batch():
    x = _tokens(8, 16)
    one = flip.SeededPatchDropout(0.5, seed=1)
    one.begin_step(2)
    whole = one(x)
    for rank in range(2):
        part = flip.SeededPatchDropout(0.5, seed=1, rank=rank, world_size=2)
        part.begin_step(2)
        assert torch.equal(part(x[4 * rank:4 * rank + 4]), whole[4 * rank:4 * rank + 4])


def test_accumulation_gives_micro_batch_k_mod_accum_steps_and_steps_differ():
    x = _tokens(4, 16)
    drop = flip.SeededPatchDropout(0.5, seed=1, accum_steps=2)
    drop.begin_step(5)
    a, b, a_again, b_again = (drop(x) for _ in range(4))
    assert torch.equal(a, a_again) and torch.equal(b, b_again) and not torch.equal(a, b)
    drop.begin_step(6)
    assert not torch.equal(drop(x), a)
    drop.begin_step(5)
    assert torch.equal(drop(x), a)  # a function of the step: a resumed run draws the same masks


def test_nothing_is_dropped_in_evaluation_unmasked_or_at_rate_zero_and_rates_are_checked():
    x = _tokens(2, 16)
    drop = flip.SeededPatchDropout(0.5)
    drop.eval()
    assert drop(x) is x
    drop.train()
    flip.begin_step([drop], 0, masked=False)
    assert drop(x) is x
    flip.begin_step([drop], 0, masked=True, prob=0.0)
    assert drop(x) is x and drop.prob == 0.0
    flip.begin_step([drop], 0, masked=True, prob=0.75)
    assert drop(x).shape == (2, 1 + 4, 3)
    assert list(drop.state_dict()) == []  # no parameters, no saved buffer
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="patch dropout must be in"):
            flip.SeededPatchDropout(bad)
        with pytest.raises(ValueError, match="patch dropout must be in"):
            drop.begin_step(0, prob=bad)
