"""Run ``fsdp-convert`` in a fresh interpreter and report what it imported: the start-up and precheck tests."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

_PROBE = """
import json, sys
from fsdp_convert.cli import main
sys.modules['fsdp_convert.cli.app'].exit_process = sys.exit  # the report below needs the interpreter to go on
sys.argv = ['fsdp-convert', *json.loads(sys.argv[1])]
try:
    main()
    code = 0
except SystemExit as e:
    code = e.code
print(json.dumps({'code': code, 'modules': sorted(m for m in sys.modules if m.split('.')[0] == 'torch')}))
"""


def cli_probe(argv: list[str], *, timeout: float = 300) -> tuple[dict[str, Any], str]:
    """``fsdp-convert ARGV`` in a new interpreter: ``({"code": exit code, "modules": torch's modules imported}, stderr)``."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=timeout)
    report: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return report, proc.stderr
