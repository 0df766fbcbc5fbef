"""A real Prometheus server for tests: a free loopback port, a generated config, its HTTP API, then stopped.

The binary is Debian's ``prometheus`` package (``apt-get install -y prometheus``); ``RISKSERVE_PROMETHEUS``
names another binary. Nothing here talks to anything but 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

__all__ = ["PrometheusError", "PrometheusServer", "find_prometheus", "prometheus_version"]

BINARY_ENV = "RISKSERVE_PROMETHEUS"


class PrometheusError(RuntimeError):
    """Prometheus did not start, did not answer or answered with an error."""


def find_prometheus() -> str | None:
    """Path of the Prometheus server binary, or None when it is not installed."""
    configured = os.environ.get(BINARY_ENV)
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("prometheus")


def prometheus_version(binary: str) -> str:
    """The first line of ``prometheus --version``."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False)
    return (done.stdout or done.stderr).splitlines()[0] if (done.stdout or done.stderr) else "unknown"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrometheusServer:
    """One Prometheus process scraping ``targets`` (``HOST:PORT`` of ``/metrics`` pages) in one job.

    Use as a context manager; :meth:`stop` ends only the process this object started::

        with PrometheusServer(binary, ["127.0.0.1:8080"]) as prom:
            prom.wait_for('sum(up{job="ray"})', lambda v: v == 1)
    """

    def __init__(
        self,
        binary: str,
        targets: Sequence[str],
        *,
        scrape_interval_s: float = 1.0,
        job: str = "ray",
        base_job: dict[str, Any] | None = None,
        workdir: Path | None = None,
    ) -> None:
        """Nothing runs until :meth:`start`; ``workdir`` keeps config, data and log (default: a temp dir)."""
        self.binary = binary
        self.targets = list(targets)
        self.scrape_interval_s = scrape_interval_s
        self.base_job = base_job
        self.job = str(base_job["job_name"]) if base_job else job
        """A scrape job (e.g. one of deploy/prometheus.yml) to use with its targets and interval replaced."""
        self._own_workdir = workdir is None
        self.workdir = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix="riskserve-prom-"))
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        """The generated ``prometheus.yml``."""
        interval = f"{max(int(self.scrape_interval_s * 1000), 100)}ms"
        job = {
            **(self.base_job or {"job_name": self.job, "metrics_path": "/metrics"}),
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "static_configs": [{"targets": self.targets}],
        }
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [job],
        }

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        """Start on a free loopback port and wait until ``/-/ready``; a port taken meanwhile is retried."""
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        last_error = ""
        for _attempt in range(3):
            self.port = _free_port()
            data = self.workdir / f"data-{self.port}"
            self._log = (self.workdir / "prometheus.log").open("ab")
            self._process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={data}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
            try:
                self._wait_ready(timeout_s)
                return self
            except PrometheusError as error:
                last_error = str(error)
                self.stop()
        raise PrometheusError(f"Prometheus did not start: {last_error}\n{self.log_tail()}")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise PrometheusError(f"exited with code {self._process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise PrometheusError(f"not ready after {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the process this object started: SIGTERM, then SIGKILL if it does not exit in time."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        """Stop, and remove the temporary work directory this object made."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start() if self._process is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def log_tail(self, lines: int = 20) -> str:
        """The end of Prometheus's own log."""
        path = self.workdir / "prometheus.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>`` and return its ``data``; an error status raises :class:`PrometheusError`."""
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise PrometheusError(f"{url}: HTTP {error.code}: {error.read()[:500]!r}") from error
        if body.get("status") != "success":
            raise PrometheusError(f"{url}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant vector query: ``[{"metric": {labels}, "value": [ts, "v"]}, ...]``."""
        data = self.api("query", query=expr)
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr!r} is a {data['resultType']}, not an instant vector")
        result: list[dict[str, Any]] = data["result"]
        return result

    def values(self, expr: str, by: str) -> dict[str, float]:
        """``{value of label `by`: sample value}`` of an instant vector query."""
        return {series["metric"].get(by, ""): float(series["value"][1]) for series in self.query(expr)}

    def scalar(self, expr: str) -> float | None:
        """The value of a query returning one series, None when it returns none."""
        result = self.query(expr)
        if len(result) > 1:
            raise PrometheusError(f"{expr!r} returned {len(result)} series, expected at most one")
        return float(result[0]["value"][1]) if result else None

    def targets_up(self) -> list[dict[str, Any]]:
        """The active scrape targets with their health and last error."""
        targets: list[dict[str, Any]] = self.api("targets")["activeTargets"]
        return targets

    def wait_for(
        self, expr: str, done: Callable[[Any], bool], *, timeout_s: float = 60.0, by: str | None = None
    ) -> Any:
        """Poll ``expr`` until ``done(result)``: the scalar, or with ``by`` the ``{label: value}`` mapping.

        Raises :class:`PrometheusError` with the last result and the targets' health after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        result: Any = None
        while True:
            result = self.values(expr, by) if by is not None else self.scalar(expr)
            if done(result):
                return result
            if time.monotonic() >= deadline:
                health = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.targets_up()]
                raise PrometheusError(
                    f"{expr!r} still {result!r} after {timeout_s:.0f} s; targets {health}\n{self.log_tail()}"
                )
            time.sleep(0.1)
