"""A sender's shared memory is freed by ``close()``, by its ``with`` block, and, when
neither ran, when it is collected or its process exits: no segment is left in
/dev/shm and Python's resource tracker has nothing to warn about.

Each case runs a trainer in a fresh interpreter (the tracker's warning is printed
when that interpreter exits) that prints its buffers' segment names.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_TRAINER = """
import gc, sys
from kvrunner.weight_sync import BucketSender

how = sys.argv[1]
sender = BucketSender(device="cpu", bucket_bytes=1 << 20)
names = [buffer.share().payload for buffer in sender._buffers]
print(" ".join(names), flush=True)
if how == "close":
    sender.close()
    sender.close()  # idempotent
elif how == "with":
    with BucketSender(device="cpu", bucket_bytes=1 << 20) as other:
        more = [buffer.share().payload for buffer in other._buffers]
    print(" ".join(more), flush=True)
    sender.close()
elif how == "dropped":
    del sender
    gc.collect()
print("gone:", all(not __import__("os").path.exists("/dev/shm/" + n) for n in names),
      flush=True)
"""

LEAK_WARNING = "leaked shared_memory"


def _run(how: str) -> tuple[list[str], str, str]:
    done = subprocess.run([sys.executable, "-c", _TRAINER, how], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    names = [n for line in lines if not line.startswith("gone:") for n in line.split()]
    return names, lines[-1], done.stderr


@pytest.mark.parametrize("how", ["close", "with", "dropped", "never_closed"])
def test_no_shared_memory_outlives_the_sender(how: str) -> None:
    names, gone, stderr = _run(how)
    assert len(names) == (4 if how == "with" else 2)
    assert LEAK_WARNING not in stderr, stderr
    assert not [n for n in names if Path("/dev/shm", n).exists()]
    if how != "never_closed":  # freed at once, not only at the process's exit
        assert gone == "gone: True", (gone, stderr)
