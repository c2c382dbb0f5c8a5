"""``applier`` commands run as forked copies of the test process instead of new interpreters.

A test that runs ``python -m applier run ...`` wants a worker process: its own pid, signals,
SIGKILL at any moment, an exit status, its output. It does not want the ~0.6 s of CPU a new
interpreter spends starting and importing applier, and over a suite of a few hundred such
commands that is most of the suite's CPU. ``Popen`` and ``run`` here take the same arguments as
``subprocess``'s and give a real child process: the test process, which has applier imported
already, forks, and the child runs ``applier.cli.main`` with the command's arguments, standard
streams, working directory and environment, then exits with its status as ``python -m applier``
would (``os._exit``: nothing of the test process runs in the child, not even its atexit handlers,
which would stop the test servers).

Falls back to a real ``subprocess`` when a fork would not be the same program: another command
than ``python -m applier``, the commands that start a JVM (``pipeline``) or servers of their own
(``demo``), or an environment that chooses another implementation (``APPLIER_PURE_PYTHON``: the
test process has decided that at import). Tests of the process start itself (the head start, the
command line's entry point) call ``subprocess`` directly.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

import applier
from applier import faults
from applier.cli import main

__all__ = ["Popen", "run"]

#: Commands that are not this process's program even when forked: they start a JVM or servers.
_NOT_FORKED = frozenset({"pipeline", "demo"})
_MAIN = os.path.join(os.path.dirname(applier.__file__), "__main__.py")


def _forkable(args: Any, env: dict[str, str] | None) -> bool:
    if not isinstance(args, (list, tuple)) or len(args) < 4 or list(args[:3]) != [sys.executable, "-m", "applier"]:
        return False
    if args[3] in _NOT_FORKED:
        return False
    chosen = os.environ if env is None else env
    return chosen.get("APPLIER_PURE_PYTHON", "").strip() == os.environ.get("APPLIER_PURE_PYTHON", "").strip()


class _Forked(subprocess.Popen):
    """subprocess.Popen whose child is a fork running ``applier.cli.main`` instead of an exec:
    Popen sets up the pipes before and does waiting, signals, ``communicate`` and timeouts after."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,  # type: ignore[override]
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                       errread, errwrite, *rest) -> None:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            _child(list(args[3:]), env, cwd, preexec_fn, p2cread, c2pwrite, errwrite)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _child(argv: list[str], env: dict[str, str] | None, cwd: Any, preexec_fn: Any,
           stdin: int, stdout: int, stderr: int) -> None:
    """Become ``python -m applier ARGV`` as far as applier can tell, run it, and exit."""
    code = 1
    try:
        gc.freeze()  # the test process's objects are not ours to collect (or finalize)
        atexit._clear()  # nor are its exit handlers (they stop the test servers)
        for number in (signal.SIGTERM, signal.SIGALRM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            if fd != -1 and fd != target:
                os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as close_fds: no other child's pipe ends
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False))
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                      line_buffering=True)
        if cwd is not None:
            os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if preexec_fn is not None:
            preexec_fn()
        sys.argv = [_MAIN, *argv]
        random.seed()
        _fresh_logging()
        faults.arm()
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 1
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        _exit_like_python()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


def _fresh_logging() -> None:
    """applier's loggers as a new interpreter has them (a test may have set levels or handlers)."""
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (name == "applier" or name.startswith("applier.")):
            logger.handlers.clear()
            logger.setLevel(logging.NOTSET)
            logger.propagate = True
            logger.disabled = False


def _exit_like_python() -> None:
    """What the interpreter does at exit: wait for non-daemon threads, run exit handlers,
    flush the logs."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()


def Popen(args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)``, forked when ``args`` is ``python -m applier ...``."""
    kind = _Forked if _forkable(args, kwargs.get("env")) else subprocess.Popen
    return kind(args, **kwargs)


def run(args: Sequence[str], *, timeout: float | None = None, check: bool = False,
        capture_output: bool = False, input: str | bytes | None = None,
        **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(args, ...)``, forked when ``args`` is ``python -m applier ...``."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        except BaseException:
            process.kill()
            raise
        code = process.poll()
        assert code is not None
    if check and code:
        raise subprocess.CalledProcessError(code, args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(args, code, stdout, stderr)
