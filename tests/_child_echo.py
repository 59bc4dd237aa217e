"""A child for tests/test_vllm_bench.py: ``vllm_child.child_main`` that returns a summary of its payload."""

import sys

from oasisbench.runners import vllm_child

if __name__ == "__main__":
    vllm_child.child_main(sys.argv[1:], lambda payload, status: {"n": len(payload["ids"]), "last": payload["ids"][-1]})
