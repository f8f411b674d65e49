import signal
import subprocess
import sys
import textwrap
import time

import pytest

from squeeze.format.atomic import atomic_write_bytes, atomic_writer

OLD = b"old" * 1000


def test_atomic_write_replaces_content(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(OLD)
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_exception_keeps_the_old_file_and_removes_the_temp(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(OLD)
    with pytest.raises(RuntimeError):
        with atomic_writer(target) as handle:
            handle.write(b"half")
            raise RuntimeError
    assert target.read_bytes() == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


WRITER = textwrap.dedent(
    """
    import sys, torch
    from squeeze.format.atomic import atomic_write_bytes
    from squeeze.format.shards import ShardWriter
    target, shards = sys.argv[1], sys.argv[2]
    print("ready", flush=True)
    payload = bytes(range(256)) * (64 * 1024)  # 16 MiB, written over and over
    writer = ShardWriter(shards, 4 * 2**20)
    i = 0
    while True:
        atomic_write_bytes(target, payload)
        writer.add(f"t{i}", torch.zeros(2**20))
        i += 1
    """
)


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.8])
def test_killed_writer_never_leaves_a_partial_file_under_a_final_name(tmp_path, delay):
    target = tmp_path / "final.bin"
    target.write_bytes(OLD)
    shards = tmp_path / "shards"
    shards.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(shards)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    content = target.read_bytes()
    assert content in (OLD, bytes(range(256)) * (64 * 1024))
    # shards only ever receive their final names at close(), which the killed writer never reached: only
    # hidden temps remain, ours (.NAME.*.partial) or the one safetensors >= 0.8 writes before its own rename
    # (.tmpXXXXXX, inside our temp's directory)
    assert all(p.name.endswith(".partial") or p.name.startswith(".tmp") for p in shards.iterdir())
