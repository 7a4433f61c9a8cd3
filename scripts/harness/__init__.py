"""The parts every benchmark and the chaos runs share, so that each script is a
thin scenario over them:

- `kafka`: a fresh topic, publishing records (JSON or raw values, keys, codecs,
  partitions, a rate), checking they all landed, cleaning up;
- `worker`: a `pipeline run` process with a variant's flags and environment, its
  `done:` line, its first-record time, its CPU (with its children) and peak RSS;
  a load of busy processes beside it;
- `numbers`: medians, percentiles, spreads, and the JSON a run writes.

Scripts in scripts/ import it as `harness` (their own folder is first on the path).
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class HarnessError(RuntimeError):
    """The harness itself could not do something (set-up, a tool it runs): not a
    finding about what it measures or checks. The benchmarks and the chaos runs share
    it."""
