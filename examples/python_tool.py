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
- an empty root holding, read-only, only what the interpreter needs (its program, its stdlib
  and libraries, its site-packages, /usr and the library folders; never a venv's root nor a
  folder a .pth names, where a .env could sit), a private 64 MB tmpfs at /tmp (its working
  folder) and at /dev/shm, a fresh read-only /proc and a minimal /dev: the checkout, your home,
  the run folders and every socket file on the host are out of sight;
- new namespaces for everything (--unshare-all): no network at all (not even 127.0.0.1), no
  other process visible, no capability (--cap-drop ALL), so the code cannot mount, remount or
  unmount anything; it dies with the run (--die-with-parent);
- a system-call filter (seccomp) that refuses what reaches past the namespaces: the kernel
  keyring (the run's keys), SysV shared memory and memfds (memory no process holds), a new user
  namespace (on any bubblewrap; 0.8+ also gets --disable-userns);
- limits: `timeout` seconds of wall clock (default 5; CPU time too), `memory_mb` (default 512) of
  address space per process and of resident memory for the whole call, `processes` (default 16)
  processes and threads in the whole call (the last two checked every 10 ms: the call is
  stopped, not the host; for a user other than root the kernel refuses extra tasks too), 16 MB
  a file, 64 open files, output cut to `output_chars` (default 2,000) characters; at most
  MAX_CALLS calls at once (a call waits for a slot; under minrl's envs the wait does not count
  against --env_timeout).
Where bubblewrap is missing or cannot start (macOS, a container that forbids namespaces), loading
this file as a tool refuses in one line, unless MINRL_UNSAFE_TOOLS=1: then the code runs with
the limits above but NOT contained (it can read and write your files, reach the network and kill
the run), as said once when the tool loads. A sandbox that stops starting later (the host out of
namespaces) fails the call (SandboxError: said on stderr, counted in tool_errors), and
STOP_AFTER such calls in a row stop the run. Even sandboxed, run an untrusted model's code on a
machine you can lose: a kernel bug is an escape.
"""
import contextlib
import json
import os
import re
import shutil
import signal
import site
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

TIMEOUT_S, MEMORY_MB, PROCESSES, OUTPUT_CHARS, FILE_MB, TMPFS_MB = 5.0, 512, 16, 2000, 16, 64
MAX_CALLS = 8  # sandboxes at once: all calls hold about MAX_CALLS * memory_mb (docs/tool_use.md:
# what the limit does not count, about 230 MB a call)
SLOTS = threading.BoundedSemaphore(MAX_CALLS)
STOP_AFTER = 8  # calls in a row whose sandbox failed to start: the run stops (not the model's)
FAILED, FAILED_LOCK = {"in_a_row": 0}, threading.Lock()
UNSAFE = "MINRL_UNSAFE_TOOLS"  # =1: run the code without a sandbox where bubblewrap cannot run
try:  # under minrl's --env / --tools: waiting for a slot does not count against --env_timeout,
    from plumbing.envs import paused  # and a UserError stops the run in one line
    from plumbing.errors import UserError
except ImportError:
    paused, UserError = contextlib.nullcontext, RuntimeError


class SandboxError(RuntimeError):
    """The sandbox did not start (bubblewrap's own error): the call failed, its code never ran."""


# The system calls the filter refuses, by machine: (its AUDIT_ARCH, {name: number}) from the
# kernel's tables. keyctl, add_key, request_key: the kernel keyring is not namespaced, so a key of
# the run's session (`keyctl add ... @s`) would be read inside (Docker refuses these three too).
# shmget, memfd_create, memfd_secret: memory that stays in the kernel with no process holding it
# as resident, so the 10 ms check never sees it. unshare, and clone with CLONE_NEWUSER: a user
# namespace of the code's own, where it could mount (what --disable-userns stops on bubblewrap
# 0.8+). clone3 answers ENOSYS (its flags are in memory, out of a filter's reach): the C library
# then uses clone.
SYSCALLS = {
    "x86_64": (0xC000003E, dict(keyctl=250, add_key=248, request_key=249, shmget=29,
                                memfd_create=319, memfd_secret=447, unshare=272, clone=56,
                                clone3=435)),
    "aarch64": (0xC00000B7, dict(keyctl=219, add_key=217, request_key=218, shmget=194,
                                 memfd_create=279, memfd_secret=447, unshare=97, clone=220,
                                 clone3=435)),
}
REFUSED = ("keyctl", "add_key", "request_key", "shmget", "memfd_create", "memfd_secret", "unshare")


def syscall_filter():
    """The seccomp program (classic BPF, the form bubblewrap's --seccomp reads): REFUSED and
    clone(CLONE_NEWUSER) get EPERM, clone3 ENOSYS, a system call of another architecture (32-bit
    code, x32) kills the process, the rest run. None on a machine not in SYSCALLS."""
    if os.uname().machine not in SYSCALLS:
        return None
    arch, number = SYSCALLS[os.uname().machine]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # load a word, jumps, return
    ALLOW, KILL, EPERM, ENOSYS = 0x7FFF0000, 0x80000000, 0x50001, 0x50026  # SECCOMP_RET_*
    # an instruction: (code, skip if true, skip if false, constant); seccomp_data holds the
    # call's number at byte 0, the architecture at 4, its first argument from 16
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, KILL),
            (LD, 0, 0, 0), (JGE, 0, 1, 0x40000000), (RET, 0, 0, KILL)]  # x32's (bit 30 set)
    for name in REFUSED:
        prog += [(JEQ, 0, 1, number[name]), (RET, 0, 0, EPERM)]
    prog += [(JEQ, 0, 1, number["clone3"]), (RET, 0, 0, ENOSYS),
             (JEQ, 0, 3, number["clone"]), (LD, 0, 0, 16),  # clone's flags
             (JSET, 0, 1, 0x10000000), (RET, 0, 0, EPERM),  # CLONE_NEWUSER
             (RET, 0, 0, ALLOW)]
    return b"".join(struct.pack("HBBI", *op) for op in prog)


def interpreter_paths():
    """What the interpreter reads, at the paths it reads them: its program, its installation's
    lib folder (libpython, a conda env's C libraries, the stdlib), the stdlib, the site-packages
    folders (a venv's; the system's with --system-site-packages) and a venv's pyvenv.cfg. Not
    the venv's root, nor sys.path's other folders (one a .pth names: an editable install's
    checkout): a .env or a pip.conf there would be read by the code."""
    return [sys.executable, os.path.join(sys.base_prefix, "lib"), sysconfig.get_paths()["stdlib"],
            *site.getsitepackages(), os.path.join(sys.prefix, "pyvenv.cfg")]


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
    for path in sorted({q for p in interpreter_paths() if os.path.exists(p)  # where it is
                        for q in (os.path.abspath(p), os.path.realpath(p))}):  # and links to
        cmd += ["--ro-bind", path, path]
    cmd += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev",
            "--size", str(TMPFS_MB << 20), "--tmpfs", "/dev/shm", "--chdir", "/tmp"]
    try:  # (without bwrap: MINRL_UNSAFE_TOOLS=1 here)
        out, why = run(cmd, "pass", 30, MEMORY_MB, OUTPUT_CHARS, PROCESSES) if bwrap else (
            "", "bubblewrap (bwrap) is not installed")
        why = why or (out.strip().splitlines() or [None])[0]  # the interpreter cannot start
    except OSError as e:
        why = f"{type(e).__name__}: {e}"
    if not why and FILTER is None:
        print(f"python_tool: no system-call filter for {os.uname().machine} (x86_64 and aarch64 "
              "have one): the kernel keyring, SysV shared memory and memfds are open inside",
              file=sys.stderr)
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


def limits(seconds, memory_mb, processes=None):
    """The command (util-linux's prlimit) that sets the limits of the call's first process, which
    all it starts inherit: CPU time, address space, file size, open files, no core dumps, and
    (inside the sandbox, where only the sandbox's own tasks count) processes and threads. A
    command, not Popen's preexec_fn: Python code between fork and exec in a process with threads
    (torch's, the envs' workers) can crash the child. Without prlimit (not Linux): none, only the
    limits run_python polls."""
    cpu = int(seconds) + 1
    if not shutil.which("prlimit"):
        return []
    # processes: the call's count less bwrap's outer process, which is not in the sandbox (root is
    # exempt from RLIMIT_NPROC: the poll counts)
    tasks = [f"--nproc={processes - 1}"] if processes else []
    return ["prlimit", f"--cpu={cpu}", f"--as={memory_mb << 20}", f"--fsize={FILE_MB << 20}",
            "--nofile=64", "--core=0", *tasks, "--"]


def processes_of(pid):
    """pid and every process below it (Linux's /proc/PID/task/TID/children), as found now, and
    how many tasks (processes and their threads) they run together."""
    found, tasks, todo = [], 0, [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        with contextlib.suppress(OSError):
            threads = os.listdir(f"/proc/{p}/task")
            tasks += len(threads)
            for task in threads:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return found, tasks


def resident_mb(pids):
    """The resident memory of these processes together, in MB (pages shared after a fork count
    in each: an overcount, never an undercount)."""
    pages = 0
    for p in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{p}/statm") as f:
                pages += int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def start(sandbox, path, seconds, memory_mb, processes, out, err):
    """Start one call: the file `path` run by a fresh interpreter under its limits, in `sandbox`
    (bwrap's command line) or, where it is None, in the file's folder. Its output goes to `out`;
    bubblewrap's own errors to `err` (the code's stderr is joined to its stdout inside, so the
    code cannot write there)."""
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
           "HOME": "/tmp" if sandbox else os.path.dirname(path),
           "OMP_NUM_THREADS": "1"}  # numpy's BLAS: one thread, not one a core (the task limit)
    if sandbox is None:
        return subprocess.Popen(limits(seconds, memory_mb) + [sys.executable, "-I", path],
                                cwd=os.path.dirname(path), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # its own process group: killed whole
    fds = []  # the filter, for bwrap to read from a pipe (--seccomp FD)
    if FILTER is not None:
        read, write = os.pipe()
        os.write(write, FILTER)
        os.close(write)
        fds = [read]
    cmd = (sandbox + [a for fd in fds for a in ("--seccomp", str(fd))] +
           ["--ro-bind", path, "/code.py", "--"] +  # the only file of the call in sight
           limits(seconds, memory_mb, processes) +
           ["sh", "-c", 'exec "$@" 2>&1', "sh", sys.executable, "-I", "/code.py"])
    try:
        return subprocess.Popen(cmd, cwd="/", stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=env, start_new_session=True, pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)


def run(sandbox, code, timeout, memory_mb, output_chars, processes):
    """Run `code` (any text, any length) in `sandbox` -> (its stdout and stderr together, cut to
    output_chars, plus a last line when it was stopped or failed; bubblewrap's error, or None)."""
    with paused():
        SLOTS.acquire()  # at most MAX_CALLS at once
    try:
        with tempfile.TemporaryDirectory(prefix="minrl-python-") as folder, \
                tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            path = os.path.join(folder, "code.py")  # a file, not an argument: any bytes, any
            with open(path, "wb") as f:  # length (a NUL byte is the interpreter's SyntaxError)
                f.write(str(code).encode("utf-8", "replace"))
            proc = start(sandbox, path, timeout, memory_mb, processes, out, err)
            note, deadline = None, time.monotonic() + timeout
            try:
                while note is None and proc.poll() is None:  # every 10 ms: time, tasks,
                    pids, tasks = processes_of(proc.pid)  # memory (bwrap's own two count)
                    if time.monotonic() > deadline:
                        note = f"stopped: took more than {timeout:g} s"
                    elif tasks > processes:
                        note = f"stopped: more than {processes} processes or threads"
                    elif resident_mb(pids) > memory_mb:
                        note = f"stopped: more than {memory_mb} MB of memory in all its processes"
                    time.sleep(0.01)
            finally:  # whatever it started goes too (in the sandbox: its PID namespace dies)
                for pid in [-proc.pid] + processes_of(proc.pid)[0]:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                proc.wait()
            if note is None and proc.returncode:
                note = f"exit code {proc.returncode}"
            out.seek(0)
            text = out.read(4 * output_chars + 4).decode("utf-8", "replace")
            size = os.fstat(out.fileno()).st_size
            err.seek(0)
            failed = err.read(1000).decode("utf-8", "replace").strip().splitlines()
    finally:
        SLOTS.release()
    if len(text) > output_chars or size > 4 * output_chars + 4:
        text = text[:output_chars] + f"\n(output cut to {output_chars} characters)"
    return text + (f"\n({note})" if note else ""), (failed or [None])[-1]


def run_python(code, timeout=TIMEOUT_S, memory_mb=MEMORY_MB, output_chars=OUTPUT_CHARS,
               processes=PROCESSES):
    """Run `code` (any text, any length) in the sandbox (the module docstring); its stdout and
    stderr together, cut to output_chars, plus a last line when it was stopped or failed.
    A sandbox that did not start raises SandboxError (said on stderr); STOP_AFTER of them in a
    row raise UserError, which stops a minrl run in one line."""
    text, why = run(SANDBOX, code, timeout, memory_mb, output_chars, processes)
    with FAILED_LOCK:  # (said in the order counted; once the run stops, nothing more)
        FAILED["in_a_row"] = FAILED["in_a_row"] + 1 if why else 0
        n = FAILED["in_a_row"]
        if why and n < STOP_AFTER:
            print(f"python_tool: a call failed, its sandbox did not start ({n} in a row): {why}",
                  file=sys.stderr)
    if why is None:
        return text
    if n >= STOP_AFTER:
        raise UserError(f"python_tool: the sandbox (bubblewrap) failed to start on {n} calls in "
                        f"a row: {why}; the run stops rather than train on failed calls")
    raise SandboxError(f"the sandbox failed to start, the code did not run: {why}")


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
    if call is None:
        return None
    try:
        return f" <output>{run_python(call.group(1))}</output> "
    except SandboxError as e:  # a failed call: tool_errors counts observations that start so
        return f" error: {e} "


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
    FILTER = syscall_filter()
    SANDBOX = sandbox()
