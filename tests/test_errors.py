"""mmcl.errors: messages are one printable line, credentials in them are hidden (environment variables kept), and
an error redacts its own message."""

import pytest

from mmcl.errors import ConfigError, DamagedCheckpointError, MmclError, printable, redact, redact_values


def test_printable_escapes_what_a_terminal_would_act_on_and_keeps_other_text():
    assert printable("a\x1b[31mred\r\nline\x07") == "a\\x1b[31mred\\r\\nline\\x07"
    assert printable("bidi \u202eevil\u2066") == "bidi \\u202eevil\\u2066"
    assert printable("café 東京 🐶 tab-free") == "café 東京 🐶 tab-free"
    assert "\n" not in printable("two\nlines") and printable(7) == "7"


@pytest.mark.parametrize("text,secret", [
    ("pipe:curl -s -H 'Authorization: Bearer abc123' https://host/a.tar", "abc123"),
    ("pipe:curl --header=X-Api-Key:k3y https://host/a.tar", "k3y"),
    ("https://user:pa55@host/shard-{000..009}.tar", "pa55"),
    ("https://bucket.s3/a.tar?X-Amz-Signature=s1gn&part=1", "s1gn"),
    ("pipe:AWS_SECRET_ACCESS_KEY=wJalr aws s3 cp s3://b/a.tar -", "wJalr"),
    ("pipe:tool --token t0k fetch a.tar", "t0k"),
    ("pipe:curl -u me:hunter2 https://host/a.tar", "hunter2"),
    ("key AKIAABCDEFGHIJKLMNOP in a message", "AKIAABCDEFGHIJKLMNOP"),
])
def test_redact_hides_each_kind_of_credential(text, secret):
    hidden = redact(text)
    assert secret not in hidden and "***" in hidden, hidden


def test_redact_keeps_environment_references_and_what_is_not_secret():
    assert redact("pipe:curl -H 'Authorization: Bearer $HF_TOKEN' https://host/a.tar") == \
        "pipe:curl -H 'Authorization: Bearer $HF_TOKEN' https://host/a.tar"
    assert redact("https://user:pa55@host/a.tar?part=1") == "https://user:***@host/a.tar?part=1"
    assert redact("/data/shards/shard-{000000..000009}.tar") == "/data/shards/shard-{000000..000009}.tar"
    assert redact("") == "" and redact(None) is None


def test_redact_values_walks_a_config_keeping_its_types():
    config = {"data": {"train": "https://u:pw@h/a.tar", "sources": ["pipe:cat a.tar", ("token=zz", 3)]},
              "optim": {"lr": 1e-3}, "name": None}
    assert redact_values(config) == {"data": {"train": "https://u:***@h/a.tar",
                                              "sources": ["pipe:cat a.tar", ("token=***", 3)]},
                                     "optim": {"lr": 1e-3}, "name": None}
    assert type(redact_values(config)["data"]["sources"][1]) is tuple
    assert config["data"]["train"] == "https://u:pw@h/a.tar"  # a copy: the config itself is unchanged


def test_an_error_redacts_its_own_message_and_user_errors_share_one_base():
    err = ConfigError("data.train: cannot open 'https://u:pw@h/a.tar'")
    assert str(err) == "data.train: cannot open 'https://u:***@h/a.tar'"
    assert isinstance(DamagedCheckpointError("x"), MmclError) and not MmclError.everywhere


def test_preview_names_the_first_few_and_counts_the_rest():
    from mmcl.errors import preview

    assert preview(["a", "b"]) == "a, b"
    assert preview(["a", "b", "c", "d", "e"]) == "a, b, c (+2 more)"
    assert preview(list("abcdefgh"), 6) == "a, b, c, d, e, f (+2 more)"
