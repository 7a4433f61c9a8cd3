"""`--precision auto` resolved as a worker resolves it, in a process of its own.

When no choice is remembered for the model and device, resolving measures every
candidate precision: OpenVINO's engine processes and torch's thread teams run in the
process that measures. A benchmark that measured in its own process then ran every
torch peer far slower (docs/performance.md: the down-projections in int8), so the
measurement runs in a child, as the benchmark's (a) does.
"""

from __future__ import annotations

import json
import subprocess
import sys

from harness import HarnessError

_CODE = """
import json, sys
from pipeline.core.corpus import sample_texts
from pipeline.model.embedder import pick_device
from pipeline.model.precision import resolve_precision
model, device, precision = sys.argv[1:4]
device = pick_device(device)
print(json.dumps([device, resolve_precision(model, device, precision, lambda: sample_texts(256))]))
"""


def resolved(model: str, device: str, precision: str, timeout_s: float) -> tuple[str, str]:
    """(device, precision), both concrete, as `pipeline run` would pick them here."""
    proc = subprocess.run(
        [sys.executable, "-c", _CODE, model, device, precision],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise HarnessError(f"resolving --precision {precision} failed:\n{proc.stderr[-3000:]}")
    device, precision = json.loads(proc.stdout.strip().splitlines()[-1])
    return device, precision
