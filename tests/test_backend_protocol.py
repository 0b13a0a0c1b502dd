"""The Backend protocol's declared capabilities: the loader refuses a backend without one (naming it), and the
cpu backend's implementations do what the protocol says."""

from __future__ import annotations

import sys
import types
from importlib.metadata import EntryPoint

import pytest
import torch

from backends.base import Backend
from backends.cpu import CPUBackend
from specter import plugins
from specter.errors import PluginError


pytestmark = pytest.mark.usefixtures("fresh_plugin_scan")


def _without(method: str) -> type:
    """A CPUBackend subclass that lacks `method` (its attribute shadowed by None, as if never written)."""
    return type(f"CPUBackendWithout_{method}", (CPUBackend,), {method: None})


@pytest.fixture
def backend_entry_points(monkeypatch):
    """'partial-<method>' entry points, each a cpu backend missing that one method, from a module made here."""
    module = types.ModuleType("specter_test_partial_backends")
    names = {}
    for method in ("set_int32", "enqueue_h2d", "copy_h2d"):
        setattr(module, f"without_{method}", _without(method))
        names[f"partial-{method}"] = f"{module.__name__}:without_{method}"
    setattr(module, "full", CPUBackend)
    names["full"] = f"{module.__name__}:full"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    group = plugins.GROUP_PREFIX + plugins.BACKEND_GROUP
    points = [EntryPoint(name, value, group) for name, value in names.items()]
    monkeypatch.setattr(plugins, "entry_points", lambda group: points if group == points[0].group else [])


def test_the_protocol_declares_the_capabilities_callers_use():
    methods = plugins._backend_protocol_methods()
    assert {"set_int32", "enqueue_h2d", "copy_h2d", "launch"} <= set(methods)
    assert isinstance(CPUBackend(), Backend)


@pytest.mark.parametrize("method", ["set_int32", "enqueue_h2d", "copy_h2d"])
def test_a_backend_missing_a_declared_capability_is_refused_by_name(backend_entry_points, method):
    with pytest.raises(PluginError, match=rf"backends plug-in 'partial-{method}'.*{method}\(\) missing"):
        plugins.load_backend(f"partial-{method}")


def test_a_backend_with_every_capability_loads(backend_entry_points):
    backend = plugins.load_backend("full")
    try:
        assert backend.name == "cpu"
    finally:
        backend.close()


def test_cpu_set_int32_writes_in_stream_order():
    backend = CPUBackend()
    try:
        table = torch.full((4,), -1, dtype=torch.int32)
        stream, seen = backend.copy_stream, []
        backend.launch(stream, lambda: seen.append(table.tolist()))
        backend.set_int32(table, 1, 5, stream)
        backend.set_int32(table, 3, -1, stream)
        backend.launch(stream, lambda: seen.append(table.tolist()))
        backend.record_event(stream).wait()
        assert seen == [[-1, -1, -1, -1], [-1, 5, -1, -1]]
    finally:
        backend.close()


def test_cpu_set_int32_refuses_what_the_protocol_excludes():
    backend = CPUBackend()
    try:
        with pytest.raises(AssertionError, match="int32"):
            backend.set_int32(torch.zeros(2, dtype=torch.int64), 0, 1, backend.copy_stream)
        with pytest.raises(AssertionError, match="-1"):
            backend.set_int32(torch.zeros(2, dtype=torch.int32), 0, -2, backend.copy_stream)
    finally:
        backend.close()


def test_cpu_enqueue_h2d_copies_in_stream_order_through_copy_h2d():
    """No event of its own; goes through the instance's copy_h2d, so a test's replacement sees every chunk."""
    backend = CPUBackend()
    try:
        source, target = torch.arange(8, dtype=torch.float32), torch.zeros(8)
        calls = []
        real = backend.copy_h2d

        def counting(dst, src, stream):
            calls.append(src.numel())
            return real(dst, src, stream)

        backend.copy_h2d = counting
        assert backend.enqueue_h2d(target[:4], source[:4], backend.copy_stream) is None
        backend.enqueue_h2d(target[4:], source[4:], backend.copy_stream)
        backend.record_event(backend.copy_stream).wait()
        assert calls == [4, 4] and torch.equal(target, source)
    finally:
        backend.close()
