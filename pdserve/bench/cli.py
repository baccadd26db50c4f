"""`pdserve bench`: load an OpenAI-compatible server (`serving.py`), or one of its named runs:

- `pdserve bench compare`  colocated against disaggregated (and peers) on this machine
- `pdserve bench shift`    a workload whose shape shifts: static splits against the P:D controller
- `pdserve bench chaos`    faults injected into a running cluster, and its recovery
- `pdserve bench soak`     hours of valid and hostile traffic, audited for leaks
- `pdserve bench prefix`   a burst on one hot prefix: routing by load, by prefix, with copies
- `pdserve bench upgrade`  a live cluster moved to a new version through shadow traffic and a canary
- `pdserve bench perplexity`  a model's perplexity on a text, as llama.cpp's llama-perplexity computes it
- `pdserve bench agreement`  greedy tokens of a file against llama.cpp's server on the same file
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name, rest = (argv[0], argv[1:]) if argv else ("", [])
    if name == "compare":
        from pdserve.bench.compare import main as run
    elif name == "shift":
        from pdserve.bench.shift import main as run
    elif name == "chaos":
        from pdserve.bench.chaos.run import main as run
    elif name == "soak":
        from pdserve.bench.soak.run import main as run
    elif name == "prefix":
        from pdserve.bench.hot_prefix import main as run
    elif name == "upgrade":
        from pdserve.bench.upgrade import main as run
    elif name == "perplexity":
        from pdserve.bench.perplexity import main as run
    elif name == "agreement":
        from pdserve.bench.agreement import main as run
    else:
        from pdserve.bench.serving import main as run
        rest = argv
    return run(rest)
