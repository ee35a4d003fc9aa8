"""A shell command on a pseudo-terminal, as a person runs it: its own session with the pty as
controlling terminal, Ctrl-C typed as the character (the terminal then signals the whole
foreground process group: make, python, tee alike).

``PtyShell(cmd, cwd, env)`` starts ``bash -c cmd``; ``wait_for(predicate)`` reads the terminal
until ``predicate()`` holds; ``ctrl_c()`` types ``^C``; ``finish()`` reads to the end and returns
``(exit status, everything the terminal showed)``.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time


class PtyShell:
    def __init__(self, cmd: str, cwd, env: dict, cols: int = 200) -> None:
        import fcntl
        import struct
        import termios

        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
        self.master, self.out = master, b""
        self.proc = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env={**env, "TERM": "xterm"}, stdin=slave,
                                     stdout=slave, stderr=slave, start_new_session=True, close_fds=True,
                                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)

    def _read(self, timeout: float) -> bool:
        r, _, _ = select.select([self.master], [], [], timeout)
        if not r:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            return False
        self.out += data
        return bool(data)

    def wait_for(self, predicate, timeout: float = 300) -> bool:
        t0 = time.monotonic()
        while not predicate():
            if time.monotonic() - t0 > timeout or (not self._read(0.1) and self.proc.poll() is not None):
                return False
        return True

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        t0 = time.monotonic()
        while self._read(0.2) or self.proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                os.killpg(self.proc.pid, 9)
                break
        code = self.proc.wait()
        os.close(self.master)
        return code, self.out.decode("utf-8", "replace")
