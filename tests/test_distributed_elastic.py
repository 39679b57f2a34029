"""Resuming on another number of processes: every sample of the epoch under way is read exactly once through the
resize (1 -> 2, 2 -> 1, 2 -> 3, and a second resize before the first one's leftover is done)."""

import warnings

import pytest

from mmcl import data

from test_data import PREPROCESS, cfg_for, corpus, tokenizer  # noqa: F401 - corpus is a fixture


def streams(spec, world, states=None):
    out = []
    for rank in range(world):
        s = data.build_train_stream(cfg_for(spec, workers=0), PREPROCESS, tokenizer, seed=3, rank=rank,
                                    world_size=world)
        if states is not None:
            assert s.load_resized(states) is None
        out.append(s)
    return out


def take(stream, n):
    """Keys of the next `n` batches (of one sample each)."""
    keys = []
    it = iter(stream)
    for _ in range(n):
        keys += next(it)["key"]
    it.close()
    return keys


def epoch_keys_after_resizes(spec, worlds, consumed):
    """Run len(worlds) - 1 resizes: world worlds[i] reads consumed[i] batches per process, then saves."""
    seen = []
    current = streams(spec, worlds[0])
    for i, world in enumerate(worlds[1:]):
        for s in current:
            seen += take(s, consumed[i])
        states = [s.state_dict() for s in current]
        current = streams(spec, world, states)
    for s in current:  # the rest of the epoch: the leftover batches of every new process
        it = iter(s)
        while s._positions[0].get("leftover"):
            batch = next(it)
            if s._positions[0].get("leftover"):  # this batch's sample came from the saved run's epoch
                seen += batch["key"]
        it.close()
    return seen


@pytest.mark.parametrize("worlds,consumed", [((1, 2), (7,)), ((2, 1), (5,)), ((2, 3), (4,)), ((1, 2, 1), (7, 3)),
                                             ((3, 2), (2,))])
def test_every_sample_of_the_epoch_once_through_a_resize(corpus, worlds, consumed):
    spec, good, _ = corpus
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the corpus's bad shards
        seen = epoch_keys_after_resizes(spec, worlds, consumed)
    assert len(seen) == len(set(seen)), sorted(k for k in set(seen) if seen.count(k) > 1)
    assert sorted(seen) == sorted(good)
