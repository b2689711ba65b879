import sys

from posttrain.runtime.stagehost import run_in_host

code = run_in_host(sys.argv[1:])  # a stage the flow's warm host runs (posttrain/runtime/stagehost.py), else None
if code is None:
    if sys.argv[1:2] == ["stage"]:  # dvc.yaml's commands: the stage alone, not the CLI (an edit to it reruns nothing)
        from posttrain.runtime.lifetime import exit_now
        from posttrain.stage_entry import main

        exit_now(main(sys.argv[2:]))  # a stage imported torch and TRL: end without freeing them (seconds)
    else:
        from posttrain.cli import main

        code = main()
sys.exit(code)
