import sys

from posttrain.runtime.stagehost import run_in_host

code = run_in_host(sys.argv[1:])  # a stage the flow's warm host runs (posttrain/runtime/stagehost.py), else None
if code is None:
    from posttrain.cli import main

    code = main()
    if sys.argv[1:2] == ["stage"]:  # a stage imported torch and TRL: end without freeing them (seconds)
        from posttrain.runtime.lifetime import exit_now

        exit_now(code)
sys.exit(code)
