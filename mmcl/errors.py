"""User-facing error types. `cli.main` turns any `MmclError` into one line and exit code 2."""

import os
import re
import stat
from typing import Any, List, Optional

# Characters a terminal acts on rather than shows: C0 and C1 controls (ESC starts colour and cursor sequences, CR
# overwrites a line, BEL rings) and the bidirectional overrides that reorder what is shown.
# Lone surrogates (U+D800-U+DFFF) are the bytes of a name that is not valid UTF-8 (a file name or a tar member's key,
# as Python decodes them with "surrogateescape"): no stream can encode them, so they are escaped too (``\udcff``).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """`text` as one line a terminal shows as it is: each control character written as its escape (``\\x1b``,
    ``\\r``, ``\\n``), and each lone surrogate (the undecodable bytes of a name that is not UTF-8) as ``\\udcff``.
    Every message mmcl prints goes through it, as keys, captions, class names and file names from elsewhere may
    hold them."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


# Credentials a pipe: command or URL can carry: each pattern's group "keep" is kept and its group "secret" hidden.
# A value that is only an environment variable ($HF_TOKEN, Bearer ${TOKEN}) is kept: the shell fills it in at run
# time, the documented way to pass a secret.
_VALUE = r"""[^\s'"&;]+"""
_SECRET_WORDS = (r"token|secret|passw(?:or)?d|pwd|api[_-]?key|access[_-]?key|private[_-]?key|credential|signature|"
                 r"sig|auth")
_REDACT_PATTERNS = [
    # an HTTP header given to curl/wget (-H 'Name: value', --header=Name:value): every header's value
    re.compile(r"""(?P<keep>(?:-H|--header)(?:\s+|=)(?P<q>['"])[\w-]+\s*:\s*)(?P<secret>[^'"]+)(?=(?P=q))"""),
    re.compile(r"""(?P<keep>(?:-H|--header)(?:\s+|=)[\w-]+:\s*)(?P<secret>[^\s'"]+)"""),
    # a header written anywhere else (a JSON string, an error message quoting a command's arguments)
    re.compile(r"""(?P<keep>(?:proxy-)?(?:authorization|x-api-key|api-key|x-auth-token|private-token|"""
               r"""x-amz-security-token|cookie)\s*[:=]\s*)(?P<secret>(?:[a-z]+\s+)?[^\s'"\n,)\]]+)""", re.IGNORECASE),
    re.compile(r"(?P<keep>\b(?:bearer|basic)\s+)(?P<secret>" + _VALUE + ")", re.IGNORECASE),
    # user:password@ in a URL
    re.compile(r"""(?P<keep>\b[a-z][a-z0-9+.-]*://[^\s/:@'"]+:)(?P<secret>[^\s/@'"]+)(?=@)""", re.IGNORECASE),
    # name=value (query parameters, environment assignments, --option=value) and --option value whose name says
    # secret (token=, AWS_SECRET_ACCESS_KEY=, X-Amz-Signature=, sig=, --token, --oauth2-bearer)
    re.compile(r"(?P<keep>[\w.-]*(?:" + _SECRET_WORDS + r")[\w.-]*=)(?P<secret>" + _VALUE + ")", re.IGNORECASE),
    re.compile(r"(?P<keep>(?:^|\s)--?[\w-]*(?:" + _SECRET_WORDS + r"|bearer)[\w-]*\s+)(?P<secret>" + _VALUE + ")",
               re.IGNORECASE),
    # curl --user name:password, -u name:password
    re.compile(r"""(?P<keep>(?:--user|-u)(?:\s+|=)['"]?[^\s:'"]+:)(?P<secret>[^\s'"]+)"""),
    # an AWS access key id written out
    re.compile(r"(?P<keep>)\b(?P<secret>(?:AKIA|ASIA)[0-9A-Z]{16})\b"),
]
_ENV_REFERENCE = re.compile(r"(?:\w+\s+)?\$\{?\w+\}?")


def preview(names: List[str], n: int = 3) -> str:
    """The first `n` of `names` for a one-line message, and how many more there are: "a, b, c (+4 more)"."""
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, from its ``st_mode``: "a FIFO", "a folder", "a device", "a socket"."""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def file_problem(path, folder_ok: bool = False) -> Optional[str]:
    """Why `path` cannot be read as a file, in the words an error line puts between what the path is and the path
    ("config file not found: X", "classnames file is not a regular file (a FIFO): X"), or None when it can be read:
    "not found" (also for a link to nothing, said so), "is a folder, not a file" (unless `folder_ok`: a path that
    may name a folder), "is not a regular file (a FIFO)" (a device, a socket), "cannot be read (Permission
    denied)". Checked without opening it, so a FIFO is never waited on. The one description every file-valued
    option gives (--config, --model, --classnames, --templates, --image, shards' --input, init_from...)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "not found (a symbolic link to nothing)" if os.path.islink(path) else "not found"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if stat.S_ISDIR(st.st_mode):
        return None if folder_ok else "is a folder, not a file"
    if not stat.S_ISREG(st.st_mode):
        return f"is not a regular file ({file_kind(st.st_mode)})"
    if not os.access(path, os.R_OK):
        return "cannot be read (Permission denied)"
    return None


def redact(text: str) -> str:
    """`text` with the credentials a ``pipe:`` command or URL can carry replaced by ``***``: HTTP header values
    (``Authorization: Bearer ...``, ``X-Api-Key``, any ``-H``/``--header``), ``user:password@`` in URLs, secret-named
    parameters, variables and options (``token=``, ``AWS_SECRET_ACCESS_KEY=``, ``X-Amz-Signature=``, ``sig=``,
    ``--token``), ``--user name:password`` and AWS access key ids. A value that is only an environment variable
    (``$HF_TOKEN``, ``Bearer $HF_TOKEN``) is kept.

    The one redaction of mmcl: config.yaml, tracker hyper-parameters, warnings and errors all pass through it
    (here, below every package, so that an error redacts its own message).
    """
    if not isinstance(text, str) or not text:
        return text

    def hide(match: "re.Match[str]") -> str:
        if _ENV_REFERENCE.fullmatch(match.group("secret").strip()):
            return match.group(0)
        return match.group("keep") + "***"

    for pattern in _REDACT_PATTERNS:
        text = pattern.sub(hide, text)
    return text


def redact_values(obj: Any) -> Any:
    """A copy of a config dict (or list, or string) with `redact` applied to every string in it."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_values(v) for v in obj)
    return obj


class MmclError(Exception):
    """An error caused by the user's input (config, data, paths), reported without a traceback.

    `everywhere` is set where every process of a multi-process run raises it alike: `cli.main` then prints the
    line on the main process alone (`mmcl.config.is_main_process`), so that it shows once.
    Its message holds no credential: a data source it quotes is shown as `redact` shows it.
    """

    everywhere = False

    def __init__(self, *args):
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class ConfigError(MmclError):
    """A config file, key or value is invalid."""


class DataError(MmclError):
    """Input data is missing, empty or unreadable."""


class CheckpointError(MmclError):
    """A checkpoint or saved model cannot be used."""


class StorageError(MmclError):
    """An output path cannot be written: read-only, no space left, no permission."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files are missing, truncated or altered (it is kept; resume uses an older one)."""


class TrainingError(MmclError):
    """Training cannot go on (e.g. the loss became non-finite)."""


class RunStopped(Exception):
    """Training stopped early on a signal after saving a checkpoint; re-running the same command resumes.

    Not an error: ``cli.main`` prints the message as one line (no ``error:``) and exits with `exit_code`, which
    tells a requeueing script what happened (75, EX_TEMPFAIL from sysexits.h, for SIGTERM/SIGUSR1; 130 for SIGINT).
    """

    everywhere = False  # as `MmclError.everywhere`

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
