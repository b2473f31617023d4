"""Reliability of ``jaxdit convert``: its destination is checked before the source is read, a failed or
interrupted conversion leaves nothing behind (what a killed one left is swept by the next), and every
failure is one clear line with exit code 2 (130 when interrupted, 143 on SIGTERM).
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import flux_tiny
import orbax.checkpoint as ocp
import pytest
from reliability_support import forbid_source_reads, listing, variant

from converters import orbax_io
from converters.errors import CheckpointError
from converters.safetensors_io import write_safetensors
from jaxdit.cli import main as cli_main
from jaxdit.families import convert_checkpoint

REPO = Path(__file__).resolve().parents[1]


def _source() -> Path:
    return flux_tiny.diffusers_folder(False)


def _convert(capsys, *args: str) -> tuple[int, str]:
    code = cli_main(["convert", *map(str, args)])
    return code, capsys.readouterr().err


def _one_clear_line(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("jaxdit convert: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


# ---------------------------------------------------------------------------- the destination, first


def _converted_dst(out: Path) -> Path:
    (out / "dst").mkdir()  # a stand-in for an earlier conversion: jaxdit.json + params/
    (out / "dst" / "params").mkdir()
    (out / "dst" / orbax_io.METADATA_FILE).write_text("{}")
    return out / "dst"


def _file_dst(out: Path) -> Path:
    (out / "dst").write_text("my notes")
    return out / "dst"


def _foreign_folder(out: Path) -> Path:
    (out / "dst").mkdir()
    (out / "dst" / "photo.png").write_bytes(b"not yours")
    return out / "dst"


def _under_a_file(out: Path) -> Path:
    (out / "file").write_text("x")
    return out / "file" / "dst"


def _deep_under_a_file(out: Path) -> Path:
    (out / "file").write_text("x")
    return out / "file" / "a" / "b" / "dst"


# (name, make the destination, extra flags, what the one line must say)
DESTINATIONS = [
    ("exists", _converted_dst, (), "exists; pass --overwrite"),
    ("exists-as-a-file", _file_dst, (), "exists; pass --overwrite"),
    ("overwrite-a-foreign-folder", _foreign_folder, ("--overwrite",), "is not a jaxdit checkpoint"),
    ("overwrite-a-file", _file_dst, ("--overwrite",), "is not a jaxdit checkpoint"),
    ("parent-is-a-file", _under_a_file, (), "is a file, not a folder"),
    ("ancestor-is-a-file", _deep_under_a_file, (), "is a file, not a folder"),
]


@pytest.mark.parametrize(("name", "make", "flags", "says"), DESTINATIONS, ids=[d[0] for d in DESTINATIONS])
def test_bad_destination_fails_before_the_source_is_read(
    name, make, flags, says, tmp_path, capsys, monkeypatch
):
    forbid_source_reads(monkeypatch)
    dst = make(tmp_path)
    before = listing(tmp_path)
    code, err = _convert(capsys, _source(), dst, *flags)
    assert code == 2
    _one_clear_line(err, says)
    assert listing(tmp_path) == before  # untouched: nothing added, nothing replaced


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_parent_fails_before_the_source_is_read(tmp_path, capsys, monkeypatch):
    forbid_source_reads(monkeypatch)
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        code, err = _convert(capsys, _source(), parent / "dst")
    finally:
        parent.chmod(0o755)
    assert code == 2
    _one_clear_line(err, "cannot create anything in", "ro")


def test_unwritable_parent_fails_before_the_source_is_read(tmp_path, capsys, monkeypatch):
    # As root (CI containers) permission bits do not stop writes; the probe's refusal is simulated.
    forbid_source_reads(monkeypatch)

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    code, err = _convert(capsys, _source(), tmp_path / "dst")
    assert code == 2
    _one_clear_line(err, "Permission denied", str(tmp_path))
    assert listing(tmp_path) == []


@pytest.mark.parametrize(
    ("make", "error"),
    [(_converted_dst, FileExistsError), (_under_a_file, CheckpointError)],
    ids=["exists", "parent-is-a-file"],
)
def test_api_checks_the_destination_first(make, error, tmp_path, monkeypatch):
    forbid_source_reads(monkeypatch)
    dst = make(tmp_path)
    with pytest.raises(error, match=str(dst.parent)):
        convert_checkpoint(_source(), dst)


def test_overwrite_may_replace_an_empty_folder(tmp_path, capsys):
    (tmp_path / "dst").mkdir()
    code, _ = _convert(capsys, _source(), tmp_path / "dst", "--overwrite")
    assert code == 0 and orbax_io.is_orbax_checkpoint(tmp_path / "dst")
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]


# ----------------------------------------------------------------------------------- bad sources


def _truncated_source(tmp: Path) -> Path:
    src = variant(_source(), tmp / "src", lambda tensors: None)
    file = src / "diffusion_pytorch_model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    return src


def _nan_source(tmp: Path) -> Path:
    key = "proj_out.weight"

    def edit(tensors):
        tensors[key] = tensors[key].copy()
        tensors[key][0, 0] = float("nan")

    return variant(_source(), tmp / "src", edit)


def _empty_folder(tmp: Path) -> Path:
    (tmp / "src").mkdir()
    return tmp / "src"


def _not_a_checkpoint(tmp: Path) -> Path:
    return write_safetensors(tmp / "src.safetensors", {"x": flux_tiny.state_dict(False)["proj_out.bias"]})


# (name, make the source, what the one line must say)
SOURCES = [
    ("missing", lambda tmp: tmp / "nope", "no such file"),
    ("empty-folder", _empty_folder, "src"),
    ("truncated-safetensors", _truncated_source, "diffusion_pytorch_model.safetensors"),
    ("nan-weight", _nan_source, "'proj_out.weight' holds 1"),
    ("unknown-layout", _not_a_checkpoint, "not a checkpoint of a known model family"),
]


@pytest.mark.parametrize(("name", "make", "says"), SOURCES, ids=[s[0] for s in SOURCES])
def test_bad_source_is_one_line_and_writes_nothing(name, make, says, tmp_path, capsys):
    src = make(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    code, err = _convert(capsys, src, out / "dst")
    assert code == 2
    assert says in err, err
    assert "Traceback" not in err and err.startswith("jaxdit convert: error: "), err
    assert listing(out) == []


def test_integer_dtype_flag_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["convert", str(_source()), str(tmp_path / "dst"), "--dtype", "int32"])
    assert info.value.code == 2 and "invalid choice: 'int32'" in capsys.readouterr().err
    assert listing(tmp_path) == []


# ------------------------------------------------------------------------- failures while writing


def _save_raising(error: BaseException):
    real = ocp.StandardCheckpointer.save

    def save(self, directory, *args, **kwargs):
        real(self, directory, *args, **kwargs)
        self.wait_until_finished()  # half a checkpoint is in the temporary folder now
        raise error

    return save


WRITE_FAILURES = [
    ("disk-full", OSError(errno.ENOSPC, "No space left on device"), "no space left"),
    (
        "disk-full-tensorstore",
        ValueError('RESOURCE_EXHAUSTED: Error writing "a/0": No space left on device [os_error_code=28]'),
        "no space left",
    ),
    ("permission", PermissionError(errno.EACCES, "Permission denied"), "Permission denied"),
    ("read-only-filesystem", OSError(errno.EROFS, "Read-only file system"), "Read-only file system"),
]


@pytest.mark.parametrize(("name", "error", "says"), WRITE_FAILURES, ids=[w[0] for w in WRITE_FAILURES])
def test_write_failure_is_one_line_and_leaves_nothing(name, error, says, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", _save_raising(error))
    code, err = _convert(capsys, _source(), tmp_path / "dst")
    assert code == 2
    _one_clear_line(err, says, str(tmp_path / "dst"))
    assert listing(tmp_path) == []


def test_rename_failure_leaves_nothing(tmp_path, capsys, monkeypatch):
    real = os.rename

    def rename(a, b):
        if ".tmp-" in str(a):
            raise PermissionError(errno.EACCES, "Permission denied", str(b))
        return real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    code, err = _convert(capsys, _source(), tmp_path / "dst")
    assert code == 2
    _one_clear_line(err, "Permission denied")
    assert listing(tmp_path) == []


def test_keyboard_interrupt_while_writing_leaves_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", _save_raising(KeyboardInterrupt()))
    try:
        code = cli_main(["convert", str(_source()), str(tmp_path / "dst")])
    except KeyboardInterrupt:
        code = "raised KeyboardInterrupt"
    assert code == 130
    _one_clear_line(capsys.readouterr().err, "interrupted")
    assert listing(tmp_path) == []


# A conversion in a child process that sends itself a signal once half the checkpoint is written.
_SIGNAL_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import orbax.checkpoint as ocp
    real = ocp.StandardCheckpointer.save
    def save(self, directory, *args, **kwargs):
        real(self, directory, *args, **kwargs)
        self.wait_until_finished()
        os.kill(os.getpid(), int(sys.argv[3]))
        time.sleep(60)
    ocp.StandardCheckpointer.save = save
    from jaxdit.cli import main
    sys.exit(main(["convert", sys.argv[1], sys.argv[2]]))
    """
)


def _child(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, check=False, **kwargs
    )


def test_sigterm_while_writing_leaves_nothing(tmp_path):
    done = _child(["-c", _SIGNAL_SCRIPT, str(_source()), str(tmp_path / "dst"), str(int(signal.SIGTERM))])
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert listing(tmp_path) == []


def test_killed_conversion_is_swept_by_the_next(tmp_path, capsys):
    dst = tmp_path / "dst"
    done = _child(["-c", _SIGNAL_SCRIPT, str(_source()), str(dst), str(int(signal.SIGKILL))])
    assert done.returncode == -signal.SIGKILL
    assert any(".dst.tmp-" in p for p in listing(tmp_path))  # SIGKILL cannot be cleaned up after
    # A temporary folder as jaxdit named them before owners were recorded, also from a killed run.
    (tmp_path / f".dst.tmp-{secrets.token_hex(6)}" / "params").mkdir(parents=True)
    code, _ = _convert(capsys, _source(), dst)
    assert code == 0
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]


def test_running_conversions_folder_is_not_swept(tmp_path, capsys):
    from converters import destination

    # This process is alive: its temporary folder must survive another conversion to the same DST.
    live = tmp_path / f".dst.tmp-{destination._HOST}-{os.getpid()}-{secrets.token_hex(6)}"
    live.mkdir()
    code, _ = _convert(capsys, _source(), tmp_path / "dst")
    assert code == 0 and live.is_dir()


def test_old_checkpoint_parked_by_a_killed_overwrite_is_put_back(tmp_path, capsys):
    from converters import destination

    # Killed between moving the old DST aside and moving the new one in: DST is missing.
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    pid = finished.pid  # a process that is gone
    old = tmp_path / f".dst.old-{destination._HOST}-{pid}-{secrets.token_hex(6)}"
    old.mkdir()
    (old / "params").mkdir()
    (old / orbax_io.METADATA_FILE).write_text("{}")
    code, _ = _convert(capsys, _source(), tmp_path / "dst")
    # The parked checkpoint came back as DST, so the new conversion refuses to overwrite it.
    assert code == 2 and (tmp_path / "dst" / "params").is_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]


# A conversion in a child process whose files may not grow past 256 KiB (failing with EFBIG, as a full
# disk fails with ENOSPC): a real write failure inside orbax's threads, with no root needed to set it up.
_LIMITED_SCRIPT = textwrap.dedent(
    """
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
    from jaxdit.cli import main
    sys.exit(main(["convert", sys.argv[1], sys.argv[2]]))
    """
)


def test_write_failure_inside_orbax_is_one_clear_line(tmp_path):
    done = _child(["-c", _LIMITED_SCRIPT, str(_source()), str(tmp_path / "dst")])  # the data file needs ~7 MB
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(("W0", "I0"))]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("jaxdit convert: error: cannot write") and "past the size limit" in lines[0]
    assert listing(tmp_path) == []


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("patch_size", -3, "patch_size must be >= 1, got -3"),  # was a shape mismatch of some tensor
        ("num_layers", 1000000, "(diffusers' num_layers) 1000000 is beyond 1000 blocks"),  # was 86 s of work
    ],
)
def test_absurd_config_fields_are_named_before_any_work(field, value, says, tmp_path, capsys):
    import json
    import shutil
    import time

    folder = tmp_path / "transformer"
    shutil.copytree(flux_tiny.diffusers_folder(False), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    start = time.monotonic()
    assert cli_main(["convert", str(folder), str(tmp_path / "out")]) == 2
    assert says in capsys.readouterr().err and time.monotonic() - start < 20
    assert not (tmp_path / "out").exists()
