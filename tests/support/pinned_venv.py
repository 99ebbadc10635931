"""Pinned PyPI packages for a test, in a virtual environment kept in the build folder.

The environment is made once; later runs reuse it while `check` (Python code run by its
interpreter) exits 0, i.e. while it still holds the pinned versions. Where pip fails because PyPI
cannot be reached, the test exits 77 with the reason, which CTest (SKIP_RETURN_CODE) and the
GoogleTest cases that run such a script report as skipped, never as passed.
"""
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

SKIPPED = 77


def pypi_unreachable(package):
    """Why PyPI cannot be reached ("" when it answers for `package`)."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        with urllib.request.urlopen(f"{index}/{package}/", timeout=30) as answer:
            answer.read(1)
        return ""
    except (urllib.error.URLError, OSError) as error:
        return f"{index}: {error}"


def pinned_python(venv, check, install, what, package):
    """The python of `venv` once `check` passes there; otherwise makes `venv` afresh and runs
    `pip install` with the arguments `install`. `what` names the packages in messages, `package`
    is the one whose PyPI page tells whether PyPI answers. Exits 77
    when PyPI is out of reach, and fails (exit 1, with pip's output) when pip fails while it answers."""
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(python) and subprocess.run([python, "-c", check], capture_output=True).returncode == 0:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    made = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
    if made.returncode != 0:
        sys.exit(f"FAILED: python3 -m venv {venv}: {made.stderr.strip()} (Debian: install python3-venv, "
                 "as scripts/setup.sh does)")
    pip = subprocess.run([python, "-m", "pip", "install", "--quiet", *install], capture_output=True, text=True)
    if pip.returncode != 0:
        reason = pypi_unreachable(package)
        if reason:
            print(f"SKIPPED: PyPI cannot be reached ({reason}); {what} could not be installed", flush=True)
            sys.exit(SKIPPED)
        sys.exit(f"FAILED: pip install {' '.join(install)} failed while PyPI answers:\n{pip.stdout}{pip.stderr}")
    return python
