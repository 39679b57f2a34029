"""The evaluations a run makes (mmcl/evaluation/in_run.py): its sets named, when each is due on its own `every`, the
validation loss on its own, and everything at the end."""

import pytest

from mmcl.config import EvalConfig
from mmcl.errors import ConfigError
from mmcl.evaluation import in_run


def _ev(**kw):
    return EvalConfig(**kw)


def test_sets_are_named_after_their_data_unless_named():
    ev = _ev(zeroshot=["/data/imagenet/val", {"name": "cifar", "data": "/x/c-{0..3}.tar", "every": 4}],
             retrieval="/data/flickr/test-{0..1}.tar")
    sets = in_run.named_sets(ev)
    assert [(s.task, s.name, s.every) for s in sets] == [("zeroshot", "val", 0), ("zeroshot", "cifar", 4),
                                                          ("retrieval", in_run.set_name(sets[2]), 0)]
    assert sets[2].name and "/" not in sets[2].name
    with pytest.raises(ConfigError, match=r"eval.zeroshot: two sets are named 'val' \(/a/val and /b/val\)"):
        in_run.named_sets(_ev(zeroshot=["/a/val", "/b/val"]))


def test_each_set_and_the_validation_loss_are_due_on_their_own_every():
    ev = _ev(every=3, zeroshot=[{"name": "a", "data": "/a", "every": 2}, {"name": "b", "data": "/b"}],
             val_loss="/v-{0..1}.tar", val_loss_every=5)
    table = {step: ([s.name for s in in_run.due(ev, step)[0]], in_run.due(ev, step)[1]) for step in range(1, 11)}
    assert table == {1: ([], False), 2: (["a"], False), 3: (["b"], False), 4: (["a"], False), 5: ([], True),
                     6: (["a", "b"], False), 7: ([], False), 8: (["a"], False), 9: (["b"], False),
                     10: (["a"], True)}
    assert [s.name for s in in_run.due(ev, None)[0]] == ["a", "b"] and in_run.due(ev, None)[1] is True
    # the last step has the final evaluation instead of a periodic one
    assert [step for step in range(1, 11) if in_run.any_due(ev, step, 10)] == [2, 3, 4, 5, 6, 8, 9]
    assert in_run.val_loss_every(ev) == 5 and in_run.val_loss_every(_ev(every=7)) == 7


def test_a_run_without_sets_evaluates_nothing():
    ev = _ev(every=2)
    assert not in_run.has_evaluation(ev)
    assert in_run.due(ev, 2) == ([], False) and in_run.due(ev, None) == ([], False)
    assert not any(in_run.any_due(ev, step, 10) for step in range(1, 11))
    assert in_run.has_evaluation(_ev(val_loss="/v.tar"))
