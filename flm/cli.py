"""What train.py and sample.py share: turning bad user input into one line and exit code 1."""

import contextlib
import os
import shutil
import sys

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from flm import dist
from flm.files import DISK_ERRNOS, LOCK_NAME

# Failures that come from the user's input; anything else keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FloatingPointError)

# The one-line errors of the failed jobs of a multirun so far (report_user_errors(job=...)).
FAILED_JOBS: list[str] = []


def user_error(e: BaseException) -> BaseException | None:
    """The user-facing error behind `e` (Hydra's instantiate wraps the errors of config targets), else None."""
    if type(e).__name__ == "InstantiationException" and e.__cause__ is not None:
        e = e.__cause__
    if type(e).__name__ == "MissingMandatoryValue":  # a `???` in the config: imagefolder's data.root, sample's ckpt
        return ValueError(f"{e.full_key} is not set; pass {e.full_key}=<value> (see its config file's comment)")
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS:  # a full disk, a read-only folder: not a bug
        return e
    if isinstance(e, USER_ERRORS) or (isinstance(e, ImportError) and "pip install" in str(e)):
        return e
    return None


def check_model_choices(argv: list[str], config_dir: str) -> None:
    """Refuse a `model=NAME` override that names no model config, in one line that lists the models. The model configs
    are nested folders (model/DiT-S/2.yaml), for which Hydra's own error lists no options. Sweeps (`model=A,B`) are
    checked name by name; Hydra's sweep functions (choice(...), glob(...)) are left to Hydra."""
    models = os.path.join(config_dir, "model")
    for arg in argv:
        if not arg.startswith("model=") or "(" in arg:
            continue
        for name in arg.split("=", 1)[1].split(","):
            name = name.strip().strip("'\"")  # Hydra's grammar takes quoted values
            if not os.path.isfile(os.path.join(models, name + ".yaml")):
                valid = sorted(
                    os.path.relpath(os.path.join(root, f), models)[: -len(".yaml")]
                    for root, _, files in os.walk(models)
                    for f in files
                    if f.endswith(".yaml")
                )
                sys.exit(f"error: model={name} is not a model; valid: {', '.join(valid)}")


# What each recorded folder held before Hydra wrote into it (absolute path -> names; None: it did not exist).
_BEFORE: dict[str, set[str] | None] = {}
# The folders above each recorded one that did not exist either, deepest first (the default run_dir's date folder).
_MISSING_PARENTS: dict[str, list[str]] = {}


def record_folder(path: str) -> None:
    """Note what `path` holds now, and which folders above it do not exist yet, before Hydra creates or writes into it."""
    path = os.path.abspath(path)
    _BEFORE[path] = set(os.listdir(path)) if os.path.isdir(path) else None
    missing, parent = [], os.path.dirname(path)
    while parent != os.path.dirname(parent) and not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    _MISSING_PARENTS[path] = missing


class RecordRunFolder(Callback):
    """Hydra callback (configs/train.yaml): records the run folder (a multirun's sweep folder) before
    Hydra writes into it, so that a failed run removes only what it wrote there."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        record_folder(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        record_folder(config.hydra.sweep.dir)


def names_before(run_dir: str) -> set[str] | None:
    """The names `run_dir` held before this run (None: it did not exist); KeyError when nobody recorded it."""
    if run_dir in _BEFORE:
        return _BEFORE[run_dir]
    parent = _BEFORE[os.path.dirname(run_dir)]  # a multirun's job folder: new unless its sweep folder had it
    if parent is None or os.path.basename(run_dir) not in parent:
        return None
    raise KeyError(run_dir)


def remove_what_the_run_wrote(run_dir: str) -> None:
    """Undo a run that failed before writing anything of its own: remove the files Hydra added for it
    (.hydra/, the job's log), its lock file and the folder itself if the run created it, with the folders above it that
    the run created and that are still empty. Anything else in the folder, and every folder the run did not record
    (flm.cli.RecordRunFolder), stays as it is."""
    run_dir = os.path.abspath(run_dir)
    try:
        before = names_before(run_dir)
    except KeyError:
        return
    if not os.path.isdir(run_dir):
        return
    new = set(os.listdir(run_dir)) - (before or set())
    if not all(name in (".hydra", LOCK_NAME) or name.endswith(".log") for name in new):
        return  # the run wrote something of its own: keep it all for the user to look at
    for name in new:
        target = os.path.join(run_dir, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        else:
            os.remove(target)
    if before is None and not os.listdir(run_dir):
        os.rmdir(run_dir)
        for parent in _MISSING_PARENTS.get(run_dir, []):
            try:
                os.rmdir(parent)  # only if empty: another run may have started in it since
            except OSError:
                break


@contextlib.contextmanager
def report_user_errors(run_dir: str | None = None, *, job: str | None = None):
    """Print `error: <message>` and exit 1 on a user error (HYDRA_FULL_ERROR=1: the traceback instead);
    undo what Hydra wrote into `run_dir` when the run wrote nothing there yet (remove_what_the_run_wrote).
    Closes the process group either way.

    job: the job's name in a multirun; its error is printed and kept in FAILED_JOBS instead of exiting,
    so the other jobs still run (the entry point exits 1 at the end: exit_if_jobs_failed).
    """
    finished = False
    try:
        yield
        finished = True
    except Exception as e:
        cause = user_error(e)
        if cause is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {cause}", file=sys.stderr, flush=True)
        if run_dir and dist.is_main():
            remove_what_the_run_wrote(run_dir)  # leave nothing half-written behind, and nothing of the user's lost
        if job is None:
            sys.exit(1)
        FAILED_JOBS.append(f"{job}: {cause}")
    finally:
        dist.close(synchronize=finished)


def exit_if_jobs_failed() -> None:
    """After a multirun: list the jobs that failed and exit 1, if any did."""
    if FAILED_JOBS:
        print(
            f"error: {len(FAILED_JOBS)} job(s) failed:\n" + "\n".join(f"  {line}" for line in FAILED_JOBS),
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
