"""A Python interpreter as a tool: the model's code runs in a sandbox (bubblewrap) that it cannot
undo, and that cannot hang the run, fill the disk, reach the network or leave anything behind.

  --tools examples/python_tool.py:python      a chat model calls python(code) in its own format
  --env examples/python_tool.py:env           a model that writes <python>...</python> gets the
                                              output back as the observation (any model)
  python examples/python_tool.py FILE.jsonl   writes the example task: list arithmetic (sums of
                                              squares, products, sorted medians) that is easy in
                                              code and hard in the head; "answer" is the number

run_python(code) is the sandbox; import it in your own env (docs/tool_use.md has a table of what
is and is not contained, each line tested). Each call runs a fresh interpreter under bubblewrap
(`bwrap`, the sandbox Flatpak uses; Debian/Ubuntu package `bubblewrap`), in:
- an empty root holding, read-only, only what the interpreter needs (its prefix, its sys.path,
  /usr and the library folders), a private 64 MB tmpfs at /tmp (its working folder) and at
  /dev/shm, a fresh read-only /proc and a minimal /dev: the checkout, your home, the run folders
  and every socket file on the host are out of sight;
- new namespaces for everything (--unshare-all): no network at all (not even 127.0.0.1), no
  other process visible, no capability (--cap-drop ALL) and no new user namespace, so the code
  cannot mount, remount or unmount anything; it dies with the run (--die-with-parent);
- limits: `timeout` seconds of wall clock (default 5; CPU time too), `memory_mb` (default 512) of
  address space per process and of resident memory for the whole call, `processes` (default 16)
  in the whole call (the last two checked every 10 ms: the call is stopped, not the host), 16 MB
  a file, 64 open files, output cut to `output_chars` (default 2,000) characters; at most
  MAX_CALLS calls at once (a call waits for a slot; under minrl's envs the wait does not count
  against --env_timeout).
Where bubblewrap is missing or cannot start (macOS, a container that forbids namespaces), loading
this file as a tool refuses in one line, unless MINRL_UNSAFE_TOOLS=1: then the code runs with
the limits above but NOT contained (it can read and write your files, reach the network and kill
the run), as said once when the tool loads. Even sandboxed, run an untrusted model's code on a
machine you can lose: a kernel bug is an escape.
"""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

TIMEOUT_S, MEMORY_MB, PROCESSES, OUTPUT_CHARS, FILE_MB, TMPFS_MB = 5.0, 512, 16, 2000, 16, 64
MAX_CALLS = 8  # sandboxes at once: MAX_CALLS * memory_mb is the most all calls hold together
SLOTS = threading.BoundedSemaphore(MAX_CALLS)
UNSAFE = "MINRL_UNSAFE_TOOLS"  # =1: run the code without a sandbox where bubblewrap cannot run
try:  # under minrl's --env / --tools: waiting for a slot does not count against --env_timeout
    from plumbing.envs import paused
except ImportError:
    paused = contextlib.nullcontext


def sandbox():
    """The bwrap command line (up to the command it runs) that builds the sandbox of the module
    docstring for this interpreter, checked by running it once; or None where bwrap is missing
    or cannot start and MINRL_UNSAFE_TOOLS=1 (said once). Anything else is refused: RuntimeError,
    one line naming the fix."""
    bwrap = shutil.which("bwrap")
    if bwrap is None and os.environ.get(UNSAFE) != "1":
        raise RuntimeError("python_tool: bubblewrap (bwrap) is not installed: install it (apt-get "
                           f"install bubblewrap), or set {UNSAFE}=1 to run the model's code "
                           "without a sandbox")
    # what the interpreter reads: its own prefixes and sys.path (a venv under /tmp, a pyenv
    # under /root), found by asking it; read-only, at the same paths
    ask = "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, *sys.path]))"
    try:
        paths = json.loads(subprocess.run([sys.executable, "-I", "-c", ask], capture_output=True,
                                          timeout=30).stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        paths = [sys.prefix, sys.base_prefix]
    cmd = [bwrap or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
           "--cap-drop", "ALL", "--unshare-user", "--uid", "65534", "--gid", "65534"]
    with contextlib.suppress(OSError):  # bubblewrap 0.8+: no user namespace inside either
        if "--disable-userns" in subprocess.run([cmd[0], "--help"], capture_output=True,
                                                text=True).stdout:
            cmd.append("--disable-userns")
    for top in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # the C libraries
        where = "/" + top
        if os.path.islink(where):  # merged /usr: /lib -> usr/lib
            cmd += ["--symlink", os.readlink(where), where]
        elif os.path.isdir(where):
            cmd += ["--ro-bind", where, where]
    if os.path.isfile("/etc/ld.so.cache"):  # where the loader finds them (not the rest of /etc)
        cmd += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    cmd += ["--size", str(TMPFS_MB << 20), "--tmpfs", "/tmp"]  # before the binds: a venv
    for path in sorted({q for p in paths if os.path.exists(p)  # where it is and where it
                        for q in (os.path.abspath(p), os.path.realpath(p))}):  # links to
        cmd += ["--ro-bind", path, path]
    cmd += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev",
            "--size", str(TMPFS_MB << 20), "--tmpfs", "/dev/shm", "--chdir", "/tmp"]
    try:
        tried = subprocess.run(cmd + ["--", sys.executable, "-I", "-c", "pass"],
                               capture_output=True, text=True, timeout=30)
        why = tried.returncode and (tried.stderr.strip().splitlines()
                                    or [f"exit code {tried.returncode}"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        why = f"{type(e).__name__}: {e}"
    if not why:
        return cmd
    if os.environ.get(UNSAFE) == "1":
        print(f"python_tool: {UNSAFE}=1 and no sandbox here ({why}): the model's code "
              "runs with its time, memory, process and output limits only, and CAN read and "
              "write your files, reach the network and kill this run", file=sys.stderr)
        return None
    raise RuntimeError(f"python_tool: the sandbox (bubblewrap) cannot start here: {why}; "
                       "allow unprivileged user namespaces (or run where they are allowed), or "
                       f"set {UNSAFE}=1 to run the model's code without a sandbox")


def limits(seconds, memory_mb):
    """The command (util-linux's prlimit) that sets the limits of the call's first process, which
    all it starts inherit: CPU time, address space, file size, open files, no core dumps. A
    command, not Popen's preexec_fn: Python code between fork and exec in a process with threads
    (torch's, the envs' workers) can crash the child. Without prlimit (not Linux): none, only the
    limits run_python polls."""
    cpu = int(seconds) + 1
    if not shutil.which("prlimit"):
        return []
    return ["prlimit", f"--cpu={cpu}", f"--as={memory_mb << 20}", f"--fsize={FILE_MB << 20}",
            "--nofile=64", "--core=0", "--"]


def processes_of(pid):
    """pid and every process below it (Linux's /proc/PID/task/TID/children), as found now."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return found


def resident_mb(pids):
    """The resident memory of these processes together, in MB (pages shared after a fork count
    in each: an overcount, never an undercount)."""
    pages = 0
    for p in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{p}/statm") as f:
                pages += int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_python(code, timeout=TIMEOUT_S, memory_mb=MEMORY_MB, output_chars=OUTPUT_CHARS,
               processes=PROCESSES):
    """Run `code` (any text, any length) in the sandbox (the module docstring); its stdout and
    stderr together, cut to output_chars, plus a last line when it was stopped or failed."""
    with paused():
        SLOTS.acquire()  # at most MAX_CALLS at once
    try:
        with tempfile.TemporaryDirectory(prefix="minrl-python-") as folder, \
                tempfile.TemporaryFile() as out:  # output: a file of no name, capped by FSIZE
            path = os.path.join(folder, "code.py")  # a file, not an argument: any bytes, any
            with open(path, "wb") as f:  # length (a NUL byte is the interpreter's SyntaxError)
                f.write(str(code).encode("utf-8", "replace"))
            if SANDBOX:  # the file bound read-only at /code.py, the only file of the call in sight
                cmd = SANDBOX + ["--ro-bind", path, "/code.py", "--", sys.executable, "-I",
                                 "/code.py"]
                cwd = "/"
            else:
                cmd, cwd = [sys.executable, "-I", path], folder
            cmd = limits(timeout, memory_mb) + cmd
            proc = subprocess.Popen(
                cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
                     "HOME": "/tmp" if SANDBOX else folder},
                start_new_session=True)  # its own process group: killed whole below
            note, deadline = None, time.monotonic() + timeout
            try:
                while note is None and proc.poll() is None:  # every 10 ms: time, processes,
                    pids = processes_of(proc.pid)  # memory (bwrap's own two processes count)
                    if time.monotonic() > deadline:
                        note = f"stopped: took more than {timeout:g} s"
                    elif len(pids) > processes:
                        note = f"stopped: more than {processes} processes"
                    elif resident_mb(pids) > memory_mb:
                        note = f"stopped: more than {memory_mb} MB of memory in all its processes"
                    time.sleep(0.01)
            finally:  # whatever it started goes too (in the sandbox: its PID namespace dies)
                for pid in [-proc.pid] + processes_of(proc.pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                proc.wait()
            if note is None and proc.returncode:
                note = f"exit code {proc.returncode}"
            out.seek(0)
            text = out.read(4 * output_chars + 4).decode("utf-8", "replace")
            size = os.fstat(out.fileno()).st_size
    finally:
        SLOTS.release()
    if len(text) > output_chars or size > 4 * output_chars + 4:
        text = text[:output_chars] + f"\n(output cut to {output_chars} characters)"
    return text + (f"\n({note})" if note else "")


def python(code: str) -> str:
    """Run Python code and return what it prints (stdout and stderr). Each call is a fresh
    interpreter with a 5 second limit, no network and no files kept between calls.

    Args:
        code: the Python program to run; print() what you want to see
    """
    return run_python(code)


CALL = re.compile(r"<python>(.*?)</python>\s*$", re.S)  # a turn that ends with code to run


def env(row, turns):
    """--env examples/python_tool.py:env: a turn ending in <python>CODE</python> gets the output
    (as ' <output>...</output> '); a turn without code is the answer and ends the episode. Use
    --stop "</python>" so that a turn ends at the closing tag."""
    call = CALL.search(turns[-1])
    return None if call is None else f" <output>{run_python(call.group(1))}</output> "


def write_task(path, n=200, seed=0):
    """The example task: list arithmetic a model solves reliably only by writing code."""
    import random
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            xs = [rng.randrange(10, 100) for _ in range(rng.randrange(5, 9))]
            kind = rng.choice(["squares", "product", "median"])
            if kind == "squares":
                q, a = "the sum of the squares of", sum(x * x for x in xs)
            elif kind == "product":
                xs = xs[:4]
                q, a = "the product of", eval("*".join(map(str, xs)))
            else:
                xs = xs[:7] if len(xs) % 2 == 0 else xs
                q, a = "the median of", sorted(xs)[len(xs) // 2]
            prompt = (f"What is {q} {xs}? You may run Python by writing <python>code</python>; "
                      "the output comes back. End with the answer as \\boxed{N}.")
            f.write(json.dumps({"prompt": prompt, "answer": str(a)}) + "\n")


if __name__ == "__main__":  # writes the task's data: no sandbox needed
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/python_tool.py FILE.jsonl")
    try:
        write_task(sys.argv[1])
    except OSError as e:
        sys.exit(f"python_tool: cannot write {sys.argv[1]!r}: {e.strerror}")
else:  # loaded as a tool: a sandbox, or refused now (not at the first call, hours in)
    SANDBOX = sandbox()
