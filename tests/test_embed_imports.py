"""The embed, compare and search commands load no torch in the command's process: local workers are
then forked, not spawned (each spawned one imports torch again: seconds of start-up, and 0.4 GB)."""

from __future__ import annotations

import subprocess
import sys


def test_the_use_commands_import_neither_torch_nor_dask_nor_prefect():
    code = (
        "import sys\n"
        "import facepipe.cli, facepipe.stages.embed, facepipe.stages.compare, facepipe.stages.search, facepipe.api\n"
        "from facepipe import cluster\n"
        "print(sorted(m for m in ('torch', 'dask', 'distributed', 'prefect') if m in sys.modules), cluster.can_fork())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["[]", "True"], result.stdout + result.stderr
