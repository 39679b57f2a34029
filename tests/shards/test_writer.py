"""Writing datasets as shards (mmcl/shards/writer.py): samples to tar shards byte for byte, and image folders,
caption folders, tables and img2dataset's layouts converted to shards, with what was skipped and why."""

import io
import json
import os
import tarfile
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from mmcl import data
from mmcl.errors import DataError
from mmcl.shards import writer as shard_writer

from helpers import (
    PREPROCESS,
    SIDE,
    encode,
    image_for,
    write_tar,
)


def test_write_shards_roundtrip(tmp_path):
    samples = [{"key": f"k{i}", "image": image_for(i), "caption": f"cap {i}", "label": i,
                "json": {"i": i}} for i in range(5)]
    samples.append({"key": "raw", "image": encode(image_for(9), "JPEG"), "ext": "jpg", "caption": "raw bytes"})
    summary = shard_writer.write_shards(samples, str(tmp_path / "out"), shard_size=4, prefix="x")
    assert summary["n_samples"] == 6 and summary["n_shards"] == 2
    assert [os.path.basename(p) for p in summary["shards"]] == ["x-000000.tar", "x-000001.tar"]
    items = list(data.read_raw_samples([(p, None) for p in summary["shards"]]))
    assert [i.key for i in items] == ["k0", "k1", "k2", "k3", "k4", "raw"]
    assert items[2].files["txt"] == b"cap 2" and items[2].files["cls"] == b"2"
    assert json.loads(items[2].files["json"]) == {"i": 2}
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(items[2].files["png"]))), np.asarray(image_for(2)))
    assert set(items[5].files) == {"jpg", "txt"}
    again = shard_writer.write_shards(samples, str(tmp_path / "again"), shard_size=4, prefix="x")
    assert open(again["shards"][0], "rb").read() == open(summary["shards"][0], "rb").read()
    with pytest.raises(DataError, match="no '.'"):
        shard_writer.write_shards([{"key": "a.b", "image": image_for(0), "caption": "c"}], str(tmp_path / "bad"))
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path / "bad"))


@pytest.fixture()
def image_folder(tmp_path):
    root = tmp_path / "folder"
    for c, name in enumerate(("dog", "cat_face")):
        (root / name).mkdir(parents=True)
        for i in range(3):
            image_for(10 * c + i).save(root / name / f"{i}.png")
    (root / "dog" / "broken.jpg").write_bytes(b"\xff\xd8 not really")
    (root / "dog" / "notes.md").write_text("not an image")
    return root


def test_shards_from_image_folder_and_eval(image_folder, tmp_path, capsys):
    out = tmp_path / "shards"
    summary = shard_writer.shards_from_input(str(image_folder), str(out), shard_size=4, progress=False)
    assert summary["n_samples"] == 6 and summary["n_shards"] == 2
    assert summary["skipped"] == {"decode": 1, "not_image": 1}
    assert "wrote 6 samples in 2 shards" in capsys.readouterr().out
    ds = data.build_eval_dataset(str(out / "shard-{000000..000001}.tar"), PREPROCESS)
    assert ds.classnames == ["cat face", "dog"]
    items = list(ds)
    expected = [(0, "a photo of a cat face.")] * 3 + [(1, "a photo of a dog.")] * 3
    assert [(lab, cap) for _, lab, cap, _ in items] == expected
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2)
    keys = [k for batch in loader for k in batch[3]]
    assert sorted(keys) == sorted(k for *_, k in items)
    folder = data.build_eval_dataset(str(image_folder), PREPROCESS)
    assert folder.classnames == ["cat_face", "dog"] and len(folder) == 7
    image, label, caption, key = folder[0]
    assert image.shape == (3, SIDE, SIDE) and label == 0 and caption == "" and key == os.path.join("cat_face", "0.png")
    skips = [item for item in (folder[i] for i in range(len(folder))) if isinstance(item, data.EvalSkip)]
    assert [(s.reason, s.where) for s in skips] == [("decode", os.path.join("dog", "broken.jpg"))]


def test_shards_from_csv_and_jsonl(image_folder, tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("image,caption,label\n"
                     "folder/dog/0.png,a dog,1\n"
                     "folder/dog/missing.png,gone,1\n"
                     "folder/cat_face/1.png,,0\n"
                     "folder/cat_face/2.png,a cat,x\n"
                     "folder/dog/broken.jpg,broken,1\n"
                     "folder/cat_face/0.png,a cat,\n")
    summary = shard_writer.shards_from_input(str(table), str(tmp_path / "csv"), progress=False)
    assert summary["n_samples"] == 2
    assert summary["skipped"] == {"missing_file": 1, "bad_caption": 1, "bad_label": 1, "decode": 1}
    items = list(data.build_eval_dataset(str(tmp_path / "csv"), PREPROCESS))
    assert [(lab, cap) for _, lab, cap, _ in items] == [(1, "a dog"), (-1, "a cat")]
    lines = [json.dumps({"image": "folder/dog/1.png", "caption": "one dog", "label": 1}), "{not json",
             json.dumps({"caption": "no image"}), json.dumps({"image": "folder/dog/2.png", "caption": "two"})]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    summary = shard_writer.shards_from_input(str(tmp_path / "t.jsonl"), str(tmp_path / "jl"), progress=False)
    assert summary["n_samples"] == 2 and summary["skipped"] == {"bad_row": 1, "missing_image": 1}
    assert summary["skipped_examples"][0] == "t.jsonl:2: bad_row"
    with pytest.raises(DataError, match="needs columns 'image' and 'caption'"):
        (tmp_path / "bad.csv").write_text("path,text\nx,y\n")
        shard_writer.shards_from_input(str(tmp_path / "bad.csv"), str(tmp_path / "b"), progress=False)
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(DataError, match="unsupported input"):
        shard_writer.shards_from_input(str(tmp_path / "t.txt"), str(tmp_path / "c"), progress=False)


def _img2dataset_files_layout(root, n_shards=2, per_shard=3, no_caption=(), with_parquet=True):
    """A folder as img2dataset's FilesSampleWriter writes it: ``{shard:05d}/{key}.jpg|.txt|.json`` with the
    key ``{shard:05d}{index:04d}``, the metadata JSON indented by 4, and ``{shard:05d}.parquet`` /
    ``{shard:05d}_stats.json`` beside the folders. Returns {key: (caption, url)} of the samples written."""
    root.mkdir(parents=True)
    expected = {}
    for shard in range(n_shards):
        folder = root / f"{shard:05d}"
        folder.mkdir()
        rows = []
        for i in range(per_shard):
            key = f"{shard:05d}{i:04d}"
            url = f"http://127.0.0.1:8000/img/{shard}-{i}.jpg"
            caption = f"picture {shard}-{i} of a {'red' if i % 2 else 'blue'} thing"
            buf = io.BytesIO()
            image_for(10 * shard + i, size=20).convert("RGB").save(buf, format="JPEG", quality=90)
            (folder / f"{key}.jpg").write_bytes(buf.getvalue())
            meta = {"url": url, "caption": caption, "key": key, "status": "success", "error_message": None,
                    "width": 20, "height": 20, "original_width": 20, "original_height": 20, "exif": "{}",
                    "sha256": "0" * 64}
            if key not in no_caption:
                (folder / f"{key}.txt").write_text(caption)
                expected[key] = (caption, url)
            (folder / f"{key}.json").write_text(json.dumps(meta, indent=4))
            rows.append(meta)
        if with_parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), str(root / f"{shard:05d}.parquet"))
        (root / f"{shard:05d}_stats.json").write_text(json.dumps({"count": per_shard, "successes": per_shard}))
    return expected


def _shard_samples(out):
    samples = {}
    for tar_path in sorted(out.glob("shard-*.tar")):
        with tarfile.open(tar_path) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return samples


def test_shards_from_img2dataset_files_layout_reads_captions_and_keeps_metadata(tmp_path, capsys):
    """Numbered folders of KEY.jpg/KEY.txt/KEY.json (img2dataset's `files` output) give the .txt captions, the
    .json fields (url included) and img2dataset's keys; they are not read as an ImageFolder of classes 00000..."""
    root = tmp_path / "i2d"
    expected = _img2dataset_files_layout(root, no_caption=("000010001",))
    (root / "00001" / "000019999.txt").write_text("a caption whose image failed to download")
    out = tmp_path / "shards"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = shard_writer.shards_from_input(str(root) + os.sep, str(out), shard_size=4, progress=False)
    assert summary["n_samples"] == 5 and summary["skipped"] == {"missing_caption": 1, "missing_image": 1}
    assert summary["skipped_examples"] == [f"{os.path.join('00001', '000010001.jpg')}: missing_caption",
                                           f"{os.path.join('00001', '000019999.txt')}: missing_image"]
    notes = [str(w.message) for w in caught if "caption file" in str(w.message)]
    assert len(notes) == 1 and "000010001.jpg" in notes[0] and "\n" not in notes[0]
    assert not (out / "classnames.txt").exists()
    samples = _shard_samples(out)
    assert sorted(samples) == sorted(expected)
    for key, (caption, url) in expected.items():
        assert samples[key]["txt"].decode() == caption
        meta = json.loads(samples[key]["json"])
        assert meta["url"] == url and meta["key"] == key and meta["status"] == "success"
        assert "cls" not in samples[key]
    items = list(data.build_eval_dataset(str(out), PREPROCESS))
    assert sorted((key, cap) for _, _, cap, key in items) == sorted((k, c) for k, (c, _) in expected.items())


def test_caption_files_beside_class_folders_are_not_read_as_an_image_folder(image_folder, tmp_path):
    """One caption file beside an image makes the folder a caption folder: the images without one are skipped and
    counted, never given the folder name as caption."""
    (image_folder / "dog" / "0.txt").write_text("a brown dog on grass")
    with pytest.warns(UserWarning, match="6 images .* have no caption file"):
        summary = shard_writer.shards_from_input(str(image_folder), str(tmp_path / "out"), progress=False)
    samples = _shard_samples(tmp_path / "out")
    assert [s["txt"].decode() for s in samples.values()] == ["a brown dog on grass"]
    assert summary["skipped"]["missing_caption"] == 6  # the other 5 images and the broken one
    assert summary["skipped"]["not_image"] == 1  # notes.md


def test_shards_cli_on_img2dataset_files_layout_warns_once_and_exits_0(tmp_path, capsys):
    from mmcl import cli

    root = tmp_path / "i2d"
    _img2dataset_files_layout(root, n_shards=1, per_shard=3, no_caption=("000000000", "000000002"),
                              with_parquet=False)
    assert cli.main(["shards", "--input", str(root), "--out", str(tmp_path / "s")]) == 0
    err = capsys.readouterr().err
    assert err.count("mmcl: warning:") == 1 and "2 images" in err and "no caption file" in err
    # no caption anywhere (img2dataset without a caption column writes no .txt): an error, nothing invented
    bare = tmp_path / "bare"
    _img2dataset_files_layout(bare, n_shards=1, per_shard=2, no_caption=("000000000", "000000001"),
                              with_parquet=False)
    assert cli.main(["shards", "--input", str(bare), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "mmcl: error: no valid sample" in err and "missing_caption=2" in err and "a photo of" not in err
    # img2dataset's webdataset output is trained on as it is; converting it again is pointed there
    (tmp_path / "wds").mkdir()
    write_tar(tmp_path / "wds" / "00000.tar", [("000000000.txt", b"x")])
    assert cli.main(["shards", "--input", str(tmp_path / "wds"), "--out", str(tmp_path / "w")]) == 2
    assert "already holds WebDataset shards" in capsys.readouterr().err


def test_url_tables_name_img2dataset_and_local_urls_are_read(image_folder, tmp_path):
    web = tmp_path / "urls.csv"
    web.write_text("url,caption\nhttps://example.com/a.jpg,a dog\n")
    with pytest.raises(DataError, match=r"img2dataset --url_list .*urls.csv --input_format csv --url_col url "
                                        r"--caption_col caption --output_format webdataset"):
        shard_writer.shards_from_input(str(web), str(tmp_path / "w"), progress=False)
    laion = tmp_path / "laion.csv"
    laion.write_text("URL,TEXT\nhttps://example.com/a.jpg,a dog\n")
    with pytest.raises(DataError, match="needs columns 'image' and 'caption'.*img2dataset --url_list .* "
                                        "--url_col URL --caption_col TEXT"):
        shard_writer.shards_from_input(str(laion), str(tmp_path / "l"), progress=False)
    (tmp_path / "urls.jsonl").write_text(json.dumps({"url": "https://example.com/a.jpg", "caption": "x"}) + "\n")
    with pytest.raises(DataError, match=r"read_json\(.*urls.jsonl', lines=True\).to_parquet\(.*urls.parquet'\).*"
                                        r"--input_format parquet"):
        shard_writer.shards_from_input(str(tmp_path / "urls.jsonl"), str(tmp_path / "j"), progress=False)
    dog0 = image_folder / "dog" / "0.png"
    local = tmp_path / "local.csv"
    local.write_text(f"url,caption\n{dog0.as_uri()},a dog by URI\nfolder/dog/1.png,a dog by path\n"
                     f"file://{tmp_path}/folder/dog/missing.png,gone\n")
    summary = shard_writer.shards_from_input(str(local), str(tmp_path / "loc"), progress=False)
    assert summary["n_samples"] == 2 and summary["skipped"] == {"missing_file": 1}
    samples = list(_shard_samples(tmp_path / "loc").values())
    assert [s["txt"].decode() for s in samples] == ["a dog by URI", "a dog by path"]
    assert json.loads(samples[0]["json"])["url"] == dog0.as_uri()
    assert samples[0]["png"] == dog0.read_bytes()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"url": dog0.as_uri(), "caption": "from parquet"},
                                         {"url": "http://example.com/x.jpg", "caption": "web"}]),
                   str(tmp_path / "t.parquet"))
    with pytest.raises(DataError, match="--input_format parquet"):
        shard_writer.shards_from_input(str(tmp_path / "t.parquet"), str(tmp_path / "p"), progress=False)
    pq.write_table(pa.Table.from_pylist([{"url": dog0.as_uri(), "caption": "from parquet"}]),
                   str(tmp_path / "ok.parquet"))
    summary = shard_writer.shards_from_input(str(tmp_path / "ok.parquet"), str(tmp_path / "p2"), progress=False)
    assert [s["txt"].decode() for s in _shard_samples(tmp_path / "p2").values()] == ["from parquet"]
