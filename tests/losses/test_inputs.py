"""What every loss takes (mmcl/losses/inputs.py): the gathered global batch, and the argument checks the losses
share, each one `LossInputError` naming what was expected; seen through the public losses."""

import pytest
import torch

from mmcl.losses import Gathered, LossInputError, clip_loss, supcon_loss

from helpers import pair_features

SCALE = torch.tensor(10.0)


def test_gathered_defaults_mean_one_process_holding_the_batch():
    g = Gathered(None, None)
    assert (g.all_labels, g.offset, g.world_size, g.all_teacher_image, g.all_teacher_text, g.all_valid) == (
        None, 0, 1, None, None, None)
    img, txt = pair_features(6, 8)
    whole = clip_loss(img, txt, SCALE)
    # The rows themselves as the columns: the same loss as no gathered batch at all.
    assert torch.equal(clip_loss(img, txt, SCALE, gathered=Gathered(img, txt)), whole)


def test_a_ranks_rows_against_the_gathered_columns_average_to_the_whole_batch_loss():
    img, txt = pair_features(8, 8, dtype=torch.float64)
    whole = clip_loss(img, txt, SCALE)
    parts = [clip_loss(img[r * 4:(r + 1) * 4], txt[r * 4:(r + 1) * 4], SCALE,
                       gathered=Gathered(img, txt, offset=4 * r, world_size=2)) for r in range(2)]
    torch.testing.assert_close(sum(parts) / 2, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make,message", [
    (lambda i, t: (i[:, :, None], t), r"features must be 2-D \(B, D\)"),
    (lambda i, t: (i, t[:3]), r"must have the same shape \(got \(4, 8\) and \(3, 8\)"),
    (lambda i, t: (i[:0], t[:0]), r"empty batch \(got 0 pairs"),
])
def test_bad_features_are_one_loss_input_error(make, message):
    img, txt = pair_features(4, 8)
    with pytest.raises(LossInputError, match=message):
        clip_loss(*make(img, txt), SCALE)


def test_bad_chunk_size_offset_columns_and_labels_are_one_loss_input_error():
    img, txt = pair_features(4, 8)
    for chunk in (0, -1, 2.0, True):
        with pytest.raises(LossInputError, match="chunk_size must be a positive integer or None"):
            clip_loss(img, txt, SCALE, chunk)
    big_i, big_t = pair_features(10, 8, seed=1)
    with pytest.raises(LossInputError, match=r"offset must be in \[0, 6\] for 4 local rows of 10 \(got 7\)"):
        clip_loss(img, txt, SCALE, gathered=Gathered(big_i, big_t, offset=7))
    with pytest.raises(LossInputError, match="need both all_image_features and all_text_features"):
        clip_loss(img, txt, SCALE, gathered=Gathered(big_i, None))
    with pytest.raises(LossInputError, match=r"must be \(M, 8\) for both modalities"):
        clip_loss(img, txt, SCALE, gathered=Gathered(big_i, big_t[:9]))
    with pytest.raises(LossInputError, match=r"labels must be an integer tensor of shape \(4,\)"):
        supcon_loss(img, txt, torch.zeros(4), SCALE)
    with pytest.raises(LossInputError, match=r"labels must be an integer tensor of shape \(4,\)"):
        supcon_loss(img, txt, torch.zeros(3, dtype=torch.long), SCALE)
    # int32 labels are taken as long; None means no labels (each pair its own class: CLIP's loss)
    got = supcon_loss(img, txt, torch.arange(4, dtype=torch.int32), SCALE)
    torch.testing.assert_close(got, supcon_loss(img, txt, None, SCALE))
