"""A warm Python for the suite's command-line calls (conftest.run_script): it imports torch and
transformers once, then forks one child per call, which runs the script as `python SCRIPT ARGS`
(or `python -m MODULE ARGS`) would: its own process, its own arguments, environment, working
directory, stdin, stdout, stderr and exit status. What a call saves is the ~5 s of imports
(2-core AVX2 machine) that each of the suite's ~40 quick CLI checks paid before.

Protocol, one JSON line each way per call. In: {"argv": [...], "cwd", "env", "stdin",
"stdout", "stderr"} (file paths). Out: {"pid": N} when the child starts, then {"status": S}
with the exit status (negative: killed by signal -S).

Nothing here runs a torch operation: the zygote starts no threads, so forking it is safe.
"""

import atexit
import json
import os
import runpy
import sys
import traceback

STARTED_WITH = dict(os.environ)

import torch  # noqa: E402, F401  # the imports every child would otherwise pay for
import torch.distributed.tensor  # noqa: E402, F401
import transformers  # noqa: E402, F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402, F401  # (transformers' lazy modules)

# what those imports put in the environment, as they would in a fresh process: given to each call
# beneath its own environment (a key the call sets keeps the call's value)
IMPORTS_SET = {k: v for k, v in os.environ.items() if os.environ.get(k) != STARTED_WITH.get(k)}


def child(call: dict) -> int:
    """Run one call as `python argv...` would, in this (forked) process; its exit status."""
    os.chdir(call["cwd"])
    os.environ.clear()
    os.environ.update(IMPORTS_SET | call["env"])
    for fd, name, mode in (
        (0, "stdin", os.O_RDONLY),
        (1, "stdout", os.O_WRONLY | os.O_CREAT),
        (2, "stderr", os.O_WRONLY | os.O_CREAT),
    ):
        target = os.open(call[name], mode)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # not the zygote's reader of calls, which may hold buffered input
    argv = call["argv"]
    # sys.path as the interpreter would start it: the script's directory (the working directory
    # for -m), then the call's PYTHONPATH; other start-up variables (PYTHONIOENCODING, ...) are
    # the zygote's, so a test that sets one runs its script with subprocess instead
    first = os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *[p for p in sys.path[1:] if p not in extra]]
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:  # as the interpreter reports it: None is 0, a message goes to stderr with 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  # an uncaught exception: its traceback and exit 1, as python does
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> None:
    for line in sys.stdin:
        call = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = child(call)
            finally:  # never back into this loop: a second zygote
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
