"""What train.py and sample.py share: turning bad user input into one line and exit code 1."""

import contextlib
import os
import shutil
import sys

from flm import dist

# Failures that come from the user's input; anything else keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FloatingPointError)

# The one-line errors of the failed jobs of a multirun so far (report_user_errors(job=...)).
FAILED_JOBS: list[str] = []


def user_error(e: BaseException) -> BaseException | None:
    """The user-facing error behind `e` (Hydra's instantiate wraps the errors of config targets), else None."""
    if type(e).__name__ == "InstantiationException" and e.__cause__ is not None:
        e = e.__cause__
    if isinstance(e, USER_ERRORS) or (isinstance(e, ImportError) and "pip install" in str(e)):
        return e
    return None


def only_hydra_files(run_dir: str) -> bool:
    """True when the folder holds nothing but what Hydra wrote before the run started (.hydra/, the job's log)."""
    return os.path.isdir(run_dir) and all(name == ".hydra" or name.endswith(".log") for name in os.listdir(run_dir))


@contextlib.contextmanager
def report_user_errors(run_dir: str | None = None, *, job: str | None = None):
    """Print `error: <message>` and exit 1 on a user error (HYDRA_FULL_ERROR=1: the traceback instead);
    remove `run_dir` when the run wrote nothing into it yet. Closes the process group either way.

    job: the job's name in a multirun; its error is printed and kept in FAILED_JOBS instead of exiting,
    so the other jobs still run (the entry point exits 1 at the end: exit_if_jobs_failed).
    """
    try:
        yield
    except Exception as e:
        cause = user_error(e)
        if cause is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {cause}", file=sys.stderr, flush=True)
        if run_dir and dist.is_main() and only_hydra_files(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)  # leave nothing half-written behind
        if job is None:
            sys.exit(1)
        FAILED_JOBS.append(f"{job}: {cause}")
    finally:
        dist.close()


def exit_if_jobs_failed() -> None:
    """After a multirun: list the jobs that failed and exit 1, if any did."""
    if FAILED_JOBS:
        print(f"error: {len(FAILED_JOBS)} job(s) failed:\n" + "\n".join(f"  {line}" for line in FAILED_JOBS),
              file=sys.stderr, flush=True)
        sys.exit(1)
