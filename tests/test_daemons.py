"""The engine's daemon threads are idle when the interpreter finalizes (specter.daemons): a thread torn down inside
torch's C++ code aborts the process ("terminate called without an active exception", status 134) after the script's
work is done, as an engine left open mid-request when `asyncio.run` ended did."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from backends.cpu import CPUBackend
from specter import daemons
from specter.kernel import HostJob, HostThread, Kernel

ROOT = Path(__file__).resolve().parents[1]

BUSY = """
import time, torch
a = torch.randn(512, 512)
def busy():
    for _ in range(400):  # a few seconds of torch on the CPU: still running when the script below ends
        a @ a
"""


def _exit_of(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(BUSY + script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.parametrize("owner", ["cpu stream", "host thread"])
def test_a_thread_busy_in_torch_when_the_script_ends_does_not_abort_the_interpreter(owner):
    start = {
        "cpu stream": "from backends.cpu import CPUBackend\nbackend = CPUBackend()\n"
                      "backend.launch(backend.compute_stream, busy)\n",
        "host thread": "from specter.kernel import HostJob, HostThread\nthread = HostThread('specter-host-test')\n"
                       "thread.submit(HostJob(busy, None))\n",
    }[owner]
    done = _exit_of(start + "time.sleep(0.05)\nprint('ended', flush=True)\n")
    assert done.stdout == "ended\n"
    assert done.returncode == 0 and "terminate called" not in done.stderr, (done.returncode, done.stderr[-2000:])


def test_an_engine_left_open_mid_request_when_asyncio_run_ends_exits_cleanly():
    done = _exit_of("""
        import asyncio
        from specter import Engine, EngineConfig

        async def main():
            engine = await Engine.from_pretrained("tiny", EngineConfig(residents=2))
            asyncio.get_running_loop().create_task(engine.complete([1, 2, 3], max_new_tokens=64))
            await asyncio.sleep(0.05)  # the request is mid-round when asyncio.run cancels it and ends

        asyncio.run(main())
        print("ended", flush=True)
    """.replace("\n        ", "\n"))
    assert done.stdout == "ended\n"
    assert done.returncode == 0 and "terminate called" not in done.stderr, (done.returncode, done.stderr[-2000:])


def test_a_cpu_stream_settles_once_its_queued_work_has_run_and_then_runs_more():
    backend = CPUBackend()
    stream, started, release, ran = backend.compute_stream, threading.Event(), threading.Event(), []
    try:
        backend.launch(stream, lambda: (started.set(), release.wait(10)))
        backend.launch(stream, lambda: ran.append("queued behind"))
        assert started.wait(10)
        assert not stream.settle(0.2)  # the first item still runs: not settled
        release.set()
        assert stream.settle(10) and ran == ["queued behind"]
        backend.launch(stream, lambda: ran.append("after the settle"))  # a settle stops nothing
        assert stream.settle(10) and ran == ["queued behind", "after the settle"]
    finally:
        release.set()
        backend.close()
    assert stream.settle(0.0)  # closed: no thread, nothing to wait for


def test_a_host_thread_settles_once_its_jobs_have_run_and_after_its_stop():
    thread, started, release, ran = HostThread("specter-host-test"), threading.Event(), threading.Event(), []
    try:
        thread.submit(HostJob(lambda: (started.set(), release.wait(10)), None))
        thread.submit(HostJob(lambda: ran.append("queued behind"), None))
        assert started.wait(10)
        assert not thread.settle(0.2)
        release.set()
        assert thread.settle(10) and ran == ["queued behind"] and thread.idle
    finally:
        release.set()
        thread.stop()
    began = time.monotonic()
    assert thread.settle(10) and time.monotonic() - began < 1.0  # ended: its mark is never reached, its end counts


def test_a_host_thread_whose_setup_failed_still_settles():
    def setup() -> None:
        raise RuntimeError("no threads for you")

    thread = HostThread("specter-host-test", setup=setup)
    try:
        assert thread.settle(10)
    finally:
        thread.stop()


def test_an_event_waiter_settles_once_its_parked_events_completed():
    backend = CPUBackend()
    kernel = Kernel(backend)
    release, told = threading.Event(), []
    try:
        backend.launch(backend.copy_stream, lambda: release.wait(10))
        event = backend.record_event(backend.copy_stream)
        waiter = kernel._waiter_for(backend.copy_stream)
        waiter.add(event, lambda: told.append("told"))
        assert not waiter.settle(0.2)
        release.set()
        assert waiter.settle(10) and told == ["told"]
    finally:
        release.set()
        kernel.close()
        backend.close()


def test_settle_all_names_the_threads_still_busy_at_its_deadline():
    backend = CPUBackend()
    release = threading.Event()
    try:
        backend.launch(backend.compute_stream, lambda: release.wait(10))
        backend.launch(backend.copy_stream, lambda: None)
        busy = daemons.settle_all(0.3)
        assert busy == [backend.compute_stream]
        release.set()
        assert daemons.settle_all(10) == []
    finally:
        release.set()
        backend.close()


def test_registration_does_not_keep_a_stream_alive():
    backend = CPUBackend()
    backend.launch(backend.compute_stream, lambda: torch.zeros(1))
    backend.close()
    stream = weakref.ref(backend.compute_stream)
    assert stream() in set(daemons._threads)
    del backend
    gc.collect()
    assert stream() is None
