"""Remote shards that fail: an http server on 127.0.0.1 that drops the connection part-way through a shard. The
shard is opened again (``data.retries``, after ``data.retry_delay``) and read on from the sample that broke: every
sample once, in order; past the retries it is skipped and counted; a missing ``pipe:`` program is one line. Then
the tar reader against tarfile: formats, compression, pipes, damage, cuts and empty archives."""

import http.server
import io
import os
import tarfile
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmcl import data
from mmcl.config import load_config
from mmcl.data import read_raw_samples
from mmcl.errors import ConfigError
from mmcl.shards.writer import write_shards

from helpers import check_run_inputs, empty_tars, good_members, write_tar


class _Shards(http.server.BaseHTTPRequestHandler):
    files: dict = {}
    drops: dict = {}  # path -> [bytes to send before dropping, ...] for the next requests
    requests: list = []

    def do_GET(self):  # noqa: N802 - http.server's name
        data = self.files.get(self.path)
        self.requests.append(self.path)
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        cuts = self.drops.get(self.path)
        if cuts:
            self.wfile.write(data[:cuts.pop(0)])  # then the connection goes away mid-body
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    samples = [{"key": f"s{i:03d}", "image": Image.new("RGB", (16, 16), (i * 9 % 255, 20, 40)),
                "caption": f"sample {i}", "label": i % 3} for i in range(24)]
    summary = write_shards(samples, str(root), shard_size=12, prefix="part")
    _Shards.files = {f"/{Path(p).name}": Path(p).read_bytes() for p in summary["shards"]}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Shards)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _read(urls, retries, delay=0.01):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = list(read_raw_samples([(u, None) for u in urls], retries=retries, retry_delay=delay))
    return items, [str(w.message) for w in caught]


def test_a_dropped_connection_is_retried_and_read_on_from_the_sample_that_broke(server):
    shard = "/part-000000.tar"
    size = len(_Shards.files[shard])
    _Shards.drops = {shard: [size // 3, size // 2]}  # two drops, at different samples
    _Shards.requests = []
    items, messages = _read([server + shard, server + "/part-000001.tar"], retries=3)
    assert [i.error for i in items] == [None] * 24
    assert [i.key for i in items] == [f"s{i:03d}" for i in range(24)]  # every sample once, in order
    assert all(set(i.files) == {"png", "txt", "cls"} for i in items)
    assert _Shards.requests.count(shard) == 3
    assert sum("retry 1 of 3" in m for m in messages) == 1 and sum("retry 2 of 3" in m for m in messages) == 1


def test_past_its_retries_a_shard_is_counted_and_the_stream_goes_on(server):
    shard = "/part-000000.tar"
    size = len(_Shards.files[shard])
    _Shards.drops = {shard: [size // 2] * 3}
    items, messages = _read([server + shard, server + "/part-000001.tar"], retries=2)
    good = [i.key for i in items if i.error is None]
    errors = [i.error for i in items if i.error is not None]
    # curl exits as the connection drops, and webdataset's pipe reports that on the next read even with data
    # still buffered: the attempts read some or none of the shard, so it counts as truncated or as unopened.
    assert errors in (["truncated_tar"], ["shard_open"])
    # the samples read before the breaks, once each, then all of the next shard
    assert good == sorted(set(good)) and good[-12:] == [f"s{i:03d}" for i in range(12, 24)]
    assert len(good) - 12 < 12
    assert [sum(f"retry {k} of 2 in" in m for m in messages) for k in (1, 2)] == [1, 1]
    assert any("truncated or corrupt" in m or "cannot open" in m for m in messages)


def test_a_missing_remote_shard_is_retried_a_bounded_number_of_times(server):
    import time

    _Shards.requests = []
    start = time.perf_counter()
    items, _ = _read([server + "/nothing.tar"], retries=2, delay=0.05)
    assert [i.error for i in items] == ["shard_open"] or [i.error for i in items] == ["truncated_tar"]
    assert _Shards.requests.count("/nothing.tar") == 3  # the first try and two retries, no more
    assert time.perf_counter() - start < 30


def test_the_training_stream_sees_every_sample_once_through_dropped_connections(server):
    from mmcl import models
    from mmcl.data import ImageSpec, build_train_stream

    size = len(_Shards.files["/part-000001.tar"])
    _Shards.drops = {"/part-000001.tar": [size // 4]}
    cfg = load_config(None, [f"data.train={server}/part-{{000000..000001}}.tar", "data.batch_size=8",
                             "data.workers=0", "data.shuffle_buffer=4", "data.retry_delay=0.01"])
    _, _, pp, _, _, tokenizer = models.build(cfg.model)
    stream = build_train_stream(cfg.data, ImageSpec.from_config(pp), tokenizer, seed=0)
    keys = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in stream:
            keys += batch["key"]
            if len(keys) >= 24:
                break
    assert sorted(keys) == [f"s{i:03d}" for i in range(24)] and stream.skipped.get("total", 0) == 0


def test_a_pipe_command_that_is_not_installed_is_one_line_before_training(tmp_path):

    cfg = load_config(None, ["data.train=pipe:gsutil-not-installed cat gs://bucket/shard-{000..003}.tar"])
    with pytest.raises(ConfigError, match="the command 'gsutil-not-installed' of pipe:.* is not installed"):
        check_run_inputs(cfg)
    check_run_inputs(load_config(None, [f"data.train=pipe:cat {tmp_path}/x.tar"]))  # cat exists: nothing to say
    with pytest.raises(ConfigError, match="data.retries must be >= 0"):
        load_config(None, ["data.retries=-1"])


# ------------------------------------------------------------------------------------- commands that hang
_TRICKLE = """import sys, time
data = open(sys.argv[1], "rb").read()
cut, pause = int(sys.argv[2]), float(sys.argv[3])
step = 1500
for i in range(0, min(cut, len(data)), step):
    sys.stdout.buffer.write(data[i:min(i + step, cut)])
    sys.stdout.flush()
    time.sleep(pause)
if cut < len(data) or len(sys.argv) > 5:
    time.sleep(float(sys.argv[4]))  # hangs: the shard never ends, or the command never exits
"""


@pytest.fixture
def trickle(tmp_path, server):
    """`pipe:` URL of a command sending the first `cut` bytes of a shard in pieces `pause` s apart, then
    hanging for `hang` s (the number marks its processes)."""
    import sys

    script = tmp_path / "trickle.py"
    script.write_text(_TRICKLE)
    shard = tmp_path / "part.tar"
    shard.write_bytes(_Shards.files["/part-000000.tar"])

    def url(cut, pause, hang=377.0, then_hang=False):
        return f"pipe:{sys.executable} {script} {shard} {cut} {pause} {hang}{' x' if then_hang else ''}"
    return url, len(_Shards.files["/part-000000.tar"])


def _hung(hang):
    import psutil

    return [p for p in psutil.process_iter(["cmdline"]) if str(hang) in " ".join(p.info["cmdline"] or [])]


def _read_timed(urls, retries, timeout):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = list(read_raw_samples([(u, None) for u in urls], retries=retries, retry_delay=0.01,
                                      read_timeout=timeout))
    return items, [str(w.message) for w in caught]


def test_a_pipe_that_hangs_mid_shard_is_killed_retried_and_counted(trickle):
    import time

    url, size = trickle
    start = time.perf_counter()
    items, messages = _read_timed([url(size // 2, 0.0, 377.5)], retries=1, timeout=1.0)
    elapsed = time.perf_counter() - start
    good = [i.key for i in items if i.error is None]
    # the samples whole in the first half, once each although the shard was read twice, then the count
    assert good == [f"s{i:03d}" for i in range(len(good))] and 3 <= len(good) < 12
    assert [i.error for i in items if i.error is not None] == ["truncated_tar"]
    assert sum("data.read_timeout" in m for m in messages) == 2  # the retry, then the report
    assert elapsed < 15, elapsed  # two stalls of about 1 s, not the command's 377 s
    assert _hung(377.5) == []  # the command and its children are gone


def test_a_pipe_that_never_sends_is_a_shard_that_cannot_be_opened(trickle):
    url, _ = trickle
    items, messages = _read_timed([url(0, 0.0, 377.25)], retries=0, timeout=0.5)
    assert [i.error for i in items] == ["shard_open"]
    assert any("cannot open" in m and "no data for 0.5 s" in m for m in messages)
    assert _hung(377.25) == []


def test_a_slow_pipe_that_keeps_sending_and_a_slow_consumer_are_not_stalls(trickle):
    import time

    url, size = trickle
    items, messages = _read_timed([url(size, 0.15)], retries=0, timeout=0.6)  # about 2 s in all, 0.15 s gaps
    assert [i.key for i in items] == [f"s{i:03d}" for i in range(12)] and messages == []
    # the consumer holding the stream longer than the timeout between reads is not a stall either
    reader = read_raw_samples([(url(size, 0.0), None)], read_timeout=0.3)
    keys = []
    for item in reader:
        keys.append(item.key)
        if len(keys) <= 2:
            time.sleep(0.8)
    assert keys == [f"s{i:03d}" for i in range(12)]


def test_read_timeout_is_a_checked_key():
    assert load_config(None, ["data.read_timeout=30"]).data.read_timeout == 30
    with pytest.raises(ConfigError, match="data.read_timeout must be >= 0"):
        load_config(None, ["data.read_timeout=-1"])


def test_the_training_stream_passes_a_hung_shard_by_with_data_read_timeout(trickle, server):
    """The setting reaches the reader: a training stream over a shard whose command hangs mid-way and a healthy
    one yields the healthy samples and counts the hung shard, instead of waiting for the command."""
    import dataclasses
    import time

    from mmcl import models
    from mmcl.data import ImageSpec, build_train_stream

    url, size = trickle
    cfg = load_config(None, ["data.batch_size=4", "data.workers=0", "data.shuffle_buffer=1", "data.retries=0",
                             "data.read_timeout=0.5"])
    data = dataclasses.replace(cfg.data, train=[url(size // 2, 0.0, 377.75), f"{server}/part-000001.tar"])
    _, _, pp, _, _, tokenizer = models.build(cfg.model)
    stream = build_train_stream(data, ImageSpec.from_config(pp), tokenizer, seed=0)
    keys, start = [], time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in stream:
            keys += batch["key"]
            if set(f"s{i:03d}" for i in range(12, 24)) <= set(keys):
                break
    assert time.perf_counter() - start < 60
    assert stream.skipped.get("truncated_tar", 0) == 1
    assert _hung(377.75) == []


def test_a_command_that_never_exits_or_a_consumer_that_stops_does_not_block_the_close(trickle):
    """Closing a pipe waits for its command's exit status (which says whether the archive was whole): a command
    that sends a whole shard and then never exits is killed after the timeout, and, its status unknown, its last
    sample is not vouched for; a stream left early kills its command at once instead of waiting for it."""
    import time

    url, size = trickle
    start = time.perf_counter()
    items, messages = _read_timed([url(size, 0.0, 377.625, then_hang=True)], retries=0, timeout=0.5)
    assert [i.key for i in items if i.error is None] == [f"s{i:03d}" for i in range(11)]
    assert [i.error for i in items if i.error is not None] == ["truncated_tar"]
    assert any("data.read_timeout" in m for m in messages)
    assert time.perf_counter() - start < 15 and _hung(377.625) == []

    reader = read_raw_samples([(url(size // 2, 0.0, 377.875), None)], read_timeout=300)
    assert next(reader).key == "s000"
    start = time.perf_counter()
    reader.close()  # the consumer stops while the command still runs (and would for 377 s)
    assert time.perf_counter() - start < 5 and _hung(377.875) == []


def test_read_raw_samples_positions_and_pipe(tmp_path):
    path = tmp_path / "p.tar"
    write_tar(path, [m for j in range(5) for m in good_members(f"k{j}", j)])
    items = list(data.read_raw_samples([(str(path), None)]))
    assert [i.key for i in items] == [f"k{j}" for j in range(5)]
    assert [i.pos for i in items] == [(0, j + 1) for j in range(5)]
    assert set(items[0].files) == {"png", "txt", "cls"}
    resumed = list(data.read_raw_samples([(str(path), None)], start=(0, 3)))
    assert [i.key for i in resumed] == ["k3", "k4"]
    piped = list(data.read_raw_samples([(f"pipe:cat {path}", None)]))
    assert [i.files for i in piped] == [i.files for i in items]


def _tar_bytes(members, fmt=tarfile.USTAR_FORMAT, compression=""):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:" + compression, format=fmt) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        d = tarfile.TarInfo("a-folder")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
    return buf.getvalue()


class _Pipe(io.RawIOBase):
    """A non-seekable stream that returns short reads, like a pipe."""

    def __init__(self, data):
        self.data, self.pos = data, 0

    def readable(self):
        return True

    def readinto(self, buf):
        n = min(len(buf), 700, len(self.data) - self.pos)
        buf[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n


def _read_all(stream, keep=lambda name: True):
    reader = data.TarReader(stream)
    return [(name, reader.read()) for name in reader if keep(name)]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("compression", ["", "gz", "bz2", "xz"])
def test_tar_reader_matches_tarfile(fmt, compression):
    long_dir = "d" * 120 if fmt != tarfile.USTAR_FORMAT else "d" * 90  # ustar splits paths <= 255 into prefix/name
    members = [(f"{long_dir}/k{i:03d}.{ext}", os.urandom(int(n)))
               for i, n in enumerate(np.random.default_rng(0).integers(0, 3000, 12)) for ext in ("jpg", "txt")]
    members.append(("ünïcode/naïve.txt", b"x"))
    raw = _tar_bytes(members, fmt, compression)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        want = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    assert want == members
    assert _read_all(io.BytesIO(raw)) == want
    assert _read_all(io.BufferedReader(_Pipe(raw))) == want
    # Members that are not read are passed over, on seekable streams and pipes alike.
    txt_only = [m for m in want if m[0].endswith(".txt")]
    assert _read_all(io.BytesIO(raw), lambda n: n.endswith(".txt")) == txt_only
    assert _read_all(io.BufferedReader(_Pipe(raw)), lambda n: n.endswith(".txt")) == txt_only


def test_tar_reader_reports_damage_that_tarfile_would_hide():
    members = [(f"k{i}.txt", bytes([i]) * 600) for i in range(5)]
    raw = bytearray(_tar_bytes(members))
    with tarfile.open(fileobj=io.BytesIO(bytes(raw))) as tar:
        third = [m for m in tar.getmembers() if m.name == "k2.txt"][0]
    raw[third.offset + 10] ^= 0xFF  # a damaged header in the middle of the archive
    with tarfile.open(fileobj=io.BytesIO(bytes(raw)), mode="r|") as tar:
        assert [m.name for m in tar] == ["k0.txt", "k1.txt"]  # tarfile silently stops here
    reader = data.TarReader(io.BytesIO(bytes(raw)))
    got = []
    with pytest.raises(data.TarFormatError, match="bad header checksum"):
        for name in reader:
            got.append(name)
    assert got == ["k0.txt", "k1.txt"]
    # Cut inside a member that is skipped (not read): still an error, seekable or not.
    cut = bytes(_tar_bytes(members))[:third.offset_data + 100]
    for stream in (io.BytesIO(cut), io.BufferedReader(_Pipe(cut))):
        with pytest.raises(data.TarFormatError, match="unexpected end of data"):
            for _ in data.TarReader(stream):
                pass
    for bad, why in ((b"", "empty file"), (b"not a tar" * 100, "not a tar file")):
        with pytest.raises(data.TarFormatError, match=why):
            data.TarReader(io.BytesIO(bad))


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
def test_tar_cut_anywhere_is_an_error_unless_cut_between_members(fmt):
    sizes = [0, 1, 511, 512, 513, 1500, 7]
    members = [(f"k{i}.{'p' * 120 if fmt == tarfile.PAX_FORMAT else 'bin'}", os.urandom(n))
               for i, n in enumerate(sizes)]
    raw = _tar_bytes(members, fmt)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        every = tar.getmembers()  # the files and a folder
        ends = {m.offset_data + m.size + (-m.size) % 512 for m in every}
    starts = [m.offset for m in every if m.isfile()]  # where a member's first header (pax: extended header) begins
    last = max(ends)
    for cut in sorted(set(range(0, last + 1024, 97)) | {m.offset for m in every} | ends):
        # Clean: the archive ends between two members (as if written without end-of-archive blocks) or after its
        # first end-of-archive block.
        clean = cut in ends or cut >= last + 512
        for stream in (io.BytesIO(raw[:cut]), io.BufferedReader(_Pipe(raw[:cut]))):
            got = []
            try:
                reader = data.TarReader(stream)
                for name in reader:
                    got.append((name, reader.read()))
            except data.TarFormatError:
                assert not clean or cut == 0, cut  # a 0-byte stream is no archive
                continue
            assert clean, f"cut at byte {cut} of {len(raw)} went unnoticed"
            assert got == [m for m, start in zip(members, starts) if start < cut], cut


def test_empty_tar_archives_yield_nothing_and_count_nothing(tmp_path):
    paths = empty_tars(tmp_path)
    for path in paths:
        with tarfile.open(path) as tar:  # the standard library's reading: a valid archive with no members
            assert tar.getmembers() == [], path
        with open(path, "rb") as f:
            assert list(data.TarReader(f)) == [], path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = list(data.read_raw_samples([(str(p), None) for p in paths]))
    assert items == [] and caught == []
    # A 0-byte file is no archive: tarfile refuses it ("empty file"), and so does the reader (a lost shard).
    zero = tmp_path / "zero.tar"
    zero.write_bytes(b"")
    with pytest.raises(tarfile.ReadError, match="empty file"):
        tarfile.open(zero)
    with pytest.warns(UserWarning, match="cannot open shard .*zero.tar.*empty file"):
        items = list(data.read_raw_samples([(str(zero), None)]))
    assert [(i.error, i.url) for i in items] == [("shard_open", str(zero))]
