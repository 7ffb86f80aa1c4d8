"""Run a public client script unchanged, then leave without the interpreter's teardown.

    python tests/support/run_then_exit.py SCRIPT [ARG ...]

The script runs as `python SCRIPT ARG ...` would run it (as __main__, its folder first on sys.path, its exit code and
any traceback kept). Only what follows is left out: the interpreter's finalization, where tritonclient's
`InferenceServerClient.__del__` closes its gRPC channel while grpc's daemon threads are being frozen. One of them can
be frozen holding the channel's lock, and then the process waits for it forever, after the client has printed
everything. Under CPU load it happened to TensorRT-LLM's end_to_end_grpc_client.py about once in 150 runs, against
any server (the main thread in grpc's `Channel._close`, called from `__del__` by the final garbage collection).
"""

import os
import runpy
import sys
import traceback

script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(script)
code = 0
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exit_:
    if isinstance(exit_.code, int) or exit_.code is None:
        code = exit_.code or 0
    else:  # sys.exit("message"): Python prints the message and exits with 1
        print(exit_.code, file=sys.stderr)
        code = 1
except BaseException:  # as Python would: the traceback on stderr, exit code 1
    traceback.print_exc()
    code = 1
finally:
    sys.stdout.flush()
    sys.stderr.flush()
os._exit(code)
