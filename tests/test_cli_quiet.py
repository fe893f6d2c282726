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


def test_spawned_children_keep_the_tools_filters():
    # The child imports megatron-core's optimizer package, which warns as it is imported; the
    # same spawn without the tools' filters shows the warning (the check can fail).
    spawn = ("from megatron_specdec import distributed\n"
             "import importlib\n"
             "distributed.spawn(importlib.import_module, 1, 'megatron.core.optimizer')\n")
    assert NOISE in _stderr(spawn)
    err = _stderr("import megatron_specdec.cli.common\n" + spawn)
    assert "Warning" not in err, err
