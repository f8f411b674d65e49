"""Hostile inputs and interruptions against the real CLI, each in a child process (issue 11's probe classes).

What a user or an attacker can do to squeeze from outside: point --overwrite at their own files, kill a
run at the worst moment, put a FIFO, a symlink to /dev/zero, a 1 GiB sparse file or a deeply nested JSON
where a manifest or config belongs, tamper with config.json or a shard header (and reseal), ship a model
that wants its own Python code, pass a context longer than the model's. Each must end in one ``Error:``
line and a clean exit code (never a hang, a memory runaway or a traceback), lose no user data, and leave
every artifact verifiable. Children run with a wall-clock limit and a resident-memory cap; their peak RSS
comes back with their exit status (wait4).

Slow (about 50 CLI processes): deselected from the default run, see conftest.py here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from squeeze.format.manifest import root_digest_v2

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLI = "from squeeze.cli.app import main; main()"
SEAL = "import sys; from squeeze.format.verify import seal_artifact; seal_artifact(sys.argv[1])"
MANIFEST = "squeeze.manifest.json"
SHARD = "model-00001-of-00001.safetensors"
SMALL_KV = ["--num-samples", "2", "--seq-len", "32"]  # a calibrate-kv run of a few seconds
TIMEOUT_S = 120.0
RSS_CAP_MB = 4096.0
USER_FILES = {"thesis.txt": b"chapter 1\n", "sub/photo.jpg": b"\xff\xd8\xff\xe0 jpeg", ".env": b"API_KEY=x\n"}


@dataclass
class Outcome:
    """A finished child: exit code (negative: killed by that signal), output, wall time, peak RSS."""

    rc: int
    stdout: str
    stderr: str
    wall_s: float
    rss_mb: float
    timed_out: bool = False
    rss_killed: bool = False

    @property
    def error_line(self) -> str:
        return next((ln.strip() for ln in self.stderr.splitlines() if ln.strip().startswith("Error:")), "")

    @property
    def hint(self) -> str:
        return next((ln.strip() for ln in self.stderr.splitlines() if ln.strip().startswith("Hint:")), "")

    def describe(self) -> str:
        head = f"exit {self.rc}, {self.wall_s:.1f} s, {self.rss_mb:.0f} MB"
        return f"{head}\nstdout: {self.stdout[-800:]}\nstderr: {self.stderr[-1500:]}"


class Child:
    """One CLI process in its own session; reaped with wait4 so its peak RSS comes back with its status."""

    count = 0

    def __init__(self, args: Sequence[object], cwd: Path, env: dict[str, str], code: str = CLI, stdin: bytes = b""):
        Child.count += 1  # output goes to the children's log folder, never into cwd (it may be an artifact)
        logs = Path(env["SQUEEZE_TEST_LOGS"])
        self.out, self.err = logs / f"{Child.count:04d}.out", logs / f"{Child.count:04d}.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.started = time.monotonic()
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, *map(str, args)],
                cwd=cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                start_new_session=True,
                umask=0o022,
            )
        assert self.proc.stdin is not None
        self.proc.stdin.write(stdin)
        self.proc.stdin.close()
        self.status: int | None = None
        self.rusage: Any = None

    def poll(self) -> bool:
        if self.status is None:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                self.status, self.rusage = os.waitstatus_to_exitcode(status), usage
                self.proc.returncode = self.status
        return self.status is not None

    def signal(self, signum: int) -> bool:
        """Send ``signum`` to the child's process group; False when it had already exited."""
        if self.poll():
            return False
        os.killpg(self.proc.pid, signum)
        return True

    def finish(self) -> Outcome:
        timed_out = rss_killed = False
        while not self.poll():
            if time.monotonic() - self.started > TIMEOUT_S:
                timed_out = self.signal(signal.SIGKILL)
            elif _rss_mb(self.proc.pid) > RSS_CAP_MB:
                rss_killed = self.signal(signal.SIGKILL)
            time.sleep(0.02)
        wall = time.monotonic() - self.started
        outcome = Outcome(
            rc=int(self.status or 0),
            stdout=self.out.read_text(errors="replace"),
            stderr=self.err.read_text(errors="replace"),
            wall_s=wall,
            rss_mb=self.rusage.ru_maxrss / 1024,
            timed_out=timed_out,
            rss_killed=rss_killed,
        )
        self.out.unlink()
        self.err.unlink()
        return outcome


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Probe:
    """The world of one test: a work directory, the child environment, the shared model, text and artifact."""

    def __init__(self, root: Path, model: Path, text: Path, base: Path, env: dict[str, str]) -> None:
        self.root, self.model, self.text, self.base, self.env = root, model, text, base, env

    def cli(self, *args: object, cwd: Path | None = None, stdin: bytes = b"") -> Outcome:
        return Child(args, cwd or self.root, self.env, stdin=stdin).finish()

    def spawn(self, *args: object, cwd: Path | None = None) -> Child:
        return Child(args, cwd or self.root, self.env)

    def artifact(self, name: str = "art") -> Path:
        return Path(shutil.copytree(self.base, self.root / name, symlinks=True))

    def seal(self, directory: Path) -> None:
        (directory / MANIFEST).unlink()
        sealed = Child([directory], self.root, self.env, code=SEAL).finish()
        assert sealed.rc == 0, sealed.describe()

    def verifies(self, artifact: Path) -> bool:
        return self.cli("verify", artifact).rc == 0


def refused(out: Outcome, *codes: int) -> None:
    """The command ended in one clean error: an expected exit code, an Error: line, no traceback, no hang."""
    assert not out.timed_out, f"hung past {TIMEOUT_S:g} s\n{out.describe()}"
    assert not out.rss_killed, f"resident memory passed {RSS_CAP_MB:g} MB\n{out.describe()}"
    assert out.rc in codes, out.describe()
    assert out.error_line, out.describe()
    assert "Traceback (most recent call last)" not in out.stderr, out.describe()
    assert "internal error" not in out.error_line, out.describe()


def succeeded(out: Outcome) -> None:
    assert not out.timed_out and out.rc == 0, out.describe()


def plant_user_files(directory: Path) -> None:
    for relative, data in USER_FILES.items():
        (directory / relative).parent.mkdir(parents=True, exist_ok=True)
        (directory / relative).write_bytes(data)


def user_files_intact(directory: Path) -> bool:
    return all((directory / r).is_file() and (directory / r).read_bytes() == d for r, d in USER_FILES.items())


def edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2) + "\n")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path, tinystories_file: Path) -> dict[str, Any]:
    """The model and text copied once, an rtn-w4 artifact built once (by the CLI), the children's env."""
    root = tmp_path_factory.mktemp("hardening")
    model = Path(shutil.copytree(stories_dir, root / "model"))
    text = Path(shutil.copyfile(tinystories_file, root / "text.txt"))
    for name in ("hf_home", "tmp", "logs"):
        (root / name).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQUEEZE_", "PYTHON"))}
    env.update(
        PYTHONPATH=str(REPO),
        PYTHONDONTWRITEBYTECODE="1",
        HF_HOME=str(root / "hf_home"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TMPDIR=str(root / "tmp"),
        COLUMNS="10000",  # one line per message: an Error: line is never wrapped
        SQUEEZE_TEST_LOGS=str(root / "logs"),  # read by Child here, not by squeeze
    )
    base = root / "base"
    built = Child(["compress", model, "-o", base, "--recipe", "rtn-w4"], root, env).finish()
    assert built.rc == 0, built.describe()
    return {"model": model, "text": text, "base": base, "env": env}


@pytest.fixture
def probe(shared: dict[str, Any], tmp_path: Path) -> Probe:
    return Probe(tmp_path, shared["model"], shared["text"], shared["base"], shared["env"])


# -- never delete what squeeze did not write


@pytest.mark.parametrize("case", ["compress into a folder of user files", "compress -o .", "calibrate-kv"])
def test_overwrite_never_deletes_user_files(probe: Probe, case: str) -> None:
    folder = probe.root if case == "compress -o ." else probe.root / "out"
    plant_user_files(folder)
    output = "." if case == "compress -o ." else "out"
    if case == "calibrate-kv":
        out = probe.cli("calibrate-kv", probe.base, "-o", output, "-c", probe.text, *SMALL_KV, "--overwrite")
    else:
        out = probe.cli("compress", probe.model, "-o", output, "--recipe", "rtn-w4", "--overwrite")
    refused(out, 2)
    assert "--overwrite refused" in out.error_line
    assert user_files_intact(folder)


def test_compress_over_its_own_model_is_refused(probe: Probe) -> None:
    model = Path(shutil.copytree(probe.model, probe.root / "model"))
    before = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    out = probe.cli("compress", "model", "-o", "model", "--recipe", "rtn-w4", "--overwrite")
    refused(out, 2)
    assert "never writes over its input" in out.error_line
    assert {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()} == before


# -- interruptions


def test_calibrate_kv_killed_mid_swap_leaves_a_verifiable_artifact(probe: Probe) -> None:
    art = probe.artifact()
    args = ("calibrate-kv", "art", "-c", probe.text, *SMALL_KV)
    for _attempt in range(5):  # kill as soon as the staging directory appears; runs that finish first retry
        child = probe.spawn(*args)
        seen = False
        while not child.poll() and time.monotonic() - child.started < TIMEOUT_S:
            if any(n.startswith(".art.kv-") and n.endswith(".partial") for n in os.listdir(probe.root)):
                seen = child.signal(signal.SIGKILL)
                break
            time.sleep(0.0005)
        child.finish()
        if seen:
            break
    assert probe.verifies(art), "the artifact path must always hold a complete, verifying artifact"
    succeeded(probe.cli(*args))
    assert not [n for n in os.listdir(probe.root) if n.startswith(".art.")], "the next run cleans up"
    assert probe.verifies(art)


def test_compress_interrupted_by_sigint_says_how_to_continue(probe: Probe) -> None:
    args = ["compress", probe.model, "-o", "out", "--recipe", "w4", "-c", probe.text]
    child = probe.spawn(*args, "--num-samples", "8", "--seq-len", "128")
    fingerprint = probe.root / "out" / ".squeeze-work" / "fingerprint.json"
    while not child.poll() and not fingerprint.exists():  # past preflight and the lock: the job has started
        time.sleep(0.01)
    if not child.signal(signal.SIGINT):
        pytest.skip("the run finished before SIGINT could land")
    out = child.finish()
    refused(out, 130)
    found = re.search(r"(?:resume|start again) with: (.+)$", out.stderr, re.MULTILINE)
    assert found, out.describe()
    words = shlex.split(found.group(1))
    assert words[0] == "squeeze", words
    succeeded(probe.cli(*words[1:]))
    assert probe.verifies(probe.root / "out")


def test_a_leftover_work_area_is_passed_over(probe: Probe) -> None:
    art = probe.artifact()
    groups = art / ".squeeze-work" / "groups"
    groups.mkdir(parents=True)
    shutil.copyfile(art / SHARD, groups / "00000.safetensors")
    assert probe.verifies(art)
    refused(probe.cli("compress", probe.model, "-o", "art", "--recipe", "rtn-w4"), 2)
    assert probe.verifies(art)


# -- files that are not what they claim


@pytest.mark.parametrize("name", [MANIFEST, "config.json"])
@pytest.mark.parametrize("command", ["run", "eval", "calibrate-kv"])
def test_a_fifo_in_place_of_a_file_is_refused_without_hanging(probe: Probe, name: str, command: str) -> None:
    art = probe.artifact()
    (art / name).unlink()
    os.mkfifo(art / name)
    args = {
        "run": ["run", "Once", "-m", "art", "-n", "2"],
        "eval": ["eval", "art", "--text", probe.text, "--max-windows", "1"],
        "calibrate-kv": ["calibrate-kv", "art", "-c", probe.text, *SMALL_KV],
    }[command]
    out = probe.cli(*args)
    refused(out, 1, 2)
    assert "not a regular file" in out.error_line


def test_config_linked_to_dev_zero_is_refused(probe: Probe) -> None:
    art = probe.artifact()
    (art / "config.json").unlink()
    os.symlink("/dev/zero", art / "config.json")
    out = probe.cli("run", "Once", "-m", "art", "-n", "2")
    refused(out, 1)
    assert "symbolic link" in out.error_line


@pytest.mark.parametrize("command", ["verify", "run"])
def test_a_huge_sparse_manifest_is_refused_before_reading(probe: Probe, command: str) -> None:
    art = probe.artifact()
    with open(art / MANIFEST, "r+b") as manifest:
        manifest.truncate(0)
        manifest.truncate(2**30)
    out = probe.cli(*(["verify", "art"] if command == "verify" else ["run", "Once", "-m", "art", "-n", "2"]))
    refused(out, 2)
    assert "larger than" in out.error_line
    assert out.rss_mb < 1024, f"read the 1 GiB file? peak RSS {out.rss_mb:.0f} MB"


@pytest.mark.parametrize("command", ["run", "eval"])
def test_a_deeply_nested_manifest_is_refused(probe: Probe, command: str) -> None:
    art = probe.artifact()
    (art / MANIFEST).write_text("[" * 100000 + "]" * 100000)
    args = ["run", "Once", "-m", "art", "-n", "2"] if command == "run" else ["eval", "art", "--text", probe.text]
    out = probe.cli(*args)
    refused(out, 2)
    assert "levels deep" in out.error_line


@pytest.mark.parametrize("field", ["file sha256", "root_digest"])
def test_a_digest_with_a_trailing_newline_is_malformed(probe: Probe, field: str) -> None:
    art = probe.artifact()

    def edit(manifest: dict[str, Any]) -> None:
        if field == "root_digest":
            manifest["root_digest"] += "\n"
        else:
            manifest["files"][0]["sha256"] += "\n"
            manifest["root_digest"] = root_digest_v2(manifest)

    edit_json(art / MANIFEST, edit)
    out = probe.cli("verify", "art")
    refused(out, 2)
    assert "64 lowercase hex digits" in out.error_line


# -- tampering


@pytest.mark.parametrize(("key", "value"), [("num_hidden_layers", 20000), ("vocab_size", 10**12)])
def test_a_tampered_config_fails_verification(probe: Probe, key: str, value: int) -> None:
    art = probe.artifact()
    edit_json(art / "config.json", lambda config: config.__setitem__(key, value))
    out = probe.cli("run", "Once", "-m", "art", "-n", "2")
    refused(out, 1)
    assert "failed verification" in out.error_line


def test_a_resealed_config_that_contradicts_the_tensors_is_refused(probe: Probe) -> None:
    art = probe.artifact()
    edit_json(art / "config.json", lambda config: config.__setitem__("num_hidden_layers", 20000))
    probe.seal(art)
    out = probe.cli("run", "Once", "-m", "art", "-n", "2")
    refused(out, 2)
    assert "num_hidden_layers" in out.error_line
    assert out.rss_mb < 2048


def _empty_huge_shape(shard: Path) -> None:
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


@pytest.mark.parametrize("command", ["verify", "run"])
def test_a_resealed_shard_header_with_an_absurd_shape_is_refused(probe: Probe, command: str) -> None:
    art = probe.artifact()
    _empty_huge_shape(art / SHARD)
    probe.seal(art)
    out = probe.cli(*(["verify", "art"] if command == "verify" else ["run", "Once", "-m", "art", "-n", "2"]))
    refused(out, 1)
    assert "input_layernorm.weight" in out.error_line


REMOTE_CODE = """import pathlib
pathlib.Path({marker!r}).write_text("imported")
from transformers import {base}
class {cls}({base}):
    model_type = "{model_type}"
"""


@pytest.mark.parametrize("model_type", [None, "x_custom"])
def test_a_model_s_own_code_never_runs(probe: Probe, model_type: str | None) -> None:
    """auto_map alone (llama stays a class transformers has: compress works) or with an unknown model_type
    (refused); a 'y' on stdin never answers a trust prompt, and --json's stdout stays JSON or empty."""
    model = Path(shutil.copytree(probe.model, probe.root / "model"))
    marker = probe.root / "REMOTE_CODE_RAN"

    def edit(config: dict[str, Any]) -> None:
        config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
        if model_type:
            config["model_type"] = model_type

    edit_json(model / "config.json", edit)
    for module, base, cls in (
        ("configuration_x", "PretrainedConfig", "XConfig"),
        ("modeling_x", "PreTrainedModel", "XModel"),
    ):
        code = REMOTE_CODE.format(marker=str(marker), base=base, cls=cls, model_type=model_type or "llama")
        (model / f"{module}.py").write_text(code)
    out = probe.cli("compress", "model", "-o", "out", "--recipe", "rtn-w4", "--json", stdin=b"y\n")
    assert not marker.exists(), "the model's own Python ran"
    assert "[y/N]" not in out.stdout + out.stderr
    if model_type is None:
        succeeded(out)
        assert json.loads(out.stdout)["output"]
    else:
        refused(out, 2)
        assert "its own Python code" in out.error_line
        assert out.stdout.strip() == ""


# -- paths


@pytest.mark.parametrize("command", ["verify", "inspect", "run"])
def test_an_artifact_reached_through_a_symlink_works(probe: Probe, command: str) -> None:
    probe.artifact("v3")
    os.symlink("v3", probe.root / "current")
    args = {"verify": ["verify", "current"], "inspect": ["inspect", "current"]}.get(
        command, ["run", "Once", "-m", "current", "-n", "2"]
    )
    succeeded(probe.cli(*args))


def test_a_read_only_output_is_one_error(probe: Probe) -> None:
    read_only = probe.root / "ro"
    read_only.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)], capture_output=True, check=False
    )
    if mount.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        refused(probe.cli("compress", probe.model, "-o", "ro", "--recipe", "rtn-w4"), 2)
        refused(probe.cli("calibrate-kv", probe.base, "-o", "ro/kv", "-c", probe.text, *SMALL_KV), 2)
    finally:
        subprocess.run(["umount", str(read_only)], check=False)


def test_an_error_about_a_very_deep_path_stays_one_short_line(probe: Probe) -> None:
    deep = "deep" + "/a" * 1500
    os.makedirs(probe.root / "deep")
    level = probe.root / "deep"
    for _ in range(1500):  # os.makedirs recurses per level: too deep for it
        level = level / "a"
        os.mkdir(level)
    try:
        out = probe.cli("inspect", f"{deep}/missing")
        refused(out, 2)
        assert len(out.error_line) < 300
    finally:
        while level != probe.root:
            os.rmdir(level)
            level = level.parent


def test_calibrate_kv_on_the_current_directory(probe: Probe) -> None:
    art = probe.artifact()
    succeeded(probe.cli("calibrate-kv", ".", "-c", probe.text, *SMALL_KV, cwd=art))
    assert probe.verifies(art)


# -- limits of the model


@pytest.mark.parametrize("command", ["compress", "calibrate-kv"])
@pytest.mark.parametrize("seq_len", [1024, 100000])
def test_windows_longer_than_the_context_are_refused(probe: Probe, command: str, seq_len: int) -> None:
    text = probe.root / "long.txt"
    text.write_text(probe.text.read_text() * (60 if seq_len > 1024 else 1))
    if command == "compress":
        out = probe.cli("compress", probe.model, "-o", "out", "--recipe", "w4", "-c", text, "--seq-len", seq_len)
    else:
        out = probe.cli("calibrate-kv", probe.base, "-o", "out", "-c", text, "--seq-len", seq_len)
    refused(out, 2)
    assert f"--seq-len {seq_len} exceeds the model's context of 512 tokens" in out.error_line
    assert not (probe.root / "out" / MANIFEST).exists()


def test_a_prompt_longer_than_the_context_gets_a_hint_with_numbers(probe: Probe) -> None:
    probe.artifact()
    out = probe.cli("run", probe.text.read_text()[:1166], "-m", "art", "-n", "5")  # ~600 tokens; context 512
    refused(out, 2)
    assert "the prompt is too long" in out.error_line
    assert "at most 507 tokens for --max-new-tokens 5" in out.hint


def test_a_missing_baseline_is_refused_before_the_model_loads(probe: Probe) -> None:
    probe.artifact()
    import_only = probe.cli("eval", "no-such-model", "--text", probe.text)
    out = probe.cli("eval", "art", "--text", probe.text, "--baseline", "/no/such/path")
    refused(out, 2)
    assert "--baseline" in out.error_line
    # A model load costs a few hundred MB here (torch's threads, transformers' modules); the refusal must not.
    assert out.rss_mb < import_only.rss_mb + 100, (out.rss_mb, import_only.rss_mb)


def test_files_get_the_usual_modes(probe: Probe) -> None:
    succeeded(probe.cli("compress", probe.model, "-o", "art", "--recipe", "rtn-w4"))
    art = probe.root / "art"

    def modes() -> set[int]:
        return {p.stat().st_mode & 0o777 for p in art.iterdir() if p.is_file() and not p.is_symlink()}

    assert modes() == {0o644} and art.stat().st_mode & 0o777 == 0o755
    succeeded(probe.cli("calibrate-kv", "art", "-c", probe.text, *SMALL_KV))
    assert modes() == {0o644} and art.stat().st_mode & 0o777 == 0o755
