"""The exit statuses every command-line tool shares (`specter`, `specter.bench`, `specter.replay`).

0 done; 2 a `SpecterError` (bad input, an unusable output path), its message on stderr after `error: `; 130
interrupted; 141 the reader of stdout left (`| head`), as a shell tool that SIGPIPE ended. A tool may have
statuses of its own besides (the bench's 1: a system's tokens differ from the baseline's, 3: nothing measured, 128 +
a signal's number when SIGTERM or SIGINT stopped it; the replay's 1: no policy pair ran). An unexpected error is
Python's own traceback and exit 1.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import io
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO, TypeVar

from specter.errors import OutputError, SpecterError

BROKEN_PIPE_STATUS = 141
INTERRUPTED_STATUS = 130
ERROR_STATUS = 2

T = TypeVar("T")


class _GuardedStdout(io.TextIOBase):
    """Stdout whose failed writes say they were stdout's: a full disk under `> file` is the user's output path, not
    a crash of the tool. A closed pipe stays a `BrokenPipeError`, which `run_tool` turns into 141."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def _guard(self, call: Callable[[], object]) -> object:
        try:
            return call()
        except BrokenPipeError:
            raise
        except UnicodeEncodeError:  # raised before a byte of the call is written, so writing it again loses nothing
            if not _escape_what_it_cannot_encode(self._stream):
                raise
            return call()
        except OSError as error:
            _stdout_to_devnull(self._stream)  # what is still buffered must not fail again at the interpreter's exit
            raise OutputError(f"cannot write the output to stdout: {error.strerror or error}; redirect it elsewhere") from None

    def write(self, text: str) -> int:
        return self._guard(lambda: self._stream.write(text))  # type: ignore[return-value]

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._stream.encoding

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        """Not stdout's to close: `run_tool` flushes it, and the guard's own collection must not (a failed flush
        there would be swallowed, and the tool exit 0 with its output lost)."""

    def __getattr__(self, name: str) -> object:  # buffer, errors, line_buffering, reconfigure: the stream's own
        return getattr(self._stream, name)


def _escape_what_it_cannot_encode(stream: TextIO) -> bool:
    """Let a stdout whose encoding lacks a character of the output (ascii under LANG=C, cp1252 redirected on Windows)
    write it as a backslash escape, and say so once on stderr: the rest of the output is not lost to a traceback.
    False when the stream cannot be changed (it escapes already, or is no TextIOWrapper)."""
    if getattr(stream, "errors", "strict") == "backslashreplace" or not callable(getattr(stream, "reconfigure", None)):
        return False
    stream.reconfigure(errors="backslashreplace")
    print(f"note: stdout's encoding ({stream.encoding}) cannot show some characters of the output; they are written "
          "as backslash escapes; set PYTHONIOENCODING=utf-8 (or a UTF-8 locale) to get them as text", file=sys.stderr)
    return True


@contextlib.contextmanager
def interrupt_held() -> Iterator[None]:
    """Hold a Ctrl-C until the block has ended, then raise it. For imports: `import torch` interrupted inside its C
    code loses the KeyboardInterrupt and leaves numpy half-imported, so the tool went on to fail with a false error
    (a plug-in "raised AttributeError: module 'numpy' has no attribute 'nonzero'"), to finish as if never
    interrupted, or to abort (status 134). Off the main thread, where no handler can be set, the block runs as is."""
    held: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def load_tool(load: Callable[[], T]) -> T:
    """An entry point's imports (`load` returns the tool's main), with a Ctrl-C held until they are whole; one that
    came meanwhile ends the process as `run_tool` ends an interrupted tool: 'interrupted', 130, no traceback."""
    try:
        with interrupt_held():
            return load()
    except KeyboardInterrupt:
        raise SystemExit(_interrupted()) from None


def quiet_late_interrupt() -> None:
    """After an entry point's tool has returned: a Ctrl-C now, during the interpreter's exit handlers, ends the
    process as the signal's default does, not with an 'Exception ignored in atexit callback' traceback and status 0."""
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_entry(module: str) -> int:
    """A command's entry point (`specter.entry`): `module`'s main imported under `load_tool`, run, and its status
    returned with a late Ctrl-C quieted (`quiet_late_interrupt`). A Ctrl-C that escapes main (its argument parsing,
    before its `run_tool`) ends as `run_tool` ends one: 'interrupted', 130."""
    standard_streams()  # before the imports: the logging's set-up reads stderr
    main = load_tool(lambda: importlib.import_module(module).main)
    try:
        return main()
    except KeyboardInterrupt:
        return _interrupted()
    finally:  # also after a SystemExit of main's (argparse's usage error, --help)
        quiet_late_interrupt()


def prog_name(module: str) -> str:
    """A tool's name for its usage line, as the user started it: `python -m MODULE` where runpy runs `module` as
    __main__, else the name it was run by, as argparse's default takes it (a console script's: `specter-replay`).
    Not argparse's default alone: before Python 3.14 it names `python -m` by the module's file (`replay.py`)."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # a package's -m runs its __main__ module
    if (main_spec is not None and main_spec.name in (module, f"{module}.__main__")) or not (sys.argv and sys.argv[0]):
        return f"python -m {module}"
    return os.path.basename(sys.argv[0])


def run_tool(main: Callable[[], int], preload: Sequence[str] = ()) -> int:
    """Run a tool's body with stdout guarded, and map how it ended onto the shared exit statuses. `preload`: modules
    the body needs whose import must not be cut by a Ctrl-C (torch: `interrupt_held`), imported first."""
    standard_streams()
    stdout = sys.stdout
    sys.stdout = _GuardedStdout(stdout if stdout is not None else _ClosedStdout())  # type: ignore[assignment]
    try:
        with interrupt_held():
            for name in preload:
                importlib.import_module(name)
        status = main()
        sys.stdout.flush()  # what print() left in the buffer fails here, named, not at the interpreter's exit
        return status
    except BrokenPipeError:  # the reader left: nothing more can be shown, and that is no error
        _stdout_to_devnull(stdout)
        return BROKEN_PIPE_STATUS
    except SpecterError as error:
        _cause_when_debugging(error)
        print(f"error: {error}", file=sys.stderr)
        return ERROR_STATUS
    except KeyboardInterrupt:
        return _interrupted()
    finally:
        sys.stdout = stdout


class _ClosedStdout(io.TextIOBase):
    """What a tool started with stdout closed (`>&-`) writes to: Python leaves `sys.stdout` None then, and a write
    fails as one to a full disk does, named (2), not with an AttributeError."""

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "stdout is closed")

    def flush(self) -> None:
        return None

    def fileno(self) -> int:
        raise io.UnsupportedOperation("stdout is closed")


def closed_standard_fds() -> list[int]:
    """Which of descriptors 0, 1 and 2 are closed."""
    closed = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.append(fd)
    return closed


def standard_streams() -> None:
    """A tool started with descriptors 0-2 closed (`<&-`, `>&-`, `2>&-`): they are opened on /dev/null, since the
    next file the process opens would take the lowest free descriptor and so become its stdin or stdout, and uvloop's
    libuv aborts the process when it closes one of its own there (`kernel.new_event_loop`). `sys.stdin` and
    `sys.stdout` stay None, as Python set them (a write to stdout fails, named: `_ClosedStdout`); a closed stderr's
    lines are dropped, as they would have been, where its None stopped the logging's set-up with an AttributeError."""
    for fd in closed_standard_fds():
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (the process's stderr until it exits)


def _interrupted() -> int:
    """How every tool ends on a Ctrl-C: one line, no traceback, and the status a shell gives SIGINT."""
    print("interrupted", file=sys.stderr)
    return INTERRUPTED_STATUS


def _cause_when_debugging(error: SpecterError) -> None:
    """At --log-level debug, the traceback of what `error` was raised from (a plug-in's own exception: its author
    needs the file and line in their code, which the one-line message leaves out)."""
    from specter.log import debug_enabled  # loaded by then: the tool logs through it

    if error.__cause__ is not None and debug_enabled():
        traceback.print_exception(error.__cause__, file=sys.stderr)


def _stdout_to_devnull(stdout: TextIO) -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what is still buffered does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):  # no real stdout (a test's capture): nothing to flush
        pass
