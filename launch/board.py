"""TensorBoard for one run (`covrl run --tensorboard`): served on 127.0.0.1 while the run trains, in a session of its
own so that stopping it stops its whole process group, and after the run kept serving only at a terminal. Named
board.py, not tensorboard.py: `python launch/cluster.py` puts launch/ first on the import path, where a
tensorboard.py would shadow the tensorboard package."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from common.transport import free_port
from launch.process_group import stop_group, term_then_kill

TENSORBOARD = [sys.executable, "-m", "tensorboard.main"]


def start_tensorboard(run_dir: str) -> subprocess.Popen:
    port = free_port()
    proc = subprocess.Popen(TENSORBOARD + ["--logdir", os.path.join(run_dir, "tb"), "--host", "127.0.0.1",
                                           "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    print(f"TensorBoard: http://127.0.0.1:{port}/")
    return proc


def stop_tensorboard(proc: subprocess.Popen) -> None:
    """SIGTERM its process group, SIGKILL it after 5 s."""
    stop_group(proc, term_then_kill(5.0))
    proc.wait()


def in_foreground() -> bool:
    """Stdin and stdout are a terminal and this process's group owns it (not a `&` background job)."""
    try:
        return sys.stdout.isatty() and os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except OSError:
        return False


def keep_serving(tensorboard: subprocess.Popen, run_dir: str, code: int) -> None:
    """After the run: at a terminal, TensorBoard keeps serving until Ctrl-C; otherwise (a script, a pipe) it is
    stopped, with the command that reopens it."""
    reopen = shlex.join(TENSORBOARD + ["--logdir", os.path.join(run_dir, "tb")])
    if code != 130 and in_foreground():
        print("TensorBoard keeps serving the finished run; Ctrl-C stops it")
        try:
            tensorboard.wait()
        except KeyboardInterrupt:
            pass
    stop_tensorboard(tensorboard)
    print(f"TensorBoard stopped; reopen it with: {reopen}")
