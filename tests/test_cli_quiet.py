"""The tools keep megatron-core's import-time warnings (absent Apex / Transformer Engine) off
stderr: in their own process, whose module imports run before setup_logging, and in the
processes distributed.spawn starts for them."""

import subprocess
import sys

from conftest import REPO

NOISE = "Transformer Engine and Apex are not installed"


def _stderr(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


def test_a_tool_imports_quietly():
    err = _stderr("import sys; sys.argv = ['validate', '--help']\n"
                  "from megatron_specdec.cli import validate\n"
                  "import contextlib, io\n"
                  "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
                  "    validate.build_parser().parse_args()\n")
    assert "Warning" not in err, err


def test_spawned_children_import_quietly_and_keep_the_parents_filters():
    # megatron-core's optimizer package warns as it is imported, and a child's own warning
    # shows without a filter (the checks can fail); a spawned child imports it quietly (the
    # forkserver it is forked from imported it under the tools' filters) and takes the
    # filters of the process that spawned it.
    notice = "from megatron_specdec import distributed\nimport warnings\n{}" \
             "distributed.spawn(warnings.warn, 1, 'a spawned child notice')\n"
    err = _stderr("import megatron.core.optimizer\n" + notice.format(""))
    assert NOISE in err and "a spawned child notice" in err, err
    err = _stderr("import importlib\n" + notice.format(
        "warnings.filterwarnings('ignore', message='a spawned child')\n"
        "distributed.spawn(importlib.import_module, 1, 'megatron.core.optimizer')\n"))
    assert "Warning" not in err, err
