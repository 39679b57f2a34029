"""The loss tests' fixture `tiles` (their builders, `pair_features` and the float64 references, are in helpers.py)."""

import pytest


@pytest.fixture(params=["default_tiles", "small_tiles"])
def tiles(request, monkeypatch):
    """Run a tiled test with the production tile area (whole rows at these sizes) and with tiles of 64
    logits, so several column tiles per row block are exercised too."""
    from mmcl import losses

    if request.param == "small_tiles":
        monkeypatch.setattr(losses.tiling, "_TILE_ELEMENTS", 64)
    return request.param
