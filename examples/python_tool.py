"""A Python interpreter as a tool: the model's code runs in a separate process that cannot hang
the run, fill the disk, reach the network or leave anything behind.

  --tools examples/python_tool.py:python      a chat model calls python(code) in its own format
  --env examples/python_tool.py:env           a model that writes <python>...</python> gets the
                                              output back as the observation (any model)
  python examples/python_tool.py FILE.jsonl   writes the example task: list arithmetic (sums of
                                              squares, products, sorted medians) that is easy in
                                              code and hard in the head; "answer" is the number

run_python(code) is the sandbox; import it in your own env (docs/tool_use.md). Its limits:
- wall clock: `timeout` seconds (default 5), then the whole process group is killed (SIGKILL),
  children included; the CPU time is capped at the same (RLIMIT_CPU);
- memory: `memory_mb` of address space (RLIMIT_AS, default 512 MB): a MemoryError, not the host;
- output: stdout and stderr together, cut to `output_chars` (default 2,000) characters; each file
  the code writes is capped at 16 MB (RLIMIT_FSIZE), and 64 open files (RLIMIT_NOFILE);
- where the OS allows unprivileged namespaces (Linux, `unshare` from util-linux; checked once):
  no network at all (a network namespace with no interface up: even 127.0.0.1 is unreachable),
  the whole file system read-only but a 64 MB tmpfs at /tmp (its working folder) and /dev/shm,
  and its own process namespace (a process that escapes the group dies with the namespace).
  Without them (macOS, a container that forbids them) the code runs in a temporary folder that is
  removed after, with the limits above, but CAN reach the network and write where the user can:
  run_python says so once on stderr. That is a sandbox for a model's mistakes, not for an
  adversary: run untrusted models' code in a container or VM too.
The interpreter runs isolated (`python -I`: no user site-packages, no PYTHON* variables, the
folder of the code not on sys.path) with an environment of PATH and HOME only.
"""
import functools
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

TIMEOUT_S, MEMORY_MB, OUTPUT_CHARS, FILE_MB, TMPFS_MB = 5.0, 512, 2000, 16, 64

# in the namespaces: a size-capped tmpfs on /tmp and /dev/shm, everything else read-only, then
# the interpreter in /tmp (the code is the script's first argument)
INSIDE = ("mount -t tmpfs -o size={mb}m tmpfs /tmp && mount -t tmpfs -o size={mb}m tmpfs "
          "/dev/shm && mount -o remount,bind,ro / && cd /tmp && exec \"$0\" -I -c \"$1\"")


@functools.lru_cache(maxsize=1)
def namespaces():
    """The command prefix that runs a process with no network, a read-only file system and its
    own process namespace, or None where the OS refuses them (said once on stderr)."""
    prefix = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork",
              "--kill-child"]
    try:
        ok = shutil.which("unshare") and subprocess.run(
            prefix + ["sh", "-c", INSIDE.format(mb=1).replace('exec "$0" -I -c "$1"', "true")],
            capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        print("python_tool: no unprivileged namespaces here (unshare): the code runs with the "
              "limits of time, memory and output only, and can reach the network",
              file=sys.stderr)
    return prefix if ok else None


def _limits(seconds, memory_mb):
    """In the child, before it runs the code: CPU time, address space, file size, open files."""
    cpu = int(seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_MB << 20, FILE_MB << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code, timeout=TIMEOUT_S, memory_mb=MEMORY_MB, output_chars=OUTPUT_CHARS):
    """Run `code` in a separate, limited process (the module docstring); its stdout and stderr
    together, cut to output_chars, plus a last line when it was stopped or failed."""
    with tempfile.TemporaryDirectory(prefix="minrl-python-") as folder:
        out_path = os.path.join(folder, "output")
        prefix = namespaces()
        if prefix:
            cmd = prefix + ["sh", "-c", INSIDE.format(mb=TMPFS_MB), sys.executable, code]
        else:
            cmd = [sys.executable, "-I", "-c", code]
        with open(out_path, "wb") as out:  # a file, not a pipe: its size is capped (FSIZE)
            proc = subprocess.Popen(
                cmd, cwd=folder, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": folder},
                start_new_session=True,  # its own process group: killed whole below
                preexec_fn=functools.partial(_limits, timeout, memory_mb))
            try:
                code_ = proc.wait(timeout=timeout)
                note = "" if code_ == 0 else f"\n(exit code {code_})"
            except subprocess.TimeoutExpired:
                note = f"\n(stopped: took more than {timeout:g} s)"
            finally:  # whatever it started goes too (the namespace's processes die with it)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        with open(out_path, "rb") as f:
            text = f.read(4 * output_chars + 4).decode("utf-8", "replace")
        size = os.path.getsize(out_path)
    if len(text) > output_chars or size > 4 * output_chars + 4:
        text = text[:output_chars] + f"\n(output cut to {output_chars} characters)"
    return text + note


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
    import json
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/python_tool.py FILE.jsonl")
    write_task(sys.argv[1])
