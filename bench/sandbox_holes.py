"""What examples/python_tool.py's sandbox lets a call hold past its limits (docs/tool_use.md, "What
is not contained"): the numbers measured, not a test.

  python bench/sandbox_holes.py        three runs of each part, then one JSON line

Two parts:
  threads  as root the task limit (16) is checked every 10 ms, not by the kernel (RLIMIT_NPROC
           does not bind root): code that starts 8,000 threads of 64 KB stacks; the most tasks
           the check saw, and the seconds until the call was stopped. As another user the kernel
           refuses the 14th thread (tests/test_tools.py), so there is nothing to measure.
  buffers  memory the kernel holds for the call and no process holds as resident: 13 processes
           (the task limit less bwrap's and the interpreter's own) each filling 14 pipes (asking
           for 1 MB each) and 15 socket pairs, without blocking; the MB they wrote, summed.
Run it on a quiet machine and quote `uptime`'s load beside the numbers.
"""
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import python_tool as P  # noqa: E402

THREADS = ("import threading, time\nthreading.stack_size(1 << 16)\nfor _ in range(8000):\n"
           "    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")
BUFFERS = r'''
import fcntl, os, socket, time
def fill():
    held, keep = 0, []
    for _ in range(14):  # pipes
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: 1 MB where allowed
        except OSError:
            pass
        os.set_blocking(w, False)
        try:
            while True:
                held += os.write(w, bytes(65536))
        except OSError:
            keep.append((r, w))
    for _ in range(15):  # socket pairs
        a, b = socket.socketpair()
        a.setblocking(False)
        try:
            while True:
                held += a.send(bytes(65536))
        except OSError:
            keep.append((a, b))
    print('held', held >> 20, 'MB', flush=True)
    time.sleep(30)
for _ in range(12):
    if os.fork() == 0:
        break
fill()
'''


def main():
    seen, plain = [], P.processes_of

    def counted(pid):  # the poll's own count, kept
        found, tasks = plain(pid)
        seen.append(tasks)
        return found, tasks
    P.processes_of = counted
    result = {"load": os.getloadavg()[0], "threads": [], "buffers_mb": []}
    for _ in range(3):
        seen.clear()
        t0 = time.monotonic()
        out = P.run_python(THREADS, timeout=10)
        result["threads"].append({"most_tasks": max(seen), "stopped_after_s":
                                  round(time.monotonic() - t0, 2), "note": out.splitlines()[-1]})
        print("threads:", result["threads"][-1])
    P.processes_of = plain
    for _ in range(3):
        out = P.run_python(BUFFERS, timeout=4)
        result["buffers_mb"].append(sum(int(x) for x in re.findall(r"held (\d+) MB", out)))
        print("buffers: MB held by 13 processes:", result["buffers_mb"][-1])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
