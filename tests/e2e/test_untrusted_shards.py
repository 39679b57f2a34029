"""Shards from elsewhere: a file's name is never a command, a shard list runs commands only when allowed,
credentials in a command never reach the run's files or output, and no shard member can exhaust memory."""

import gzip
import http.server
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from mmcl import data
from mmcl.config import DataConfig, load_config
from mmcl.errors import DataError
from mmcl.shards import writer as shard_writer

ROOT = Path(__file__).resolve().parents[2]
PREPROCESS = T.Compose([T.Resize(8), T.CenterCrop(8), T.ToTensor()])
MARKER = "PWNED"


def tokenizer(texts):
    out = torch.zeros(len(texts), 8, dtype=torch.long)
    for i, text in enumerate(texts):
        raw = text.encode()[:8]
        out[i, : len(raw)] = torch.tensor(list(raw))
    return out


def _samples(n, prefix="s", size=16):
    return [{"key": f"{prefix}{i:03d}", "image": Image.new("RGB", (size, size), (i * 20 % 255, 40, 90)),
             "caption": f"sample {i}", "label": i % 3} for i in range(n)]


def _shards(folder, n=6, shard_size=3):
    return shard_writer.write_shards(_samples(n), str(folder), shard_size=shard_size)["shards"]


def _epoch(stream):
    """The keys of one epoch of a single-process stream without workers (batch size 1), and its skip counts."""
    keys = []
    for batch in stream:
        if stream.state_dict()["positions"][0]["epoch"] > 0:
            return keys, stream.state_dict()["positions"][0]["skipped_before_epoch"]
        keys += batch["key"]
    raise AssertionError("the stream ended")


def _stream(spec, **kw):
    cfg = DataConfig(**dict(dict(train=spec, batch_size=1, workers=0, shuffle_buffer=1), **kw))
    return data.build_train_stream(cfg, PREPROCESS, tokenizer, seed=0)


# ------------------------------------------------------------------------------------------ names are data
def _poisoned_folder(tmp_path):
    """Real shards and, beside them, the empty file a downloaded shard folder may hold: a name that webdataset's
    gopen would run through a shell (``cat`` the real shard, so that the run would train normally, and create
    the marker)."""
    folder = tmp_path / "download"
    shards = _shards(folder)
    (folder / f"pipe:cat {Path(shards[0]).name};touch {MARKER};#.tar").write_bytes(b"")
    return folder


def test_a_pipe_name_found_by_a_glob_is_a_local_file(tmp_path, monkeypatch):
    folder = _poisoned_folder(tmp_path)
    monkeypatch.chdir(folder)  # a glob in the current directory returns the bare name "pipe:cat ..."
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keys, skipped = _epoch(_stream("*.tar"))
        evaluated = list(data.build_eval_dataset("*.tar", PREPROCESS))
    assert not (folder / MARKER).exists()
    urls = data.expand_urls("*.tar")
    assert len(urls) == 3 and all(os.path.isabs(u) for u in urls)
    # The real shards train; the empty file is read as the file it is: a shard that cannot be opened, counted.
    assert sorted(keys) == [f"s{i:03d}" for i in range(6)]
    assert skipped["shard_open"] == 1
    assert sorted(it[3] for it in evaluated if not isinstance(it, data.EvalSkip)) == sorted(keys)
    assert [it.reason for it in evaluated if isinstance(it, data.EvalSkip)] == ["shard_open"]


def test_a_pipe_name_found_by_a_directory_listing_is_a_local_file(tmp_path, monkeypatch):
    folder = _poisoned_folder(tmp_path)
    monkeypatch.chdir(folder)
    urls = data.expand_urls(".")  # the directory's shards
    assert sorted(os.path.basename(u) for u in urls) == sorted(n for n in os.listdir(folder) if n.endswith(".tar"))
    assert all(os.path.isabs(u) and not data.has_scheme(u) for u in urls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keys, skipped = _epoch(_stream(str(folder)))
        evaluated = list(data.build_eval_dataset(".", PREPROCESS))
    assert not (folder / MARKER).exists()
    assert sorted(keys) == [f"s{i:03d}" for i in range(6)] and skipped["shard_open"] == 1
    assert len([it for it in evaluated if not isinstance(it, data.EvalSkip)]) == 6
    # A name typed by the user after file:// is a path too, whatever it reads like.
    poisoned = [u for u in urls if os.path.basename(u).startswith("pipe:")][0]
    assert data.expand_urls(f"file://{poisoned}") == [poisoned]
    with data.open_shard(poisoned) as f:
        assert f.read() == b""
    assert not (folder / MARKER).exists()


def test_a_shard_list_runs_pipe_commands_only_when_allowed(tmp_path, monkeypatch):
    folder = tmp_path / "dataset"
    shards = _shards(folder)
    monkeypatch.chdir(tmp_path)
    listing = folder / "shards.yaml"
    listing.write_text(json.dumps([shards[0], f"pipe:cat {shards[1]}; touch {MARKER}"]))
    with pytest.raises(DataError, match=r"shards\.yaml runs a command .*data\.allow_pipe=true") as info:
        data.expand_urls(str(listing))
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match="data.allow_pipe"):
        _stream(str(listing))
    (folder / "upper.yaml").write_text(json.dumps([f"PIPE:cat {shards[1]}; touch {MARKER}"]))  # gopen's case
    with pytest.raises(DataError, match="data.allow_pipe"):
        data.expand_urls(str(folder / "upper.yaml"))
    from mmcl.training.preflight import input_problems

    from helpers import inputs_of

    problems = input_problems(*inputs_of(load_config(overrides=[f"data.train={listing}"])))
    assert len(problems) == 1 and "data.allow_pipe=true" in problems[0] and problems[0].startswith("data.train:")
    assert input_problems(*inputs_of(load_config(overrides=[f"data.train={listing}", "data.allow_pipe=true"]))) == []
    assert not (tmp_path / MARKER).exists()
    # Allowed: the command runs, and its samples are read with the file's.
    keys, _ = _epoch(_stream(str(listing), allow_pipe=True))
    assert sorted(keys) == [f"s{i:03d}" for i in range(6)]
    assert (tmp_path / MARKER).exists()
    # A pipe: command the user typed runs without the key.
    assert data.expand_urls(f"pipe:cat {shards[1]}") == [f"pipe:cat {shards[1]}"]


# ------------------------------------------------------------------------------------------ credentials
SECRET = "s3cr3t-Zq7pXv"


@pytest.mark.parametrize("text, kept", [
    (f'pipe:curl -s -H "Authorization: Bearer {SECRET}" https://host/x.tar', 'pipe:curl -s -H "Authorization: '),
    (f"pipe:curl -s --header 'X-Api-Key: {SECRET}' https://host/x.tar", "https://host/x.tar"),
    (f"pipe:curl -s https://user:{SECRET}@host/x.tar", "https://user:***@host/x.tar"),
    (f"https://host/x.tar?X-Amz-Signature={SECRET}&part=2", "part=2"),
    (f"pipe:AWS_SECRET_ACCESS_KEY={SECRET} aws s3 cp s3://bucket/x.tar -", "aws s3 cp s3://bucket/x.tar -"),
    (f"pipe:hf download --token {SECRET} org/data x.tar", "org/data x.tar"),
    (f"(['curl', '-H', 'Authorization:Bearer {SECRET}'], {{}}): exit 22", "exit 22"),
])
def test_redact_hides_credentials_and_keeps_the_rest(text, kept):
    shown = data.sources.redact(text)
    assert SECRET not in shown and kept in shown and "***" in shown


def test_redact_keeps_environment_references_and_plain_specs():
    for text in ['pipe:curl -s -H "Authorization: Bearer $HF_TOKEN" https://host/x-{000..009}.tar',
                 "pipe:curl -s https://host/x.tar?token=${TOKEN}", "data/auth-shards/shard-{000000..000009}.tar",
                 "pipe:gsutil cat gs://bucket/train/shard-000001.tar"]:
        assert data.sources.redact(text) == text


class _AuthShards(http.server.BaseHTTPRequestHandler):
    files: dict = {}
    authorizations: list = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.authorizations.append(self.headers.get("Authorization"))
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_a_credential_in_a_pipe_command_reaches_no_file_and_no_output(tmp_path, capfd):
    from mmcl.cli import main

    shards = shard_writer.write_shards(_samples(32, size=32), str(tmp_path / "remote"), shard_size=16)["shards"]
    _AuthShards.files = {f"/{Path(p).name}": Path(p).read_bytes() for p in shards}
    _AuthShards.authorizations = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AuthShards)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    # Two sources: the shards, and one that fails (404) so that retry and skip warnings name its command.
    spec = (f'pipe:curl -s -f -H "Authorization: Bearer {SECRET}" {base}/shard-{{000000..000001}}.tar'
            f"::pipe:curl -s -f {base}/shard-000000.tar?token={SECRET}")
    out = tmp_path / "run"
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), f"data.train='{spec}'", f"train.output_dir={out}",
            "eval.zeroshot=null", "train.progress=false", "train.plot=false", "data.workers=0",
            "data.batch_size=8", "data.shuffle_buffer=8", "data.retries=1", "data.retry_delay=0.01",
            "train.log_every=1", "train.save_every=2", "train.log_with=[tensorboard]",
            "model.vision_cfg={layers: 1, width: 32, head_width: 16}",
            "model.text_cfg={layers: 1, width: 32, heads: 2}", "model.embed_dim=16"]
    try:
        assert main(["train", *args, "train.steps=2"]) == 0
        assert main(["train", *args, "train.steps=4"]) == 0  # resumed: the saved config is compared with this one
    finally:
        httpd.shutdown()
    printed = capfd.readouterr()
    assert f"Bearer {SECRET}" in _AuthShards.authorizations  # the command ran with the credential
    assert "retry 1 of 1" in printed.err and "Authorization: ***" in (out / "config.yaml").read_text()
    assert "resuming from" in printed.out  # the saved config is this one's: no false "config differs" line
    assert not re.search(r"data\.train \S.* -> ", printed.out), printed.out
    assert SECRET not in printed.out and SECRET not in printed.err
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any("tfevents" in p.name for p in written) and (out / "metrics.jsonl").is_file()
    for path in written:
        assert SECRET.encode() not in path.read_bytes(), path


# ------------------------------------------------------------------------------------------ member sizes
_MiB = 2 ** 20


def _oversized_shard(path, big):
    """A .tar.gz of 4 samples (a1, a0, a2, a3), a few KB per GiB of `big` (a multiple of 1 MiB): a0 has a `big`-byte
    image (all zeros), a2 a `big`-byte member no sample uses (``.bin``); a1 and a3 are ordinary.

    Written as a multi-member gzip stream (which gzip and tarfile read as one), the compressed MiB of zeros
    repeated, so that making the shard costs nothing next to reading it."""
    png = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(png, format="PNG")
    zeros = gzip.compress(bytes(_MiB), compresslevel=9)

    def header(name, size):
        info = tarfile.TarInfo(name)
        info.size = size
        return info.tobuf(tarfile.USTAR_FORMAT)

    with open(path, "wb") as out:
        def small(name, payload):
            out.write(gzip.compress(header(name, len(payload)) + payload + bytes(-len(payload) % 512)))

        def zero_member(name):
            out.write(gzip.compress(header(name, big)))
            for _ in range(big // _MiB):
                out.write(zeros)

        for key in ("a1", "a0", "a2", "a3"):  # a1 first: the next epoch's first sample comes before a0
            if key == "a0":
                zero_member(f"{key}.png")
            else:
                small(f"{key}.png", png.getvalue())
            small(f"{key}.txt", b"a caption")
            if key == "a2":
                zero_member(f"{key}.bin")
        out.write(gzip.compress(bytes(1024)))  # the end-of-archive blocks
    return str(path)


def test_an_oversized_member_is_never_read_and_its_sample_is_counted(tmp_path):
    big = 65 * _MiB  # just over the default limit, data.max_member_bytes = 64 MiB
    shard = _oversized_shard(tmp_path / "bomb.tar.gz", big)
    assert os.path.getsize(shard) < _MiB // 2
    stream = _stream(shard)  # its imports (open_clip) before the memory is traced
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            keys, skipped = _epoch(stream)
            evaluated = list(data.build_eval_dataset(shard, PREPROCESS))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Neither the oversized image nor the unused member was read: memory stayed far below either's size.
    assert peak < 32 * 2 ** 20, peak
    assert sorted(keys) == ["a1", "a2", "a3"] and skipped["too_large"] == 1
    assert [(it.reason, it.where.rsplit(":", 1)[1]) for it in evaluated if isinstance(it, data.EvalSkip)] == [
        ("too_large", "a0")]
    # The limit is data.max_member_bytes: raised above the member's size, the sample is read (and its zeros are
    # not an image).
    items = list(data.read_raw_samples([(shard, None)], members=data.decode.needed_members(),
                                       max_member_bytes=2 * _MiB))
    assert [(i.key, i.error) for i in items] == [("a1", None), ("a0", "too_large"), ("a2", None), ("a3", None)]
    assert set(items[2].files) == {"png", "txt"}  # .bin passed over


def test_an_extended_header_is_never_read_whole(tmp_path):
    """tarfile reads a pax header (here, a 3 MiB member name) into memory before the member: a shard with one
    larger than any real archive's is broken there."""
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    path = tmp_path / "long.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("a.png", "a.txt", "b.png", "b.txt", "x" * (3 * _MiB) + ".png", "c.png", "c.txt"):
            payload = png.getvalue() if name.endswith(".png") else b"a caption"
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = list(data.read_raw_samples([(str(path), None)]))
    # b, whose members were being gathered when the archive broke, is lost with it, as with any damage.
    assert [(i.key, i.error) for i in items] == [("a", None), ("", "truncated_tar")]
    assert "extended header" in str(caught[0].message)


_UNDER_A_MEMORY_LIMIT = r"""
import json, resource, sys, warnings
from torchvision import transforms as T
from mmcl import data
from mmcl.config import DataConfig

cfg = DataConfig(train=sys.argv[1], batch_size=1, workers=0, shuffle_buffer=1)
stream = data.build_train_stream(cfg, T.Compose([T.Resize(8), T.CenterCrop(8), T.ToTensor()]),
                                 lambda texts: __import__("torch").zeros(len(texts), 4, dtype=__import__("torch").long),
                                 seed=0)
vm = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:")][0]
resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2 ** 20, resource.getrlimit(resource.RLIMIT_AS)[1]))
keys = []
warnings.simplefilter("ignore")
for batch in stream:
    if stream.state_dict()["positions"][0]["epoch"] > 0:
        break
    keys += batch["key"]
skipped = stream.state_dict()["positions"][0]["skipped_before_epoch"]
print(json.dumps({"keys": sorted(keys), "too_large": skipped["too_large"]}))
"""


@pytest.mark.slow
def test_a_small_gzip_shard_with_a_large_member_does_not_end_a_run_under_a_memory_limit(tmp_path):
    # 512 MiB members in a shard of about 1 MB, read by a process that may grow by 256 MiB at most.
    shard = _oversized_shard(tmp_path / "bomb.tar.gz", 512 * _MiB)
    assert os.path.getsize(shard) < 2 * _MiB
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _UNDER_A_MEMORY_LIMIT, shard], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"keys": ["a1", "a2", "a3"], "too_large": 1}


def test_evaluation_during_training_follows_the_runs_member_limit(tmp_path):
    """`train`'s evaluations read their sets with the run's ``data.max_member_bytes`` (and pipe rule), not the
    defaults: a limit below every image makes every sample a ``too_large`` skip."""
    from mmcl.evaluation import evaluate

    shard = _shards(tmp_path / "eval", n=3, shard_size=3)[0]
    reading = evaluate.reading_options(DataConfig(max_member_bytes=64))
    assert reading == {"max_member_bytes": 64, "allow_pipe": False}
    ds, _ = evaluate.eval_loader(shard, PREPROCESS, batch_size=2, workers=0, reading=reading)
    reasons = [it.reason for it in ds if isinstance(it, data.EvalSkip)]
    assert reasons == ["too_large"] * 3
    ds, _ = evaluate.eval_loader(shard, PREPROCESS, batch_size=2, workers=0)
    assert not any(isinstance(it, data.EvalSkip) for it in ds)
