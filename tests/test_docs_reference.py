"""The reference pages (docs/reference/config.md, docs/reference/cli.md) are what docs/gen_reference.py writes from
the code now, and name every config key and every command with its options."""

import argparse
import importlib.util
from pathlib import Path

import pytest

from mmcl.cli import build_parser
from mmcl.config import describe_keys

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _page(name):
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["reference/config.md", "reference/cli.md"])
def test_committed_page_is_what_the_generator_writes(generator, name):
    assert _page(name) == generator.PAGES[name](), f"docs/{name} is stale: run python docs/gen_reference.py"


def test_generator_output_is_deterministic(generator):
    assert generator.config_page() == generator.config_page() and generator.cli_page() == generator.cli_page()


def test_config_page_lists_every_key_with_type_and_default():
    page = _page("reference/config.md")
    for info in describe_keys():
        assert f"| `{info.key}` | {info.type.replace('|', chr(92) + '|')} |" in page, info.key


def test_cli_page_lists_every_command_and_option():
    page = _page("reference/cli.md")
    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in commands.choices.items():
        section = page.split(f"\n## mmcl {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in section, (name, option)
            if not action.option_strings:
                assert f"`{action.metavar or action.dest}`" in section, (name, action.dest)
