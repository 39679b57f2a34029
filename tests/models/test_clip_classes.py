"""mmcl's subclasses of open_clip's model classes (mmcl/models/clip_classes.py): the text tower that skips the padding
after a batch's last end-of-text token, and the image tower that follows its input's size, against open_clip's CLIP."""

import copy

import torch
from open_clip.model import CLIP

from mmcl import models

SENTENCES = ["the digit seven", "handwriting: 7", "a photo of a small red circle on a blue background"]


def images(n=2, size=64, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_text_tower_skips_padding_exactly():
    """In training, the causal text tower runs on the batch cut after its last end-of-text token: same features
    and gradients as open_clip's full-context computation (which evaluation keeps, bit for bit)."""
    from open_clip.model import CLIP

    from mmcl.config import load_config

    torch.manual_seed(0)
    model, *_ , tokenizer = models.build(load_config(None, []).model)
    model.train()
    tokens = tokenizer(["a red circle", "there is a small purple triangle in the top left corner", "x"])
    assert tokens.argmax(-1).max() + 1 < tokens.shape[1]  # the cut really happens
    ours, ref = model.encode_text(tokens), CLIP.encode_text(model, tokens)
    # Same float32 kernels on fewer columns: agreement to rounding (~1e-6 on features of norm ~10).
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    grads = []
    for fn in (model.encode_text, lambda t: CLIP.encode_text(model, t)):
        model.zero_grad()
        (fn(tokens) ** 2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[1]:
        # float32 sums over differently shaped matmuls: differences are rounding, small against the largest entry.
        worst = (grads[0][name] - grads[1][name]).abs().max()
        assert worst <= 1e-5 * grads[1][name].abs().max() + 1e-8, name
    model.eval()
    with torch.no_grad():
        assert torch.equal(model.encode_text(tokens), CLIP.encode_text(model, tokens))


def test_tokens_cut_in_the_data_loader_give_the_full_context_features():
    """`models.training_tokenizer` cuts each batch after its last token column (in the data loader's workers, so
    the training loop never reads the longest caption back from the device): the tower's features from the cut
    batch equal those of the full batch in training and, padded back, bit for bit in evaluation; a tower that
    reads the padding (non-causal, or not argmax-pooled) gets the tokenizer unchanged."""
    import pickle

    from mmcl.config import load_config

    torch.manual_seed(0)
    model, model_cfg, *_, tokenizer = models.build(load_config(None, []).model)
    cut = models.training_tokenizer(model, tokenizer)
    assert isinstance(cut, models.TrimmedTokenizer)
    cut = pickle.loads(pickle.dumps(cut))  # crosses into worker processes
    captions = ["a red circle", "there is a small purple triangle in the top left corner", "x"]
    full, short = tokenizer(captions), cut(captions)
    longest = int(full.argmax(-1).max()) + 1
    assert short.shape == (3, longest) < full.shape and torch.equal(short, full[:, :longest])
    assert cut.context_length == tokenizer.context_length
    model.train()
    torch.testing.assert_close(model.encode_text(short), model.encode_text(full), rtol=1e-5, atol=1e-5)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model.encode_text(short), model.encode_text(full))
    # Every caption as long as the context: nothing to cut.
    assert cut(["word " * 200]).shape == tokenizer(["word " * 200]).shape
    # A tower that reads the padding keeps the tokenizer as it is.
    model.text_pool_type = "last"
    assert models.training_tokenizer(model, tokenizer) is tokenizer


def test_mmcl_model_classes_equal_open_clips_for_the_same_config_and_weights():
    """`ShortTextCLIP`, with its image tower made to follow its input's size (`GridFollowingVisionTransformer`), has
    the state-dict keys of open_clip's own CLIP built from the same config, and with the same weights gives its
    outputs bit for bit at the model's own sizes (evaluation, and training on full-context tokens); at a smaller
    image size it gives the features of open_clip's CLIP built at that size, loaded through open_clip's
    ``resize_pos_embed``."""
    from open_clip.model import resize_pos_embed

    from mmcl.config import load_config
    from mmcl.models.clip_classes import ShortTextCLIP
    from mmcl.models.resize import GridFollowingVisionTransformer, follow_input_size

    torch.manual_seed(0)
    model, model_cfg, *_, tokenizer = models.build(load_config(None, []).model)
    theirs = CLIP(**model_cfg, output_dict=True)
    theirs.load_state_dict(model.state_dict())
    follow_input_size(model)
    assert type(model) is ShortTextCLIP and type(model.visual) is GridFollowingVisionTransformer
    assert list(model.state_dict()) == list(theirs.state_dict())
    pixels, tokens = images(3), tokenizer(SENTENCES)
    for mode in ("eval", "train"):
        with torch.no_grad():
            ours, ref = getattr(model, mode)()(pixels, tokens), getattr(theirs, mode)()(pixels, tokens)
        assert ours.keys() == ref.keys()
        for key in ours:
            assert torch.equal(ours[key], ref[key]), (mode, key)
    small_cfg = copy.deepcopy(model_cfg)
    small_cfg["vision_cfg"]["image_size"] = 40
    small = CLIP(**small_cfg, output_dict=True)
    state = model.state_dict()
    resize_pos_embed(state, small)
    small.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(model.eval().encode_image(images(3, size=40)), small.eval().encode_image(images(3, size=40)))


def test_caption_coca_has_open_clips_coca_keys_and_an_initialised_decoder():
    """`CaptionCoCa` keeps open_clip's CoCa's state-dict keys and shapes; its decoder starts from the same seed's
    same weights (open_clip 3.3 leaves the output projection as torch.empty's memory), at the intended scales."""
    from open_clip.coca_model import CoCa

    from mmcl.config import load_config
    from mmcl.models.clip_classes import CaptionCoCa

    cfg = load_config(None, ["model.name=coca_tiny"]).model
    model_cfg = models.resolve_model_config(cfg)
    builds = []
    for _ in range(2):
        torch.manual_seed(0)
        builds.append(models.create(model_cfg))
    a, b = builds
    assert type(a) is CaptionCoCa
    ref = CoCa(**{k: v for k, v in model_cfg.items() if k != "custom_text"})
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    proj = a.text_decoder.text_projection
    assert torch.isfinite(proj).all() and abs(float(proj.std()) - 64 ** -0.5) < 0.01
