"""How many torch threads should a run on a small model use? grpo.py's median seconds per step on
the bundled model with 1 and 2 torch threads, on an idle machine and beside 1 and 3 other busy
processes (`python -c "while True: pass"`, killed afterwards, also on an error or Ctrl-C).

    python bench/threads.py                      # --steps 40 --threads 1,2 --busy 0,1,3
    python bench/threads.py --repeats 2          # each cell twice, interleaved: less drift
    python bench/threads.py --model qwen2-16M --steps 12   # a random 15.8 M-parameter Qwen2

Each cell is one `python grpo.py --max_steps N --eval_size 20 --eval_every 0 --save_every 0` with
OMP_NUM_THREADS=t (torch's intra-op threads; the scripts do not set them, so by default torch
takes one per core). The time is the median `step_time` of metrics.jsonl after the first 5 steps
(sampling, reference log-probs, forward, backward, AdamW), so imports and evals do not count.
Anything else already running counts as load too: the table starts with what `ps` saw.
Results with date, hardware and what else ran: bench/RESULTS.md.
"""
import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUSY = []  # the busy-loop processes this script started


def stop_busy():
    while BUSY:
        p = BUSY.pop()
        p.kill()
        p.wait()


def on_sigterm(signum, frame):
    raise SystemExit(143)  # so that the finally and atexit handlers below run


def start_busy(n):
    for _ in range(n):
        BUSY.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))


def step_time(threads, steps, folder, model):
    """Median s/step of one grpo.py run with `threads` torch threads."""
    out = os.path.join(folder, f"t{threads}-{len(os.listdir(folder))}")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), "--max_steps", str(steps),
           "--eval_size", "20", "--eval_every", "0", "--save_every", "0", "--output_dir", out,
           *(["--model", model] if model else [])]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"grpo.py failed ({r.returncode}): {r.stderr[-500:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        times = [json.loads(line)["step_time"] for line in f]
    return statistics.median(times[min(5, steps // 3):])


def others():
    """What else is using the CPU now (ps, highest first), and the load average."""
    try:
        ps = subprocess.run(["ps", "-eo", "pcpu,args", "--sort=-pcpu"], capture_output=True,
                            text=True).stdout.splitlines()
    except OSError:
        ps = ["(no ps)"]
    busy = [line[:110] for line in ps[1:] if float(line.split()[0] or 0) >= 5.0
            and "bench/threads.py" not in line]  # not this script
    return busy, os.getloadavg()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="grpo.py steps per cell")
    p.add_argument("--threads", default="1,2", help="torch thread counts to compare")
    p.add_argument("--busy", default="0,1,3", help="numbers of busy processes beside the run")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell (interleaved)")
    p.add_argument("--model", default="", help="a model folder, or qwen2-16M (bench/bench.py's "
                   "random 4 x 512 Qwen2); default: the bundled tiny-adder")
    a = p.parse_args()
    label, made = a.model or "the bundled model", ""
    if a.model == "qwen2-16M":
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        from bench import random_qwen2
        a.model = made = random_qwen2(None, layers=4, hidden=512)
    threads = [int(t) for t in a.threads.split(",")]
    loads = [int(b) for b in a.busy.split(",")]
    busy, load = others()
    print(f"{os.cpu_count()} CPUs; load average {load[0]:.2f}; already using >= 5% CPU:")
    print("\n".join(f"  {line}" for line in busy) or "  nothing")
    signal.signal(signal.SIGTERM, on_sigterm)
    atexit.register(stop_busy)
    cells = {}
    try:
        with tempfile.TemporaryDirectory() as folder:
            for n in loads:
                start_busy(n)
                for _ in range(a.repeats):
                    for t in threads:
                        s = step_time(t, a.steps, folder, a.model)
                        cells.setdefault((n, t), []).append(s)
                        print(f"  {n} busy, {t} thread(s): {s:.3f} s/step", flush=True)
                stop_busy()
    finally:
        stop_busy()
        if made:  # random_qwen2's temporary folder
            shutil.rmtree(os.path.dirname(made), ignore_errors=True)
    print(f"\ngrpo.py median s/step ({label}; after the first "
          f"{min(5, a.steps // 3)} of {a.steps} steps; {a.repeats} run(s) per cell, median)")
    print(f"{'other busy processes':<22}" + "".join(f"{f'{t} thread(s)':>14}" for t in threads)
          + (f"{f'{threads[-1]} / {threads[0]}':>10}" if len(threads) > 1 else ""))
    for n in loads:
        row = [statistics.median(cells[n, t]) for t in threads]
        ratio = f"{row[-1] / row[0]:>9.2f}x" if len(threads) > 1 else ""
        print(f"{n:<22}" + "".join(f"{s:>14.3f}" for s in row) + ratio)
    print(json.dumps({f"busy{n}_threads{t}": round(statistics.median(v), 4)
                      for (n, t), v in cells.items()}))


if __name__ == "__main__":
    main()
