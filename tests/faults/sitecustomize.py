"""Test-only fault injection: a generator whose engine hangs while its heartbeat lives.

Kept out of the product by construction: nothing in covrl reads this file. Python imports a `sitecustomize` module
at start-up only when one is on its path, and only a test puts one there: it copies this file into a directory of
its own with a `hang.json` beside it and puts that directory on PYTHONPATH, which the launcher passes on to every
role (under Ray too, where it is the one variable of the launcher's that travels). A user's run cannot reach it.

hang.json = {"gen_id": G, "after": N, "claim_dir": DIR}: in the generator started with `--gen-id G`, the engine's
`generate` runs N times and then blocks forever on its next call, in the main thread, as a wedged CUDA kernel or
a deadlocked engine loop would: the heartbeat and weight threads go on, so the hub sees a live generator that
returns nothing. Only the first incarnation that gets there hangs (it creates DIR/genG.hung with O_EXCL and writes
its pid there), so the replacement the launcher starts works normally.
"""

import os
import sys

_SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hang.json")


def _install() -> None:
    import json

    with open(_SPEC) as f:
        spec = json.load(f)
    gen_id, after, claim_dir = str(spec["gen_id"]), spec["after"], spec["claim_dir"]
    argv = sys.orig_argv if hasattr(sys, "orig_argv") else sys.argv
    if "actors" not in argv or "--gen-id" not in argv or argv[argv.index("--gen-id") + 1] != gen_id:
        return
    import importlib.abc
    import importlib.machinery

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "actors.engine":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _wrap(module.TorchEngine, int(after), os.path.join(claim_dir, f"gen{gen_id}.hung"))

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Hook())


def _wrap(cls, after: int, claim: str) -> None:
    import logging
    import threading

    generate, calls = cls.generate, [0]

    def hanging(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] > after:
            try:
                fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                pass  # an earlier incarnation hung already: this one works
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                logging.getLogger("covrl.test_fault").error("test fault: the engine hangs now (call %d)", calls[0])
                threading.Event().wait()  # forever; only SIGKILL (or the end of the test) ends this process
        return generate(self, *args, **kwargs)

    cls.generate = hanging


if os.path.exists(_SPEC):
    _install()
