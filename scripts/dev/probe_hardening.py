"""Reproduce the probe classes of issue 11 (hardening) against a squeeze checkout; print a markdown table.

    .venv/bin/python scripts/dev/probe_hardening.py --repo DIR [--json OUT] [--timeout 60] [--only 1a,4] [--seed N]

The checkout's CLI runs as ``PYTHONPATH=DIR python -c "from squeeze.cli.app import main; main()" ...`` with
this interpreter, one subprocess per command, each with a wall-clock limit (a hang reads "hung (>60 s)") and
a resident-memory cap (a runaway is killed and reported). Everything happens in a temporary directory that
the script creates and removes: the stories260K model and the calibration text are copied there first,
the artifacts the probes need are built there with ``compress MODEL --recipe rtn-w4``, HF_HOME, TMPDIR and
XDG_CACHE_HOME point there, and children never write bytecode into the checkout. Probe 9 mounts a read-only
tmpfs inside that directory when the system allows it (and unmounts it).

Each probe is one small function returning table rows; a probe that raises is reported as "probe error"
and the run goes on. Rows: probe | command | exit | first ``Error:`` line | wall s | peak RSS MB | verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import random
import re
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

MODEL_SRC = Path("/work/shared/models/stories260K")
TEXT_SRC = Path("/work/shared/corpora/tinystories_sample.txt")
MANIFEST = "squeeze.manifest.json"
SHARD = "model-00001-of-00001.safetensors"
USER_FILES = {
    "thesis.txt": b"chapter 1: a thesis nobody backed up\n",
    "sub/photo.jpg": b"\xff\xd8\xff\xe0 jpeg",
    ".env": b"API_KEY=secret\n",
}
CLI = "from squeeze.cli.app import main; main()"
SEAL = "import sys; from squeeze.format.verify import seal_artifact; seal_artifact(sys.argv[1])"
SMALL_KV = ["--num-samples", "2", "--seq-len", "32"]  # a calibrate-kv run of a few seconds


# ----------------------------------------------------------------------------------------------------------
# Running the CLI


@dataclass
class Outcome:
    """One finished command: exit code, output, wall time, peak RSS, and how it ended."""

    args: list[str]
    rc: int | None
    stdout: str
    stderr: str
    wall: float
    rss_mb: float | None
    timed_out: bool = False
    rss_killed: bool = False

    @property
    def error_line(self) -> str:
        """The first ``Error:`` line (stderr, then stdout), else the last line of a traceback."""
        for text in (self.stderr, self.stdout):
            for line in text.splitlines():
                if line.strip().startswith("Error:"):
                    return line.strip()
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        if any("Traceback (most recent call last)" in ln for ln in lines):
            return lines[-1].strip()
        return ""

    @property
    def hint(self) -> str:
        for line in self.stderr.splitlines():
            if line.strip().startswith("Hint:"):
                return line.strip()
        return ""


class Child:
    """A CLI process in its own session; reaped with wait4 so its peak RSS comes back with its status."""

    def __init__(
        self, ctx: Ctx, args: list[str], cwd: Path, stdin: bytes | None = None, python_code: str = CLI
    ) -> None:
        ctx.count += 1
        stem = ctx.logs / f"{ctx.count:03d}"
        self.args, self.ctx = args, ctx
        self.out_path, self.err_path = stem.with_suffix(".out"), stem.with_suffix(".err")
        with contextlib.ExitStack() as files:
            source: int | BinaryIO = subprocess.DEVNULL
            if stdin is not None:
                stem.with_suffix(".in").write_bytes(stdin)
                source = files.enter_context(open(stem.with_suffix(".in"), "rb"))
            out = files.enter_context(open(self.out_path, "wb"))
            err = files.enter_context(open(self.err_path, "wb"))
            self.started = time.monotonic()
            self.proc = subprocess.Popen(
                [sys.executable, "-c", python_code, *args],
                cwd=cwd,
                env=ctx.env,
                stdin=source,
                stdout=out,
                stderr=err,
                start_new_session=True,
                umask=0o022,
            )
        self.status: int | None = None
        self.rusage: resource.struct_rusage | None = None
        self.ended: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> bool:
        """True once the process has exited (reaped here, with its resource usage)."""
        if self.status is None:
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid:
                self.status, self.rusage, self.ended = status, usage, time.monotonic()
                self.proc.returncode = os.waitstatus_to_exitcode(status)
        return self.status is not None

    def signal(self, signum: int) -> bool:
        """Send ``signum`` to the process's group while it runs; False when it had already exited."""
        if self.poll():
            return False
        os.killpg(self.pid, signum)
        return True

    def rss_mb(self) -> float:
        try:
            with open(f"/proc/{self.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def finish(self, timeout: float | None = None) -> Outcome:
        timeout = self.ctx.timeout if timeout is None else timeout
        timed_out = rss_killed = False
        while not self.poll():
            if time.monotonic() - self.started > timeout:
                timed_out = self.signal(signal.SIGKILL)
            elif self.rss_mb() > self.ctx.rss_cap_mb:
                rss_killed = self.signal(signal.SIGKILL)
            time.sleep(0.02)
        assert self.rusage is not None and self.ended is not None
        return Outcome(
            args=self.args,
            rc=self.proc.returncode,
            stdout=self.out_path.read_text(errors="replace"),
            stderr=self.err_path.read_text(errors="replace"),
            wall=self.ended - self.started,
            rss_mb=self.rusage.ru_maxrss / 1024,
            timed_out=timed_out,
            rss_killed=rss_killed,
        )


# ----------------------------------------------------------------------------------------------------------
# Context: temp dirs, shared inputs, helpers


@dataclass
class Row:
    probe: str
    command: str
    exit: str
    error: str
    wall_s: str
    rss_mb: str
    verdict: str
    hint: str = ""


@dataclass
class Ctx:
    repo: Path
    root: Path
    timeout: float
    rss_cap_mb: float
    rng: random.Random
    env: dict[str, str] = field(default_factory=dict)
    count: int = 0

    def __post_init__(self) -> None:
        self.logs = self.root / "logs"
        self.model = self.root / "model"
        self.text = self.root / "text.txt"
        self.base = self.root / "base-artifact"
        for name in ("logs", "hf_home", "tmp", "cache"):
            (self.root / name).mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SQUEEZE_", "PYTHON"))}
        env.update(
            PYTHONPATH=str(self.repo),
            PYTHONDONTWRITEBYTECODE="1",
            PYTHONUNBUFFERED="1",
            HF_HOME=str(self.root / "hf_home"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TMPDIR=str(self.root / "tmp"),
            XDG_CACHE_HOME=str(self.root / "cache"),
            COLUMNS="10000",  # one rich line per message, so an Error: line is never wrapped
        )
        self.env = env

    # -- places
    def workdir(self, probe: str) -> Path:
        path = self.root / f"p{probe}"
        path.mkdir()
        return path

    def artifact_copy(self, dest: Path) -> Path:
        shutil.copytree(self.base, dest, symlinks=True)
        return dest

    def model_copy(self, dest: Path) -> Path:
        shutil.copytree(self.model, dest, symlinks=True)
        return dest

    # -- running
    def cli(
        self, args: Sequence[object], cwd: Path, stdin: bytes | None = None, timeout: float | None = None
    ) -> Outcome:
        return Child(self, [str(a) for a in args], cwd, stdin).finish(timeout)

    def spawn(self, args: Sequence[object], cwd: Path) -> Child:
        return Child(self, [str(a) for a in args], cwd)

    def seal(self, directory: Path) -> Outcome:
        """Reseal ``directory`` with the checkout's own seal_artifact (its manifest removed first)."""
        (directory / MANIFEST).unlink(missing_ok=True)
        return Child(self, [str(directory)], directory.parent, python_code=SEAL).finish()

    def verifies(self, artifact: Path) -> str:
        if not os.path.lexists(artifact):
            return "NO artifact at the path"
        out = self.cli(["verify", artifact], artifact.parent)
        return "artifact verifies" if out.rc == 0 else f"artifact fails verify (exit {out.rc})"

    # -- rows
    def show(self, args: Sequence[object], cwd: Path | None = None) -> str:
        """The command as a reader would type it: temp paths replaced by MODEL / TEXT / ART / relative names."""
        shown = []
        for arg in map(str, args):
            for path, name in (
                (self.model, "MODEL"),
                (self.text, "TEXT"),
                (self.base, "ART"),
                (self.root / "longtext.txt", "LONGTEXT"),
            ):
                if arg == str(path):
                    arg = name
            if cwd is not None and arg.startswith(f"{cwd}/"):
                arg = arg[len(str(cwd)) + 1 :]
            arg = self.mask(arg)
            if len(arg) > 60:
                arg = f"{arg[:24]}...({len(arg)} chars)"
            shown.append(arg)
        return "squeeze " + shlex.join(shown)

    def mask(self, text: str) -> str:
        """Temp paths in messages as the names the table uses."""
        for path, name in ((self.model, "MODEL"), (self.text, "TEXT"), (self.base, "ART"), (self.root, "$TMP")):
            text = text.replace(str(path), name)
        return text

    def row(
        self,
        probe: str,
        out: Outcome,
        verdict: str = "",
        *,
        cwd: Path | None = None,
        command: str | None = None,
        refuse: bool = False,
    ) -> Row:
        """A table row for ``out``; ``verdict`` (probe-specific) goes first, then how the command ended."""
        ended = classify(out, self.timeout, self.rss_cap_mb, refuse)
        return Row(
            probe=probe,
            command=command or self.show(out.args, cwd),
            exit="timeout" if out.timed_out else ("rss-kill" if out.rss_killed else str(out.rc)),
            error=shorten(self.mask(out.error_line)),
            wall_s=f"{out.wall:.1f}",
            rss_mb=f"{out.rss_mb:.0f}" if out.rss_mb else "",
            verdict=self.mask("; ".join(v for v in (verdict, ended) if v)),
            hint=self.mask(out.hint),
        )


def classify(out: Outcome, timeout: float, cap_mb: float, refuse: bool = False) -> str:
    """How a command ended, in words."""
    notes = []
    if "frame #0" in out.stderr or "frame #0" in out.stdout:
        notes.append("C++ frames in output")
    if out.timed_out:
        state = f"hung (>{timeout:g} s)"
    elif out.rss_killed:
        state = f"memory runaway (killed at >{cap_mb:.0f} MB RSS)"
    elif "internal error" in out.error_line or "Traceback (most recent call last)" in out.stderr:
        state = "internal error"
    elif out.rc is not None and out.rc < 0:
        state = f"killed by {signal.Signals(-out.rc).name}"
    elif out.rc == 0:
        state = "ACCEPTED (exit 0)" if refuse else "ok"
    elif out.rc == 2:
        state = "refused (exit 2)"
    else:
        state = f"failed (exit {out.rc})"
    return "; ".join([state, *notes])


def shorten(text: str, limit: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plant_user_files(directory: Path) -> None:
    for relative, data in USER_FILES.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def user_files_state(directory: Path) -> str:
    gone = [
        r for r, data in USER_FILES.items() if not (directory / r).is_file() or (directory / r).read_bytes() != data
    ]
    return f"DELETED {', '.join(gone)}" if gone else "user files intact"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2) + "\n")


def set_config(artifact: Path, key: str, value: object) -> None:
    edit_json(artifact / "config.json", lambda config: config.__setitem__(key, value))


def root_digest(manifest: dict) -> str:
    """The manifest's root digest (squeeze.format.manifest's formula for its format_version)."""
    from squeeze.format.manifest import FileEntry, root_digest_v2
    from squeeze.format.manifest import root_digest as root_digest_v1

    if manifest.get("format_version") == 1:
        return root_digest_v1([FileEntry(e["path"], e["size"], e["sha256"]) for e in manifest["files"]])
    return root_digest_v2(manifest)


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p for p in os.listdir(parent) if p.startswith(f".{name}."))


def modes(directory: Path) -> str:
    files: dict[str, int] = {}
    for entry in sorted(directory.iterdir()):
        if entry.is_file() and not entry.is_symlink():
            mode = f"{entry.stat().st_mode & 0o777:04o}"
            files[mode] = files.get(mode, 0) + 1
    listed = ", ".join(f"{m} x{n}" for m, n in sorted(files.items()))
    return f"files {listed}; dir {directory.stat().st_mode & 0o777:04o}"


def long_prompt(tokens: int = 600) -> str:
    """A prefix of the corpus of about ``tokens`` tokens of the stories260K tokenizer."""
    text = TEXT_SRC.read_text()
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(MODEL_SRC / "tokenizer.json"))
        encoding = tokenizer.encode(text)
        return text[: encoding.offsets[min(tokens, len(encoding.offsets)) - 1][1]]
    except Exception:  # noqa: BLE001 - no tokenizers: ~2 characters per token on this corpus
        return text[: 2 * tokens]


# ----------------------------------------------------------------------------------------------------------
# Probes: each returns its rows


def probe_overwrite_user_dir(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("1a")
    plant_user_files(d / "out")
    out = ctx.cli(["compress", ctx.model, "-o", "out", "--recipe", "rtn-w4", "--overwrite"], d)
    return [ctx.row("1a compress --overwrite, dir of user files", out, user_files_state(d / "out"), cwd=d)]


def probe_output_dot(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("1b")
    plant_user_files(d)
    out = ctx.cli(["compress", ctx.model, "-o", ".", "--recipe", "rtn-w4", "--overwrite"], d)
    return [ctx.row("1b compress -o . --overwrite (cwd of user files)", out, user_files_state(d), cwd=d)]


def probe_output_is_model(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("1c")
    model = ctx.model_copy(d / "model")
    before = {name: sha256(model / name) for name in ("model.safetensors", "tokenizer.model")}
    out = ctx.cli(["compress", "model", "-o", "model", "--recipe", "rtn-w4", "--overwrite"], d)
    lost = [n for n, h in before.items() if not (model / n).is_file() or sha256(model / n) != h]
    state = f"DELETED/CHANGED {', '.join(lost)}" if lost else "model.safetensors, tokenizer.model intact"
    return [ctx.row("1c compress -o MODEL_COPY --overwrite", out, state, cwd=d)]


def probe_kv_overwrite_user_dir(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("1d")
    plant_user_files(d / "out")
    out = ctx.cli(["calibrate-kv", ctx.base, "-o", "out", "-c", ctx.text, *SMALL_KV, "--overwrite"], d)
    return [ctx.row("1d calibrate-kv -o DIR --overwrite, dir of user files", out, user_files_state(d / "out"), cwd=d)]


def probe_kv_sigkill(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("2")
    art = ctx.artifact_copy(d / "art")
    args = ["calibrate-kv", "art", "-c", ctx.text, *SMALL_KV]
    note = "staging dir never seen: every run finished first"
    for attempt in range(1, 6):
        child = ctx.spawn(args, d)
        seen = None
        while not child.poll() and time.monotonic() - child.started < ctx.timeout:
            if seen is None and any(n.startswith(".art.kv-") and n.endswith(".partial") for n in os.listdir(d)):
                seen = time.monotonic()
                delay = ctx.rng.uniform(0.0, 0.02)
                time.sleep(delay)
                landed = child.signal(signal.SIGKILL)
                note = f"SIGKILL {delay * 1000:.0f} ms after the staging dir appeared (attempt {attempt})" + (
                    "" if landed else ", but the run had already exited"
                )
                break
            time.sleep(0.0005)
        killed = child.finish()
        if seen is not None:
            break
    state = ctx.verifies(art)
    left = leftovers(d, "art")
    rows = [
        ctx.row(
            "2a calibrate-kv SIGKILLed mid-swap, then verify",
            killed,
            f"{note}; {state}; left: {', '.join(left) or 'nothing'}",
            cwd=d,
            command=ctx.show(args, d) + " & SIGKILL; squeeze verify art",
        )
    ]
    again = ctx.cli(args, d)
    left = leftovers(d, "art")
    rows.append(
        ctx.row(
            "2b next calibrate-kv cleans staging",
            again,
            f"{'LEFT ' + ', '.join(left) if left else 'no .art.* leftovers'}; {ctx.verifies(art)}",
            cwd=d,
        )
    )
    return rows


def probe_publish_leftover(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("3")
    art = ctx.artifact_copy(d / "art")
    groups = art / ".squeeze-work" / "groups"
    groups.mkdir(parents=True)
    shutil.copyfile(art / SHARD, groups / "00000.safetensors")
    check = ctx.cli(["verify", "art"], d)
    rows = [
        ctx.row(
            "3a artifact + .squeeze-work/groups/00000 -> verify",
            check,
            "fails as expected" if check.rc else "PASSES with extra files",
            cwd=d,
        )
    ]
    rerun = ctx.cli(["compress", ctx.model, "-o", "art", "--recipe", "rtn-w4"], d)
    work = "work area gone" if not (art / ".squeeze-work").exists() else "work area still there"
    rows.append(ctx.row("3b rerun the same compress", rerun, f"then: {ctx.verifies(art)}, {work}", cwd=d))
    return rows


def probe_fifo(ctx: Ctx) -> list[Row]:
    """A FIFO in place of the manifest (the brief), then of config.json (the issue's memory-estimate read)."""
    rows = []
    for probe, name in (("4", MANIFEST), ("4'", "config.json")):
        d = ctx.workdir(f"{probe}abc")
        art = ctx.artifact_copy(d / "art")
        (art / name).unlink()
        os.mkfifo(art / name)
        commands: dict[str, list[object]] = {
            "a": ["run", "Once", "-m", "art", "-n", "2"],
            "b": ["eval", "art", "--text", ctx.text, "--max-windows", "1"],
            "c": ["calibrate-kv", "art", "-c", ctx.text, *SMALL_KV],
        }
        for letter, args in commands.items():
            rows.append(
                ctx.row(f"{probe[0]}{letter}{probe[1:]} FIFO {name}: {args[0]}", ctx.cli(args, d), cwd=d, refuse=True)
            )
    return rows


def probe_config_dev_zero(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("4d")
    art = ctx.artifact_copy(d / "art")
    (art / "config.json").unlink()
    os.symlink("/dev/zero", art / "config.json")
    out = ctx.cli(["run", "Once", "-m", "art", "-n", "2"], d)
    return [ctx.row("4d config.json -> /dev/zero: run", out, cwd=d, refuse=True)]


def probe_sparse_manifest(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("4ef")
    art = ctx.artifact_copy(d / "art")
    with open(art / MANIFEST, "r+b") as manifest:
        manifest.truncate(0)
        manifest.truncate(2**30)
    return [
        ctx.row("4e 1 GiB sparse manifest: verify", ctx.cli(["verify", "art"], d), cwd=d, refuse=True),
        ctx.row(
            "4f 1 GiB sparse manifest: run", ctx.cli(["run", "Once", "-m", "art", "-n", "2"], d), cwd=d, refuse=True
        ),
    ]


def probe_tampered_config(ctx: Ctx) -> list[Row]:
    rows = []
    cases = [
        ("5a", "num_hidden_layers", 20000),
        ("5b", "num_hidden_layers", 1000000),
        ("5c", "vocab_size", 1000000000000),
    ]
    for probe, key, value in cases:
        d = ctx.workdir(probe)
        art = ctx.artifact_copy(d / "art")
        set_config(art, key, value)
        out = ctx.cli(["run", "Once", "-m", "art", "-n", "2"], d)
        rows.append(ctx.row(f"{probe} config {key}={value} (not resealed): run", out, cwd=d, refuse=True))
    return rows


def probe_resealed_config(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("5d")
    art = ctx.artifact_copy(d / "art")
    set_config(art, "num_hidden_layers", 20000)
    sealed = ctx.seal(art)
    if sealed.rc != 0:
        return [ctx.row("5d reseal after num_hidden_layers=20000", sealed, "seal_artifact failed")]
    out = ctx.cli(["run", "Once", "-m", "art", "-n", "2"], d)
    named = "FormatError-like message" if out.rc == 2 and "internal error" not in out.error_line else ""
    return [ctx.row("5d config num_hidden_layers=20000 RESEALED: run", out, named, cwd=d, refuse=True)]


def probe_nested_manifest(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("6ab")
    art = ctx.artifact_copy(d / "art")
    (art / MANIFEST).write_text("[" * 100000 + "]" * 100000)
    return [
        ctx.row(
            "6a manifest nested 100,000 deep: run",
            ctx.cli(["run", "Once", "-m", "art", "-n", "2"], d),
            cwd=d,
            refuse=True,
        ),
        ctx.row(
            "6b manifest nested 100,000 deep: eval",
            ctx.cli(["eval", "art", "--text", ctx.text, "--max-windows", "1"], d),
            cwd=d,
            refuse=True,
        ),
    ]


def probe_digest_newline(ctx: Ctx) -> list[Row]:
    rows = []
    d = ctx.workdir("6c")
    art = ctx.artifact_copy(d / "art")

    def sha_newline(m: dict) -> None:
        m["files"][0]["sha256"] += "\n"
        m["root_digest"] = root_digest(m)

    edit_json(art / MANIFEST, sha_newline)
    out = ctx.cli(["verify", "art"], d)
    parsed = "parser rejects it" if out.rc == 2 else "parser accepts it"
    rows.append(ctx.row("6c sha256 + '\\n' (root recomputed): verify", out, parsed, cwd=d, refuse=True))

    d = ctx.workdir("6d")
    art = ctx.artifact_copy(d / "art")
    edit_json(art / MANIFEST, lambda m: m.__setitem__("root_digest", m["root_digest"] + "\n"))
    out = ctx.cli(["verify", "art"], d)
    parsed = "parser rejects it" if out.rc == 2 else "parser accepts it"
    rows.append(ctx.row("6d root_digest + '\\n': verify", out, parsed, cwd=d, refuse=True))
    return rows


def probe_huge_shape(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("6ef")
    art = ctx.artifact_copy(d / "art")
    name = set_empty_huge_shape(art / SHARD)
    sealed = ctx.seal(art)
    if sealed.rc != 0:
        return [ctx.row("6e reseal after shape [0, 2^64]", sealed, "seal_artifact failed")]
    note = f"{name} declared [0, 2^64] (0 bytes), resealed"
    return [
        ctx.row("6e shard header shape [0, 2^64]: verify", ctx.cli(["verify", "art"], d), note, cwd=d, refuse=True),
        ctx.row(
            "6f shard header shape [0, 2^64]: run",
            ctx.cli(["run", "Once", "-m", "art", "-n", "2"], d),
            cwd=d,
            refuse=True,
        ),
    ]


def set_empty_huge_shape(shard: Path) -> str:
    """Give the first norm weight the shape [0, 2^64] (0 bytes), dropping its bytes and shifting the rest."""
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    metadata = header.pop("__metadata__", None)
    name = min(k for k in header if k.endswith("norm.weight"))
    begin, end = header[name]["data_offsets"]
    data = data[:begin] + data[end:]
    for entry in header.values():
        if entry["data_offsets"][0] >= end:
            entry["data_offsets"] = [o - (end - begin) for o in entry["data_offsets"]]
    header[name] = {"dtype": header[name]["dtype"], "shape": [0, 2**64], "data_offsets": [begin, begin]}
    if metadata is not None:
        header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return name


REMOTE_CODE = """import pathlib
pathlib.Path({marker!r}).write_text("{module} was imported\\n")
from transformers import {base}
class {cls}({base}):
    model_type = "{model_type}"
"""


def probe_remote_code(ctx: Ctx) -> list[Row]:
    """auto_map alone (model_type llama stays: transformers has the class), then with an unknown model_type."""
    rows = []
    for probe, model_type in (("7a", None), ("7b", "x_custom")):
        d = ctx.workdir(probe)
        model = ctx.model_copy(d / "model")
        marker = d / "REMOTE_CODE_RAN"

        def edit(config: dict, model_type: str | None = model_type) -> None:
            config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
            if model_type:
                config["model_type"] = model_type

        edit_json(model / "config.json", edit)
        for module, base, cls in (
            ("configuration_x", "PretrainedConfig", "XConfig"),
            ("modeling_x", "PreTrainedModel", "XModel"),
        ):
            (model / f"{module}.py").write_text(
                REMOTE_CODE.format(
                    marker=str(marker), module=module, base=base, cls=cls, model_type=model_type or "llama"
                )
            )
        out = ctx.cli(["compress", "model", "-o", "out", "--recipe", "rtn-w4", "--json"], d, stdin=b"y\n")
        prompt = "[y/N] PROMPT on stdout" if "[y/N]" in out.stdout else "no prompt"
        try:
            json.loads(out.stdout)
            stdout = "stdout is JSON"
        except ValueError:
            stdout = "stdout is not JSON" if out.stdout.strip() else "stdout empty"
        ran = "REMOTE CODE RAN (marker written)" if marker.exists() else "no marker (code not run)"
        what = "auto_map" + (f" + model_type {model_type}" if model_type else " (model_type llama)")
        rows.append(ctx.row(f"{probe} {what}, stdin 'y': compress --json", out, f"{prompt}; {stdout}; {ran}", cwd=d))
    return rows


def probe_symlinked_artifact(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("8")
    ctx.artifact_copy(d / "v3")
    os.symlink("v3", d / "current")
    commands = {
        "8a current -> v3: verify": ["verify", "current"],
        "8b current -> v3: inspect": ["inspect", "current"],
        "8c current -> v3: run": ["run", "Once", "-m", "current", "-n", "2"],
    }
    return [ctx.row(name, ctx.cli(args, d), cwd=d) for name, args in commands.items()]


def probe_read_only_output(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("9")
    ro = d / "ro"
    ro.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=False, capture_output=True, text=True
    )
    if mount.returncode != 0:
        reason = f"cannot make a read-only mount here ({shorten(mount.stderr, 60)})"
        return [Row("9 read-only output", "mount -t tmpfs -o ro tmpfs DIR", "-", "", "", "", f"skipped: {reason}")]
    try:
        compress = ctx.cli(["compress", ctx.model, "-o", "ro", "--recipe", "rtn-w4"], d)
        kv = ctx.cli(["calibrate-kv", ctx.base, "-o", "ro/kv", "-c", ctx.text], d)
    finally:
        subprocess.run(["umount", str(ro)], check=False)
    return [
        ctx.row("9a compress -o READ_ONLY_DIR", compress, cwd=d, refuse=True),
        ctx.row("9b calibrate-kv -o READ_ONLY_DIR/kv (full text)", kv, cwd=d, refuse=True),
    ]


def probe_inspect_symlinks(ctx: Ctx) -> list[Row]:
    rows = []
    for probe, name in (("10a", "config.json"), ("10b", SHARD)):
        d = ctx.workdir(probe)
        art = ctx.artifact_copy(d / "art")
        real = f"real-{name}"
        os.rename(art / name, art / real)
        os.symlink(real, art / name)
        out = ctx.cli(["inspect", "art"], d)
        rows.append(ctx.row(f"{probe} inspect, {name} -> {real} inside the artifact", out, cwd=d))
    return rows


def probe_deep_path(ctx: Ctx) -> list[Row]:
    """inspect on the deepest of 1500 nested dirs (empty: no manifest), and on a missing name inside it."""
    d = ctx.workdir("10c")
    deep = "deep"
    rows = []
    try:
        for _ in range(1501):  # os.makedirs and shutil.rmtree recurse per level: too deep for them
            os.mkdir(d / deep)
            deep += "/a"
        deep = deep[: -len("/a")]
        for probe, target in (("10c", deep), ("10c'", f"{deep}/missing")):
            out = ctx.cli(["inspect", target], d)
            longest = max((len(line) for line in (out.stderr + out.stdout).splitlines()), default=0)
            note = f"Error: line {len(out.error_line)} chars, longest output line {longest}"
            shown = "squeeze inspect deep/a/a/...(1500 levels)" + target[len(deep) :]
            rows.append(
                ctx.row(
                    f"{probe} inspect on a path 1500 dirs deep{target[len(deep) :]}", out, note, cwd=d, command=shown
                )
            )
    finally:
        while deep:  # from the deepest level that exists, up
            if (d / deep).is_dir():
                os.rmdir(d / deep)
            deep = os.path.dirname(deep)
    return rows


def probe_kv_dot(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("10d")
    art = ctx.artifact_copy(d / "art")
    out = ctx.cli(["calibrate-kv", ".", "-c", ctx.text, *SMALL_KV], art)
    return [ctx.row("10d calibrate-kv . (cwd = artifact)", out, f"then: {ctx.verifies(art)}", cwd=art)]


def probe_seq_len(ctx: Ctx) -> list[Row]:
    """TEXT (1.9k tokens) holds one 1024-token window; for 100000 a 60x repeat of it (LONGTEXT, ~113k tokens)."""
    rows = []
    long_text = ctx.root / "longtext.txt"
    long_text.write_text(ctx.text.read_text() * 60)
    cases = [("11a", 1024, ctx.text), ("11b", 100000, long_text)]
    for probe, seq, text in cases:
        d = ctx.workdir(probe)
        out = ctx.cli(["compress", ctx.model, "-o", "out", "--recipe", "w4", "-c", text, "--seq-len", seq], d)
        rows.append(ctx.row(f"{probe} compress --seq-len {seq} (context 512)", out, cwd=d, refuse=True))
    for probe, seq, text in (("11c", 1024, ctx.text), ("11d", 100000, long_text)):
        d = ctx.workdir(probe)
        ctx.artifact_copy(d / "art")
        out = ctx.cli(["calibrate-kv", "art", "-c", text, "--seq-len", seq], d)
        rows.append(ctx.row(f"{probe} calibrate-kv --seq-len {seq} (context 512)", out, cwd=d, refuse=True))
    return rows


def probe_long_prompt(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("12ab")
    ctx.artifact_copy(d / "art")
    prompt = long_prompt(600)
    out = ctx.cli(["run", prompt, "-m", "art", "-n", "5"], d)
    rows = [ctx.row("12a run, ~600-token prompt, -n 5", out, f"hint: {shorten(out.hint, 90) or 'none'}", cwd=d)]
    suggested = re.search(r"use --max-new-tokens (\d+)", out.hint + out.error_line)
    if suggested:
        follow = ctx.cli(["run", prompt, "-m", "art", "-n", suggested.group(1)], d)
        rows.append(ctx.row(f"12b follow the hint: -n {suggested.group(1)}", follow, cwd=d))
    else:
        rows.append(
            Row("12b follow the hint", "-", "-", "", "", "", "hint suggests no --max-new-tokens: nothing to follow")
        )
    return rows


def probe_sigint_resume(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("12cd")
    args = [
        "compress",
        ctx.model,
        "-o",
        "out",
        "--recipe",
        "w4",
        "-c",
        ctx.text,
        "--num-samples",
        "64",
        "--seq-len",
        "256",
    ]
    child = ctx.spawn(args, d)
    work = d / "out" / ".squeeze-work"
    # past preflight and the lock, loading (the fingerprint is written inside the signal guard), nothing committed
    while not child.poll() and not (time.monotonic() - child.started >= 1.5 and (work / "fingerprint.json").exists()):
        time.sleep(0.01)
    state = sorted(os.listdir(work)) if work.is_dir() else []
    committed = sorted(os.listdir(work / "groups")) if (work / "groups").is_dir() else []
    sent = child.signal(signal.SIGINT)
    at = time.monotonic() - child.started
    out = child.finish()
    when = (
        f"SIGINT at {at:.1f} s (work area: {', '.join(state)}; {len(committed)} group(s) committed)"
        if sent
        else "the run finished before SIGINT"
    )
    found = re.search(r"resume with: (.+)$", out.stderr, re.MULTILINE) or re.search(
        r"(squeeze \S+ .*--resume.*)$", out.stderr, re.MULTILINE
    )
    words = shlex.split(found.group(1)) if found else []
    words = words[1:] if words[:1] == ["squeeze"] else words
    printed = (
        f"printed: {ctx.show(words, d)}"
        if words
        else f"no resume command printed ({shorten(out.hint, 80) or 'no hint'})"
    )
    rows = [
        ctx.row(
            "12c compress, SIGINT before any commit",
            out,
            f"{when}; {printed}",
            cwd=d,
            command=ctx.show(args, d) + " & SIGINT",
        )
    ]
    if words:
        resumed = ctx.cli(words, d)
        first = next((ln.strip() for ln in (resumed.stderr + resumed.stdout).splitlines() if ln.strip()), "")
        rows.append(ctx.row("12d run the printed resume command", resumed, f"first line: {shorten(first, 80)}", cwd=d))
    return rows


def probe_eval_missing_baseline(ctx: Ctx) -> list[Row]:
    """Compared with eval alone and with a missing main model: did the main model load before the error?"""
    d = ctx.workdir("12e")
    ctx.artifact_copy(d / "art")
    plain = ctx.cli(["eval", "art", "--text", ctx.text], d)
    missing = ctx.cli(["eval", "no-such-model", "--text", ctx.text], d)
    out = ctx.cli(["eval", "art", "--text", ctx.text, "--baseline", "/no/such/path"], d)
    loaded = (out.rss_mb or 0) > ((plain.rss_mb or 0) + (missing.rss_mb or 0)) / 2
    note = (
        f"{'main model loaded first' if loaded else 'refused before loading the model'} (by RSS); "
        f"eval alone: {plain.wall:.1f} s, {plain.rss_mb:.0f} MB; missing main model: {missing.wall:.1f} s, "
        f"{missing.rss_mb:.0f} MB"
    )
    return [ctx.row("12e eval --baseline /no/such/path", out, note, cwd=d, refuse=True)]


def probe_modes(ctx: Ctx) -> list[Row]:
    d = ctx.workdir("13")
    out = ctx.cli(["compress", ctx.model, "-o", "art", "--recipe", "rtn-w4"], d)
    rows = [ctx.row("13a umask 022: modes after compress", out, modes(d / "art") if out.rc == 0 else "", cwd=d)]
    if out.rc == 0:
        kv = ctx.cli(["calibrate-kv", "art", "-c", ctx.text, *SMALL_KV], d)
        rows.append(ctx.row("13b umask 022: modes after calibrate-kv", kv, modes(d / "art"), cwd=d))
    return rows


PROBES: list[tuple[str, Callable[[Ctx], list[Row]]]] = [
    ("1a", probe_overwrite_user_dir),
    ("1b", probe_output_dot),
    ("1c", probe_output_is_model),
    ("1d", probe_kv_overwrite_user_dir),
    ("2", probe_kv_sigkill),
    ("3", probe_publish_leftover),
    ("4abc", probe_fifo),
    ("4d", probe_config_dev_zero),
    ("4ef", probe_sparse_manifest),
    ("5abc", probe_tampered_config),
    ("5d", probe_resealed_config),
    ("6ab", probe_nested_manifest),
    ("6cd", probe_digest_newline),
    ("6ef", probe_huge_shape),
    ("7", probe_remote_code),
    ("8", probe_symlinked_artifact),
    ("9", probe_read_only_output),
    ("10ab", probe_inspect_symlinks),
    ("10c", probe_deep_path),
    ("10d", probe_kv_dot),
    ("11", probe_seq_len),
    ("12ab", probe_long_prompt),
    ("12cd", probe_sigint_resume),
    ("12e", probe_eval_missing_baseline),
    ("13", probe_modes),
]


# ----------------------------------------------------------------------------------------------------------
# Driver


def setup(ctx: Ctx) -> Outcome:
    """Copy the model and text into the temp dir and build the shared rtn-w4 artifact."""
    shutil.copytree(MODEL_SRC, ctx.model, symlinks=True)
    shutil.copyfile(TEXT_SRC, ctx.text)
    return ctx.cli(["compress", ctx.model, "-o", ctx.base, "--recipe", "rtn-w4"], ctx.root)


def describe_repo(repo: Path) -> str:
    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(repo), *args], check=False, capture_output=True, text=True
        )
        return done.stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("log", "-1", "--oneline") + (f" (+{len(dirty.splitlines())} modified tracked files)" if dirty else "")


def markdown(rows: list[Row]) -> str:
    def cell(text: str, code: bool = False) -> str:
        text = " ".join(str(text).split()).replace("|", "\\|")
        return f"`{text}`" if code and text and "`" not in text else text

    lines = [
        "| probe | command | exit | first `Error:` line | wall s | peak RSS MB | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    cell(r.probe),
                    cell(r.command, code=True),
                    cell(r.exit),
                    cell(r.error),
                    cell(r.wall_s),
                    cell(r.rss_mb),
                    cell(r.verdict),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def selected(only: str | None) -> list[tuple[str, Callable[[Ctx], list[Row]]]]:
    if not only:
        return PROBES
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    return [(key, fn) for key, fn in PROBES if any(key == w or key.startswith(w) for w in wanted)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="squeeze checkout whose CLI is probed")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per command before 'hung'")
    parser.add_argument("--rss-cap-mb", type=float, default=6144.0, help="kill a command above this RSS")
    parser.add_argument("--only", help="comma-separated probe keys or prefixes, e.g. 1,4abc,12cd")
    parser.add_argument("--seed", type=int, help="seed for the random SIGKILL moment (default: random)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (for debugging)")
    options = parser.parse_args()

    repo = options.repo.resolve()
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # started in the background by a shell: children
        signal.signal(signal.SIGINT, signal.default_int_handler)  # would inherit the ignore (probe 12c)
    seed = options.seed if options.seed is not None else random.SystemRandom().randrange(2**31)
    root = Path(tempfile.mkdtemp(prefix="squeeze-probes-"))
    ctx = Ctx(repo=repo, root=root, timeout=options.timeout, rss_cap_mb=options.rss_cap_mb, rng=random.Random(seed))
    started = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    rows: list[Row] = []
    try:
        where = Child(ctx, [], root, python_code="import squeeze; print(squeeze.__file__)").finish()
        imported = where.stdout.strip()
        if not imported.startswith(f"{repo}/"):
            print(f"squeeze imports from {imported or where.stderr.strip()!r}, not from {repo}", file=sys.stderr)
            return 2
        base = setup(ctx)
        rows.append(ctx.row("0 build ART: compress MODEL --recipe rtn-w4", base, cwd=root))
        if base.rc != 0:
            print(f"building the base artifact failed: {base.error_line or base.stderr[-400:]}", file=sys.stderr)
        else:
            for key, probe in selected(options.only):
                print(f"probe {key} ...", file=sys.stderr, flush=True)
                try:
                    rows.extend(probe(ctx))
                except Exception as exc:  # noqa: BLE001 - one broken probe must not end the run
                    rows.append(
                        Row(key, "-", "-", "", "", "", f"probe error: {type(exc).__name__}: {shorten(str(exc), 120)}")
                    )
    finally:
        if options.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    commit = describe_repo(repo)
    print(f"## squeeze hardening probes: {repo} at {commit}\n")
    print(
        f"{started}, python {sys.version.split()[0]}, timeout {options.timeout:g} s per command, "
        f"RSS cap {options.rss_cap_mb:.0f} MB, seed {seed}\n"
    )
    print(markdown(rows))
    if options.json:
        options.json.write_text(
            json.dumps(
                {
                    "repo": str(repo),
                    "commit": commit,
                    "started": started,
                    "python": sys.version.split()[0],
                    "timeout_s": options.timeout,
                    "rss_cap_mb": options.rss_cap_mb,
                    "seed": seed,
                    "rows": [asdict(r) for r in rows],
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
