"""What train.py and sample.py share: turning bad user input into one line and exit code 1."""

import contextlib
import os
import shutil
import sys

from flm import dist

# Failures that come from the user's input; anything else keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FloatingPointError)


def user_error(e: BaseException) -> BaseException | None:
    """The user-facing error behind `e` (Hydra's instantiate wraps the errors of config targets), else None."""
    if type(e).__name__ == "InstantiationException" and e.__cause__ is not None:
        e = e.__cause__
    if isinstance(e, USER_ERRORS) or (isinstance(e, ImportError) and "pip install" in str(e)):
        return e
    return None


def only_hydra_files(run_dir: str) -> bool:
    """True when the folder holds nothing but what Hydra wrote before the run started."""
    return os.path.isdir(run_dir) and set(os.listdir(run_dir)) <= {".hydra", "train.log"}


@contextlib.contextmanager
def report_user_errors(run_dir: str | None = None):
    """Print `error: <message>` and exit 1 on a user error (HYDRA_FULL_ERROR=1: the traceback instead);
    remove `run_dir` when the run wrote nothing into it yet. Closes the process group either way."""
    try:
        yield
    except Exception as e:
        cause = user_error(e)
        if cause is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {cause}", file=sys.stderr, flush=True)
        if run_dir and dist.is_main() and only_hydra_files(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)  # leave nothing half-written behind
        sys.exit(1)
    finally:
        dist.close()
