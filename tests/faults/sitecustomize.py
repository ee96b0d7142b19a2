"""Test-only fault injection: a generator whose engine hangs while its heartbeat lives; stages slowed to a pace.

Kept out of the product by construction: nothing in covrl reads this file. Python imports a `sitecustomize` module
at start-up only when one is on its path, and only a test puts one there: it copies this file into a directory of
its own with a `hang.json` beside it and puts that directory on PYTHONPATH, which the launcher passes on to every
role (under Ray too, where it is the one variable of the launcher's that travels). A user's run cannot reach it.

hang.json = {"gen_id": G, "after": N, "claim_dir": DIR}: in the generator started with `--gen-id G`, the engine's
`generate` runs N times and then blocks forever on its next call, in the main thread, as a wedged CUDA kernel or
a deadlocked engine loop would: the heartbeat and weight threads go on, so the hub sees a live generator that
returns nothing. Only the first incarnation that gets there hangs (it creates DIR/genG.hung with O_EXCL and writes
its pid there), so the replacement the launcher starts works normally.

crash.json = {"gen_id": G, "after": N, "then": M, "claim_dir": DIR}: the generator started with `--gen-id G` exits
with code 1 (os._exit: no clean-up, as a crash) on its (N + 1)th `generate`; the first incarnation that gets there
claims DIR/genG.crashed, and every later one crashes on its (M + 1)th call instead (M = 0: as soon as it is given
work; M = -1: at start-up, before it reaches the hub; each crash appends its pid to the claim). A generator that keeps failing, for the tests of the launcher's failure window (tests/integration/
test_run_faults.py).

pace.json = {"generate_s": S, "lock": PATH or null, "learner_s": T}, read at every call (a test changes it while
the run trains): every generator's engine sleeps S seconds before each `generate` (a slower engine, without using
this machine's cores: what a far larger model on a GPU does to the pipeline), holding an exclusive lock on PATH
meanwhile when PATH is given (one service that every generator waits for in turn: more generators gain nothing);
the learner sleeps T seconds before each training step (a slower learner). The autoscale tests
(tests/integration/test_autoscale.py) use it to put the bottleneck where they want it.
"""

import os
import sys

_SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hang.json")
_PACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pace.json")
_CRASH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash.json")


def _install() -> None:
    import json

    with open(_SPEC) as f:
        spec = json.load(f)
    gen_id, after, claim_dir = str(spec["gen_id"]), spec["after"], spec["claim_dir"]
    argv = sys.orig_argv if hasattr(sys, "orig_argv") else sys.argv
    if "actors" not in argv or "--gen-id" not in argv or argv[argv.index("--gen-id") + 1] != gen_id:
        return
    _after_import("actors.engine",
                  lambda module: _wrap(module.TorchEngine, int(after), os.path.join(claim_dir, f"gen{gen_id}.hung")))


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


_PATCHES: dict[str, list] = {}  # module name -> what to call with it once imported


def _after_import(name: str, patch) -> None:
    """Call patch(module) once module `name` has been imported (its first import, wherever it comes from); one
    finder serves every patch, so hang.json and pace.json can both act on one module."""
    import importlib.abc
    import importlib.machinery

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in _PATCHES:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            run, patches = spec.loader.exec_module, _PATCHES.pop(fullname)

            def exec_module(module):
                run(module)
                for each in patches:
                    each(module)

            spec.loader.exec_module = exec_module
            return spec

    if not _PATCHES:
        sys.meta_path.insert(0, Hook())
    _PATCHES.setdefault(name, []).append(patch)


def _pace() -> dict:
    import json

    with open(_PACE) as f:
        return json.load(f)


def _paced_engine(module) -> None:
    import fcntl
    import time

    generate = module.TorchEngine.generate

    def paced(self, *args, **kwargs):
        pace = _pace()
        if pace.get("lock"):
            with open(pace["lock"], "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
                time.sleep(pace.get("generate_s", 0.0))
        else:
            time.sleep(pace.get("generate_s", 0.0))
        return generate(self, *args, **kwargs)

    module.TorchEngine.generate = paced


def _paced_learner(module) -> None:
    import time

    train_step = module.Trainer.train_step

    def paced(self, *args, **kwargs):
        time.sleep(_pace().get("learner_s", 0.0))
        return train_step(self, *args, **kwargs)

    module.Trainer.train_step = paced


def _install_pace() -> None:
    argv = sys.orig_argv if hasattr(sys, "orig_argv") else sys.argv
    if "actors" in argv:
        _after_import("actors.engine", _paced_engine)
    elif "learner" in argv:
        _after_import("learner.trainer", _paced_learner)


def _install_crash() -> None:
    import json

    with open(_CRASH) as f:
        spec = json.load(f)
    argv = sys.orig_argv if hasattr(sys, "orig_argv") else sys.argv
    gen_id = str(spec["gen_id"])
    if "actors" not in argv or "--gen-id" not in argv or argv[argv.index("--gen-id") + 1] != gen_id:
        return
    claim = os.path.join(spec["claim_dir"], f"gen{gen_id}.crashed")
    after = int(spec["then"]) if os.path.exists(claim) else int(spec["after"])
    if after < 0:  # at start-up, before it reaches the hub
        with open(claim, "a") as f:
            f.write(f"{os.getpid()}\n")
        print("test fault: the generator crashes at start-up", file=sys.stderr, flush=True)
        os._exit(1)

    def crashing(module) -> None:
        import logging

        generate, calls = module.TorchEngine.generate, [0]

        def crash(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] > after:
                with open(claim, "a") as f:
                    f.write(f"{os.getpid()}\n")
                logging.getLogger("covrl.test_fault").error("test fault: the generator crashes now (call %d)", calls[0])
                logging.shutdown()
                os._exit(1)
            return generate(self, *args, **kwargs)

        module.TorchEngine.generate = crash

    _after_import("actors.engine", crashing)


if os.path.exists(_SPEC):
    _install()
if os.path.exists(_CRASH):
    _install_crash()
if os.path.exists(_PACE):
    _install_pace()
