"""Real launcher runs (torchrun, mpirun, the demo CLI) started in the background, one after another,
as soon as the tests that read them are collected.

Each of these tests starts real processes that import torch and then mostly wait on each other; run
in the foreground they leave the second core idle for a minute of the suite. A test marked
``@pytest.mark.launch(commands, timeout=...)`` (``commands``: a zero-argument callable giving the
``subprocess.Popen`` keyword arguments of each process of one job, started together) finds its job
started at collection and reads its outcome through the ``launched`` fixture, which waits for what
is left of it. The processes, their arguments and the assertions on their output are the test's own;
only the moment they start moves. Outputs go to files, so a chatty job never blocks on a full pipe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rankpool import load_factor


@dataclass
class Outcome:
    """One process of a job: its exit code (None: killed at the job's timeout) and its output."""

    returncode: int | None
    stdout: str
    stderr: str


@dataclass
class _Job:
    commands: Callable[[], list[dict[str, Any]]]
    timeout: float
    done: threading.Event = field(default_factory=threading.Event)
    procs: list[subprocess.Popen] = field(default_factory=list)
    outcomes: list[Outcome] | None = None
    error: BaseException | None = None


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(job: _Job) -> None:
    procs, files = job.procs, []
    try:
        for kwargs in job.commands():
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            # Its own session: on a timeout the launcher and every process it started are killed together.
            kwargs = {"stderr": err, **kwargs}  # stderr=subprocess.STDOUT: one stream, as a terminal shows it
            procs.append(subprocess.Popen(**kwargs, stdout=out, text=True, start_new_session=True))
        deadline = time.monotonic() + job.timeout * load_factor()
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        _kill(procs)
        outcomes = []
        for code, (out, err) in zip(codes, files, strict=True):
            out.seek(0)
            err.seek(0)
            outcomes.append(Outcome(code, out.read(), err.read()))
        job.outcomes = outcomes
    except BaseException as exc:  # reported by the test that reads the job
        job.error = exc
        _kill(procs)
    finally:
        for out, err in files:
            out.close()
            err.close()
        job.done.set()


class Launches:
    """Jobs by test id, run one at a time by a background thread, in the order they were submitted."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._queue: list[_Job] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, key: str, commands: Callable[[], list[dict[str, Any]]], timeout: float) -> None:
        job = self._jobs[key] = _Job(commands, timeout)
        with self._wake:
            self._queue.append(job)
            self._wake.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="launches", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue:
                    self._wake.wait()
                job = self._queue.pop(0)
            if job.commands is None:
                return
            _run(job)

    def outcome(self, key: str, commands: Callable[[], list[dict[str, Any]]], timeout: float) -> list[Outcome]:
        """The outcome of the job ``key``, started now if it was not submitted (a test run on its own)."""
        job = self._jobs.get(key)
        if job is None:
            job = self._jobs[key] = _Job(commands, timeout)
            _run(job)
        # The job's own timeout bounds its run; the margin covers the jobs queued before it.
        if not job.done.wait(sum(j.timeout for j in self._jobs.values()) * load_factor() + 60):
            raise TimeoutError(f"the launch of {key} did not finish")
        if job.error is not None:
            raise job.error
        assert job.outcomes is not None
        return job.outcomes

    def close(self) -> None:
        """Skip the jobs not started and kill the processes of the one running (the session is over)."""
        with self._wake:
            self._queue.clear()
            self._queue.append(_Job(None, 0))  # type: ignore[arg-type]
            self._wake.notify()
        for job in list(self._jobs.values()):
            _kill(list(job.procs))
