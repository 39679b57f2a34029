"""The table of open_clip_train's flags (mmcl/cli/open_clip_flag_table.py) covers both open_clip_train 3.3 (the
installed parser) and open_clip's main branch (its flags below, as data), says which version each comes from, takes
each flag's values as that version's parser does, and names only real config keys."""

import re

from test_open_clip_flags import open_clip_actions

from mmcl.cli.open_clip_flag_table import FLAGS, MAIN, NAFLEX_SEQ_LENS, NOT_SUPPORTED_FROM_MAIN, VERSIONS
from mmcl.cli.open_clip_flags import is_command, overrides_for
from mmcl.config import valid_keys

# open_clip main (4.2.0.dev0, commit 89fb801 of 2026-06-27): every option string of open_clip_train/params.py ...
MAIN_FLAGS = (
    "--train-data", "--train-data-upsampling-factors", "--val-data", "--train-num-samples", "--val-num-samples",
    "--dataset-type", "--audio-ext", "--pretrained-audio", "--audio-fill", "--audio-trunc", "--audio-fusion",
    "--audio-int16-normalize", "--audio-zeroshot-dataset", "--audio-zeroshot-split", "--audio-zeroshot-audio-key",
    "--audio-zeroshot-target-key", "--audio-zeroshot-class-key", "--audio-zeroshot-template",
    "--audio-zeroshot-workers", "--audio-zeroshot-multiprocessing-context", "--audio-multiprocessing-context",
    "--dataset-resampled", "--csv-separator", "--csv-img-key", "--csv-caption-key", "--image-key",
    "--max-image-pixels", "--text-key", "--json-text-key", "--json-text-key-probs", "--imagenet-val", "--imagenet-v2",
    "--cache-dir", "--logs", "--log-local", "--name", "--workers", "--batch-size", "--epochs", "--epochs-cooldown",
    "--lr", "--beta1", "--beta2", "--eps", "--wd", "--momentum", "--warmup", "--opt", "--opt-kwargs",
    "--opt-fallback-list", "--text-layer-decay", "--image-layer-decay", "--visual-layer-decay", "--audio-layer-decay",
    "--wd-exclude", "--text-pooler-own-group", "--use-bn-sync", "--skip-scheduler", "--lr-scheduler",
    "--lr-cooldown-end", "--lr-cooldown-power", "--save-frequency", "--save-most-recent", "--zeroshot-frequency",
    "--val-frequency", "--val-retrieval-chunk-size", "--val-retrieval-precision", "--resume", "--precision", "--model",
    "--pretrained", "--pretrained-image", "--lock-image", "--lock-image-unlocked-groups",
    "--lock-image-freeze-bn-stats", "--image-mean", "--image-std", "--image-interpolation", "--image-resize-mode",
    "--aug-cfg", "--grad-checkpointing", "--local-loss", "--gather-with-grad", "--force-context-length",
    "--force-image-size", "--force-quick-gelu", "--force-patch-dropout", "--force-custom-text", "--torchcompile",
    "--torchcompile-strategy", "--torchcompile-backend", "--torchcompile-mode", "--accum-freq", "--device",
    "--dist-url", "--dist-backend", "--report-to", "--wandb-notes", "--wandb-project-name", "--debug",
    "--copy-codebase", "--ddp-static-graph", "--fsdp", "--fsdp-no-reshard-after-forward", "--fsdp-offload-cpu",
    "--fsdp-checkpoint", "--no-set-device-rank", "--seed", "--grad-clip-norm", "--lock-text",
    "--lock-text-unlocked-layers", "--lock-text-freeze-layer-norm", "--log-every-n-steps",
    "--log-metric-every-n-steps", "--train-loss-ema-samples", "--coca-caption-loss-weight",
    "--coca-contrastive-loss-weight", "--remote-sync", "--remote-sync-frequency", "--remote-sync-protocol",
    "--delete-previous-checkpoint", "--distill-model", "--distill-pretrained", "--use-bnb-linear", "--siglip",
    "--loss-dist-impl", "--use-naflex", "--force-naflex-vision", "--naflex-num-train-image-tokens",
    "--naflex-patch-sizes", "--naflex-patch-size-probs", "--naflex-seq-lens", "--naflex-seq-len-probs",
    "--naflex-max-tokens-per-batch", "--naflex-max-text-tokens", "--naflex-batch-divisor", "--naflex-loss-scale",
    "--length-bucketing", "--bucket-pool", "--bucket-chunk", "--bucket-prefetch-pools", "--naflex-pad-multiple",
    "--text-pad-multiple",
)
# ... the switches among them (store_true / store_false), the ones taking several values, and the choices of those
# that have them.
MAIN_SWITCHES = (
    "--audio-fusion", "--audio-int16-normalize", "--dataset-resampled", "--log-local", "--text-pooler-own-group",
    "--use-bn-sync", "--skip-scheduler", "--save-most-recent", "--pretrained-image", "--lock-image",
    "--lock-image-freeze-bn-stats", "--grad-checkpointing", "--local-loss", "--gather-with-grad", "--force-quick-gelu",
    "--force-custom-text", "--torchcompile", "--debug", "--copy-codebase", "--ddp-static-graph", "--fsdp",
    "--fsdp-no-reshard-after-forward", "--fsdp-offload-cpu", "--no-set-device-rank", "--lock-text",
    "--lock-text-freeze-layer-norm", "--delete-previous-checkpoint", "--siglip", "--use-naflex",
    "--force-naflex-vision", "--length-bucketing",
)
MAIN_SEVERAL = {
    "--json-text-key-probs": "+", "--opt-kwargs": "*", "--opt-fallback-list": "*", "--wd-exclude": "*",
    "--image-mean": "+", "--image-std": "+", "--aug-cfg": "*", "--force-image-size": "+", "--naflex-patch-sizes": "+",
    "--naflex-patch-size-probs": "+", "--naflex-seq-lens": "+", "--naflex-seq-len-probs": "+",
}
MAIN_CHOICES = {
    "--dataset-type": {"webdataset", "webdataset-audio", "csv", "synthetic", "synthetic-audio", "auto"},
    "--audio-fill": {"pad", "repeat", "repeatpad"}, "--audio-trunc": {"rand_trunc", "trunc", "fusion"},
    "--audio-zeroshot-multiprocessing-context": {"fork", "forkserver", "spawn"},
    "--audio-multiprocessing-context": {"fork", "forkserver", "spawn"}, "--val-retrieval-precision": {"fp32", "model"},
    "--precision": {"amp", "amp_bf16", "amp_bfloat16", "bf16", "fp16", "pure_bf16", "pure_fp16", "fp32"},
    "--image-interpolation": {"bicubic", "bilinear", "random"},
    "--image-resize-mode": {"shortest", "longest", "squash"},
    "--torchcompile-strategy": {"model", "task", "step"}, "--fsdp-checkpoint": {"full", "sharded"},
    "--remote-sync-protocol": {"s3", "fsspec"}, "--naflex-loss-scale": {"none", "linear", "sqrt"},
}


def test_the_table_holds_exactly_the_flags_of_open_clip_main_and_3_3():
    old = set(open_clip_actions())
    main = set(MAIN_FLAGS)
    assert len(MAIN_FLAGS) == len(main) == 143 and len(old) == 90
    assert sorted(main - set(FLAGS)) == [], "flags of open_clip main missing from the table"
    assert sorted(old - set(FLAGS)) == [], "flags of open_clip_train 3.3 missing from the table"
    assert sorted(set(FLAGS) - main - old) == [], "flags in the table that neither version has"
    assert sorted(old - main) == ["--horovod", "--torchscript", "--trace"]
    assert len(main - old) == 56


def test_each_flag_names_the_version_it_comes_from():
    old, main = set(open_clip_actions()), set(MAIN_FLAGS)
    for flag, entry in FLAGS.items():
        expected = "" if flag in old and flag in main else MAIN if flag in main else "3.3"
        assert entry.version == expected, flag
        assert entry.version in VERSIONS


def test_main_flags_take_their_values_as_mains_parser_does():
    for flag in MAIN_FLAGS:
        nargs = 0 if flag in MAIN_SWITCHES else MAIN_SEVERAL.get(flag, 1)
        assert FLAGS[flag].nargs == nargs, flag


def test_value_mappings_list_every_choice_of_both_versions():
    old = open_clip_actions()
    for flag, entry in FLAGS.items():
        if not isinstance(entry.to, dict):
            continue
        exact = {k for k in entry.to if "*" not in k}
        choices = set(MAIN_CHOICES.get(flag, ())) | set(old[flag].choices or () if flag in old else ())
        if choices:
            assert exact == choices, flag
        assert all(t is not None or entry.note for t in entry.to.values()), flag


def test_every_unmapped_flag_says_why_and_every_unless_is_a_flag():
    for flag, entry in FLAGS.items():
        assert entry.to is not None or entry.note, f"{flag} has no mapping and no note"
        assert entry.unless in ("",) or entry.unless in FLAGS, flag
    assert FLAGS["--use-naflex"].to == "data.naflex.seq_lens=[" + ",".join(map(str, NAFLEX_SEQ_LENS)) + "]"
    assert len(NOT_SUPPORTED_FROM_MAIN) >= 8 and all(what and why for what, why in NOT_SUPPORTED_FROM_MAIN)


def _values(flag):
    entry = FLAGS[flag]
    if entry.nargs == 0:
        return [True]
    if flag in ("--aug-cfg", "--opt-kwargs"):
        return [["scale=(0.5, 1.0)"]]
    if isinstance(entry.to, dict):
        return [k.replace("*", "x") for k in entry.to]
    return [["1", "2"], ["3"]] if entry.nargs in ("+", "*") else ["3"]


def test_every_key_the_table_names_is_a_config_key_and_every_command_is_runnable_here():
    keys, sections = set(valid_keys()), ("model.vision_cfg.", "model.text_cfg.", "data.aug.", "optim.kwargs.")
    for flag in FLAGS:
        for value in _values(flag):
            for item in overrides_for(flag, value) or []:
                if is_command(item):
                    assert re.match(r"(mmcl \w|accelerate launch --)", item), (flag, item)
                    continue
                key = item.split("=", 1)[0]
                assert key in keys or key.startswith(sections), f"{flag} names {key}, not a config key"
