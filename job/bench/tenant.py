"""bench.tenant_gb: another process holding memory on card 0 for the whole bench (the shared-card case)."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading

from job.bench.process import error_line, plain_env, wait_or_kill
from job.errors import UsageError

log = logging.getLogger("job")
GB = 1e9  # bench.tenant_gb and memory.cap_gb: decimal GB, as the memory plan

_TENANT_CODE = """
import sys
import torch
nbytes, device = int(sys.argv[1]), sys.argv[2]
x = torch.empty(nbytes, dtype=torch.uint8, device=device)
x.fill_(1)  # touch it: on a CPU, untouched pages are not held
if device.startswith("cuda"):
    torch.cuda.synchronize(device)
print("ready", flush=True)
sys.stdin.read()  # held until the bench closes this pipe, or dies (EOF)
"""


class Tenant:
    """A child process holding `gb` GB on `device` (torch.empty(..., uint8)) until stop().

    It reads its stdin until EOF, so it also ends when the bench dies without cleaning up.
    """

    def __init__(self, gb: float, device: str = "cuda:0", *, timeout_s: float = 300.0):
        self.gb, self.device, self.timeout_s = gb, device, timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> Tenant:
        nbytes = int(self.gb * GB)
        self.proc = subprocess.Popen([sys.executable, "-c", _TENANT_CODE, str(nbytes), self.device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True, env=plain_env())
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.timeout_s)
        if not line or line[0].strip() != "ready":
            self.stop()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            why = error_line(err) if err.strip() else f"not ready within {self.timeout_s:g} s"
            raise UsageError(f"bench.tenant_gb={self.gb:g}: the tenant could not hold {self.gb:g} GB on "
                             f"{self.device} ({why}); lower bench.tenant_gb")
        log.info("bench: tenant process %d holds %g GB on %s until the bench ends", self.proc.pid, self.gb,
                 self.device)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(OSError):
            p.stdin.close()
        wait_or_kill(p, 10)
