"""Runs mutmut's mutants by hand, for modules whose ``mutmut run`` is too slow under load (tests/README.md).

    cd mutants && python ../tests/mutants_by_hand.py --out ../mutants-pretrained.json \\
        --tests tests/test_mutants_finetune.py --tests tests/test_finetune.py \\
        'facepipe.models.pretrained.*'

Reads the mutant names from the copy ``mutmut run`` generated in ``mutants/`` (every ``__mutmut_N``
function of the named modules, filtered by the globs), imports pytest, torch and the mutated modules
once (and collects the first group's tests once), and forks one process per mutant and test group with ``MUTANT_UNDER_TEST`` set. The groups run
in order, ``-x -m "not slow and not multiprocess"``; a later group only if the earlier passed. A
mutant is killed when a group fails, survives when all pass, times out when a group runs past
``--timeout`` seconds (killed, and counted caught, as mutmut counts it). Verdicts go to ``--out``
(JSON, name -> verdict; a mutant it already holds as caught is skipped) and one line each to stdout.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

_MUTANT = re.compile(r"^\s*def (x[^\s(]*__mutmut_\d+)\(", re.MULTILINE)


def mutant_names(globs: list[str]) -> list[str]:
    """Every mutant of the modules the globs reach, in file order."""
    modules = {glob.split(".x")[0].rstrip(".*") for glob in globs}
    names = []
    for module in sorted(modules):
        source = Path(*module.split(".")).with_suffix(".py").read_text()
        names += [f"{module}.{name}" for name in _MUTANT.findall(source)]
    return [name for name in names if any(fnmatch.fnmatchcase(name, glob) for glob in globs)]


def run_group(name: str, files: list[str], *, timeout: float, log: Path, tb: str = "auto") -> str:
    pid = os.fork()
    if pid == 0:  # the child: one pytest session with the mutant switched on
        os.environ["MUTANT_UNDER_TEST"] = name
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        import pytest

        args = ["-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-m", "not slow and not multiprocess", f"--tb={tb}"]
        code = pytest.main([*args, *files])
        os._exit(int(code))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return "passed" if code == 0 else "killed"
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "timeout"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("globs", nargs="+")
    parser.add_argument("--tests", action="append", required=True, help="a test group: files separated by commas")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--tb",
        default="auto",
        help="pytest's traceback style in the logs: 'line' skips parsing the mutated module (seconds a failure when it holds hundreds of mutants)",
    )
    args = parser.parse_args()
    sys.path.insert(0, os.getcwd())
    os.environ.pop("MUTANT_UNDER_TEST", None)
    import pytest
    import torch

    torch.set_num_threads(1)
    names = mutant_names(args.globs)
    for module in {name.rsplit(".", 1)[0] for name in names}:
        importlib.import_module(module)
    # collecting once here imports pytest's plugins, the conftest and the test modules before the forks
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            pytest.main(["--collect-only", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", *args.tests[0].split(",")])
        finally:
            sys.stdout = stdout
    verdicts = json.loads(args.out.read_text()) if args.out.exists() else {}
    logs = args.out.with_suffix(".logs")
    logs.mkdir(exist_ok=True)
    print(f"{len(names)} mutants", flush=True)
    for name in names:
        if verdicts.get(name) in ("killed", "timeout"):  # caught before: new tests cannot bring it back
            continue
        started, verdict = time.monotonic(), "survived"
        log = logs / f"{name}.log"
        log.unlink(missing_ok=True)
        for group in args.tests:
            outcome = run_group(name, group.split(","), timeout=args.timeout, log=log, tb=args.tb)
            if outcome != "passed":
                verdict = outcome
                break
        verdicts[name] = verdict
        args.out.write_text(json.dumps(verdicts, indent=1, ensure_ascii=False))
        print(f"{verdict:8} {time.monotonic() - started:6.1f} s  {name}", flush=True)


if __name__ == "__main__":
    main()
