"""The synthetic demo set, kept importable as ``mmcl.demo``; it lives in `mmcl.data.demo`."""

from .data.demo import (CAPTION_FORMS, COLOUR_TEMPLATES, COLOURS, POSITIONS, SHAPE_TEMPLATES, SHAPE_WORDS, SHAPES,
                        SIZES, caption, make_demo_data, render)

__all__ = ["CAPTION_FORMS", "COLOUR_TEMPLATES", "COLOURS", "POSITIONS", "SHAPE_TEMPLATES", "SHAPE_WORDS", "SHAPES",
           "SIZES", "caption", "make_demo_data", "render"]
