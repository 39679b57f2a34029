"""Sample terms: the sums and counts, their mean over a batch, and the objective's checks."""

import pytest
import torch

from mmcl import losses


def test_sample_mean_is_the_sum_over_the_counts_and_zero_for_an_empty_batch():
    x = losses.SampleLosses(torch.tensor([3.0, 5.0, 0.0]), torch.tensor([2.0, 2.0, 0.0]))
    assert float(losses.sample_mean(x)) == 2.0
    empty = losses.SampleLosses(torch.zeros(2), torch.zeros(2))
    assert float(losses.sample_mean(empty)) == 0.0


def test_the_objective_names_the_missing_outputs_of_a_sample_term():
    objective = losses.ContrastiveObjective({"clip": 1.0, "caption": 1.0})
    with pytest.raises(losses.LossInputError, match="caption term needs the model's logits, labels"):
        objective.sample_losses({"image_features": torch.zeros(2, 4)})
    f = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
    with pytest.raises(losses.LossInputError, match="caption term needs"):
        objective(f, f, torch.tensor(10.0))


def test_the_objective_adds_the_weighted_caption_term_to_its_loss():
    g = torch.Generator().manual_seed(0)
    f = torch.nn.functional.normalize(torch.randn(4, 8, generator=g), dim=1)
    out = {"logits": torch.randn(4, 5, 11, generator=g), "labels": torch.randint(0, 11, (4, 5), generator=g)}
    objective = losses.ContrastiveObjective({"clip": 1.0, "caption": 0.5})
    samples = objective.sample_losses(out)
    total, terms = objective(f, f, torch.tensor(10.0), samples=samples)
    clip = losses.clip_loss(f, f, torch.tensor(10.0))
    caption = losses.sample_mean(losses.caption_losses(out["logits"], out["labels"]))
    torch.testing.assert_close(total, clip + 0.5 * caption)
    assert abs(terms["loss/caption"] - float(caption)) < 1e-6
    assert objective.sample_losses(out, rows=2)["caption"].sums.shape == (2,)
