"""`spill` in a pseudo-terminal, as a user runs it: Ctrl-C is the byte 0x03 typed at the terminal,
which the kernel turns into SIGINT for the terminal's whole foreground process group."""

import fcntl
import os
import pty
import re
import select
import struct
import sys
import termios
import time

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\r")


class PtySpill:
    def __init__(self, *args, env: dict | None = None, cwd=None):
        pid, fd = pty.fork()
        if pid == 0:   # the child: a session leader whose controlling terminal is the pty
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))   # rows, columns
            if cwd:
                os.chdir(cwd)
            os.execve(sys.executable, [sys.executable, "-m", "spill.coordinator.cli", *map(str, args)],
                      {**os.environ, **(env or {})})
        self.pid, self.fd, self.raw, self.code = pid, fd, b"", None

    @property
    def output(self) -> str:
        return ANSI.sub(b"", self.raw).decode(errors="replace")

    def _read(self, timeout: float) -> None:
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                self.raw += os.read(self.fd, 65536)
            except OSError:   # the child has gone and closed its side
                time.sleep(timeout)

    def wait_until(self, done, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self):
            assert time.monotonic() < deadline, f"timed out; output so far:\n{self.output}"
            self._read(0.05)
            self._poll()

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")

    def _poll(self) -> None:
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)

    def wait(self, timeout: float) -> int:
        """The exit code; fails if the command takes longer than timeout seconds."""
        self.wait_until(lambda p: p.code is not None, timeout)
        for _ in range(20):
            self._read(0.01)
        os.close(self.fd)
        return self.code
