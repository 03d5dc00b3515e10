"""Ctrl-C in the seconds a script's imports take (torch and transformers: 5-10 s on a busy
laptop): one line and exit 130, not a traceback from inside torch. Each script imports this
first; it acts only when that script is the program run (not under pytest, not when imported)
and when Ctrl-C is not ignored. runs.main_guard hands Ctrl-C back to Python once main() starts."""
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def starting(signum, frame):
    os.write(2, b"\ninterrupted while starting: nothing was written\n")
    os._exit(130)  # nothing to clean up yet: no folder, no file, no thread


ours = os.path.dirname(os.path.abspath(sys.argv[0] or ".")) == ROOT and sys.argv[0].endswith(".py")
if ours and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, starting)
