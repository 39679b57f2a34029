"""The README and the docs run as written: the README's quickstart (the shell block marked ``<!-- readme-walk -->``,
the same commands as the first run of docs/getting-started.md), command by command in a fresh folder, each step
checked against what the pages say it does, and then every ```python block of README.md and docs/*.md in the folder
that run left. Sizes are shrunk only where the pages say they may be (``--n-train`` for ``mmcl demo-data``,
appended ``key=value`` settings for ``mmcl train``)."""

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
# Pages whose ```python blocks run, in this order: the README, then the docs pages by path.
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
WALK_MARKER = "<!-- readme-walk -->"
N_TRAIN = "256"
# Appended to `mmcl train` ("any key=value may be appended"): a short run on a smaller model.
QUICK_TRAIN = ["train.steps=2", "data.batch_size=16", "data.workers=0", "train.plot=false",
               "model.vision_cfg={layers: 1, width: 32, head_width: 16}",
               "model.text_cfg={layers: 1, width: 32, heads: 2}", "model.embed_dim=16"]


def python_blocks(text: str):
    """A page's ```python blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def all_python_blocks():
    """(page, block number, code) for every ```python block of the README and the docs pages."""
    return [(page.relative_to(ROOT).as_posix(), i + 1, code)
            for page in PAGES for i, code in enumerate(python_blocks(page.read_text()))]


def walk_commands(text: str):
    """The commands of the shell block after the walk marker, one argument list each (continuations joined,
    comments dropped)."""
    after = text.split(WALK_MARKER, 1)[1]
    block = re.match(r"\s*```bash\n(.*?)^```", after, re.M | re.S).group(1)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        args = shlex.split(line, comments=True)
        if args:
            commands.append(args)
    return commands


def test_the_walk_block_is_a_sequence_of_mmcl_commands():
    commands = walk_commands(README.read_text())
    assert [c[:2] for c in commands[:3]] == [["mmcl", "demo-data"], ["mmcl", "train"], ["mmcl", "zeroshot"]], commands
    assert all(c[0] == "mmcl" for c in commands)
    assert {"open_clip", "hf"} <= {c[c.index("--format") + 1] for c in commands if c[1] == "export"}


def test_the_readme_quickstart_is_the_first_run_of_getting_started():
    assert walk_commands(GETTING_STARTED.read_text()) == walk_commands(README.read_text())


def shrunk(args):
    """`args` (without the leading ``mmcl``) with the sizes the README allows to change made small."""
    if args[0] == "demo-data":
        return [*args, "--n-train", N_TRAIN]
    if args[0] == "train":
        return [*args, *QUICK_TRAIN]
    return args


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A fresh folder in which the README's first run was walked: (folder, [(args, exit code, stdout), ...])."""
    from mmcl.cli import main

    folder = tmp_path_factory.mktemp("readme")
    done = []
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        assert main(["init", "."]) == 0  # outside a checkout, as the README says
        for command in walk_commands(README.read_text()):
            args = shrunk(command[1:])
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = main(args)
            done.append((args, code, out.getvalue()))
            if code != 0:
                break
    return folder, done


@pytest.mark.slow
def test_the_first_run_does_what_the_readme_says(first_run):
    folder, done = first_run
    assert [code for _, code, _ in done] == [0] * len(walk_commands(README.read_text())), done
    runs = folder / "runs"
    said = {args[0]: out for args, _, out in done}
    # 1. demo-data: training shards (with their counts), validation shards, two zero-shot ImageFolders
    assert sorted(p.name for p in (runs / "demo-data" / "train").glob("shard-*.tar")) == ["shard-000000.tar"]
    assert list((runs / "demo-data" / "val").glob("shard-*.tar"))
    assert all((runs / "demo-data" / "zeroshot" / name).is_dir() for name in ("colour", "shape"))
    # 2. train: says what data.train resolved to; the run folder's files; the final zero-shot result
    assert (f"mmcl: data.train: 'runs/demo-data/train/shard-*.tar': 1 shard(s) (shard-000000.tar), {N_TRAIN} samples"
            in said["train"].splitlines()), said["train"]
    tiny = runs / "tiny"
    for name in ("config.yaml", "metrics.jsonl", "checkpoints", "out.log", "model"):
        assert (tiny / name).exists(), name
    last = json.loads((tiny / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and 0.0 <= last["eval/zeroshot_classification/colour/acc1"] <= 1.0, last
    # 3. zeroshot: CLIP_benchmark's shape, the same model and data as the run's final evaluation
    result = json.loads((runs / "tiny-zeroshot.json").read_text())
    assert {"dataset", "model", "task", "metrics"} <= set(result)
    assert {"acc1", "acc5", "mean_per_class_recall"} <= set(result["metrics"])
    assert result["metrics"]["acc1"] == pytest.approx(last["eval/zeroshot_classification/colour/acc1"], abs=1e-6)
    # 4. export: open_clip's and Hugging Face's layouts (loaded by the Python blocks, below)
    assert (runs / "tiny-open_clip" / "open_clip_config.json").is_file()
    assert (runs / "tiny-hf" / "config.json").is_file() and (runs / "tiny-hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_every_python_block_runs_as_written(first_run):
    folder, done = first_run
    assert all(code == 0 for _, code, _ in done), done
    blocks = all_python_blocks()
    assert len(blocks) >= 3
    spaces = []
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        for i, (page, number, code) in enumerate(blocks):
            space = {"__name__": f"readme_block_{i}"}
            exec(compile(code, f"{page} python block {number}", "exec"), space)
            spaces.append(space)
    # mmcl.load, open_clip's local-dir: and transformers' CLIPModel give one image the same caption probabilities.
    loaded = [s for s in spaces if "mmcl" in s or "open_clip" in s or "CLIPModel" in s]
    assert {("mmcl" in s, "open_clip" in s, "CLIPModel" in s) for s in loaded} >= {
        (True, False, False), (False, True, False), (False, False, True)}
    one_image = [s["probs"] for s in loaded if "probs" in s and tuple(s["probs"].shape) == (1, 2)]
    assert len(one_image) >= 2
    for probs in one_image[1:]:
        torch.testing.assert_close(probs.detach(), one_image[0].detach(), atol=1e-4, rtol=0)
    api = next(s for s in loaded if "mmcl" in s and "clip_loss" in s)
    assert api["probs"].shape == (2, 2)
    torch.testing.assert_close(api["probs"].sum(dim=-1), torch.ones(2))
    from mmcl.losses import clip_loss

    dense = clip_loss(api["image_features"], api["text_features"], api["logit_scale"])
    torch.testing.assert_close(api["loss"], dense)
