"""Archive readers under hard limits: mutated bundles and zstd bombs in a capped subprocess.

The property tests fuzz the readers in process; here the same kind of inputs go through the
bundle reader in a child whose address space is capped at its size at start + 256 MiB and whose
CPU time is capped, so a reader that trusted a declared size or looped would be killed. Every
input must end as a result or a BundleFormatError.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from tests.test_bundle_reader import CLI_CORPUS, GOOD, zst

_SCRIPT = """
import resource, sys
from packer.runtime.bundle_reader import Bundle, BundleFormatError
vm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize:')) * 1024
cap = vm + 256 * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
resource.setrlimit(resource.RLIMIT_CPU, (60, 60))
for p in sys.argv[1:]:
    try:
        Bundle.open(p, max_bytes=64 * 2**20)
        print('ok')
    except BundleFormatError:
        print('refused')
"""


def test_bundle_reader_stays_within_limits(tmp_path: Path) -> None:
    import zstandard

    inputs = {f"corpus-{k}": v[0] for k, v in CLI_CORPUS.items()}
    inputs["zeros-1gib-declared"] = zstandard.ZstdCompressor(level=1).compress(b"\0" * (1 << 30))
    rng = random.Random(7)
    good = zst(GOOD)
    for i in range(60):
        data = bytearray(good)
        for _ in range(1 + i % 4):
            data[rng.randrange(len(data))] = rng.randrange(256)
        inputs[f"mutated-{i}"] = bytes(data)
    paths = []
    for name, data in inputs.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *paths], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = proc.stdout.split()
    assert len(results) == len(paths) and set(results) <= {"ok", "refused"}
    assert results[list(inputs).index("zeros-1gib-declared")] == "refused"
