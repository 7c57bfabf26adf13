"""Test-only: make one rank of ``diffusers-cudnn-fix verify`` fail, to show that the others are not left
waiting (tests/test_verify.py, through verify's hidden ``--preload``). ``VERIFY_TEST_FAIL`` says how:
``exit`` (rank 1 ends with status 3 before it joins the process group), ``crash`` (rank 1 is killed by
SIGSEGV, as a crash in a collective kills it) or ``hang`` (rank 1 sleeps for an hour). Rank 0 then waits at the
rendezvous until the launcher stops it."""

from __future__ import annotations

import os
import signal
import time

if os.environ.get("RANK") == "1":
    how = os.environ.get("VERIFY_TEST_FAIL", "")
    if how == "exit":
        os._exit(3)
    if how == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "hang":
        time.sleep(3600)
