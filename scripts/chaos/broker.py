"""The harness's own broker (scripts/dev-kafka.sh on another port and home): started,
stopped, restarted and wiped under the workers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from chaos.common import DEV_KAFKA, SHARED_BROKER_PORT, HarnessError


class Broker:
    """The harness's own broker: scripts/dev-kafka.sh on another port and home."""

    def __init__(self, port: int, home: Path) -> None:
        if port in (SHARED_BROKER_PORT, SHARED_BROKER_PORT + 1):
            raise HarnessError(f"port {port} belongs to the shared broker; pick another")
        self.port = port
        self.home = home

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PIPELINE_KAFKA_PORT=str(self.port),
            PIPELINE_KAFKA_CONTROLLER_PORT=str(self.port + 1),
            PIPELINE_KAFKA_HOME=str(self.home),
        )
        return env

    def _script(self, command: str, timeout_s: float = 400) -> str:
        done = subprocess.run(
            [str(DEV_KAFKA), command],
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise HarnessError(f"dev-kafka.sh {command} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout.strip()

    def start(self) -> None:
        self._script("start")

    def restart(self) -> None:
        self._script("restart")

    def stop(self) -> None:
        self._script("stop")

    def wipe(self) -> None:
        """A freshly formatted broker: no topics, no internal topics, no groups."""
        self._script("wipe")
        self._script("start")

    def classpath(self) -> str:
        try:
            return self._script("classpath").splitlines()[-1]
        except (HarnessError, IndexError):
            return str(self.home / "libs" / "*")  # dev-kafka.sh without `classpath`


# ---------------------------------------------------------------------------- records
